"""Server side of hsfarm: the dump hook for SGLang, the dump writer and the reference server.

Importing this package is cheap and imports nothing from the farm (worker/, producer/) and
no torch: ``contracts`` is shared with the worker, which runs without torch.
"""

from sglang_patch.contracts import PATCH_VERSION as __version__

__all__ = ["__version__"]
