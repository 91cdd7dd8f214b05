"""The worker's lifecycle steps (Celery bootsteps): each is given the app, never imports it.

Imports ``worker.core``, ``worker.state`` and ``worker.server`` (tests/test_layers.py)."""
