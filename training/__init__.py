"""The training side: read what the farm wrote, in place or exported to a trainer's container.

``manifest`` and ``sample_file`` check and map the run's files (no torch); ``index`` and
``vocab`` count them; ``views`` and ``loader`` hand them to a training loop (torch);
``export`` writes SpecForge / Model-Optimizer / speculators containers; ``cli`` runs ``index``
and ``export`` (``python -m training`` where only ``hsfarm[training]`` is installed).
Never imports Celery or Redis: a trainer's machine has neither.
Test: tests/farm/test_training.py::test_training_imports_and_loads_without_celery_kombu_or_redis.
"""
