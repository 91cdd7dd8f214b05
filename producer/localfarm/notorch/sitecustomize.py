"""For the worker processes of a ``LocalFarm`` (tests, demo, benches): make ``import torch``
fail, as on a worker host.

A worker needs no torch (pyproject: torch is the [server] extra), but this dev venv has it,
and transformers 5 imports it whenever it is installed (there is no switch), adding ~220 MB
to every worker process. Blocking it here measures what a worker host runs.
"""

import sys

sys.modules["torch"] = None  # type: ignore[assignment]
