"""The training side: read what the farm wrote, in place or exported to a trainer's container.

- ``manifest``: the run's manifest and final-norm weight, checked.
- ``sample_file``: one output file's header and tensors, memory-mapped (no Celery, no torch).
- ``index``: one row per sample beside the manifest, refreshed incrementally; token counts.
- ``vocab``: token frequencies and SpecForge's draft-vocabulary mapping (d2t / t2d).
- ``views``: each trainer's key names and shapes for one sample (torch).
- ``loader``: a ``torch.utils.data.Dataset`` over the output dir, zero-copy.
- ``export``: streaming, verified, resumable export to SpecForge / Model-Optimizer / speculators.
- ``cli`` / ``__main__``: the ``index`` and ``export`` commands (``python -m producer ...``, or
  ``python -m training ...`` where only ``hsfarm[training]`` is installed).

Imports the shared contracts and the worker's torch-free file-format code, never Celery or
Redis: a trainer's machine has neither.
"""
