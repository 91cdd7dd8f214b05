"""``python -m producer dashboard``: the run's page and ``/metrics``."""
