"""The run's state in Redis: keys, the index of outcomes, leases, hosts, what kombu holds.

Imports ``worker.core`` and Redis, never Celery's app or the server side
(tests/unit/test_layers.py)."""
