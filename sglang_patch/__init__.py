"""The SGLang hook (a plugin, no source edit), its ``verify``, and the reference server.

The dump it writes, and everything about it the farm reads, is ``engine_dump``'s, shared with
the vLLM hook. Importing this package is cheap: no torch, nothing of the farm.
"""

from engine_dump.dumpfile import PATCH_VERSION as __version__

__all__ = ["__version__"]
