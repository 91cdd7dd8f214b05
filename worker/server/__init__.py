"""The served model seen from a worker: HTTP, what an answer means, admission, the canary.

Imports ``worker.core`` and ``worker.state`` only (tests/unit/test_layers.py)."""
