"""The vLLM plugin: entry point ``vllm.general_plugins: hsfarm_dump = vllm_hook.plugin:load``.

vLLM runs its general plugins in the API server, the engine core and every worker process.
``load`` registers the connector name ``HsfarmConnector`` with vLLM's connector factory, lazily
(the factory imports ``vllm_hook.connector`` only for a launch that names it), so an
installed hsfarm changes nothing for any other launch. A launch that names it without
``HSFARM_VLLM_DUMP_DIR`` is refused with the fix. Test: tests/vllm/test_plugin.py
"""

from __future__ import annotations

import contextlib

from vllm_hook.layout import CONNECTOR_NAME

CONNECTOR_MODULE = "vllm_hook.connector"
CONNECTOR_CLASS = "HsfarmConnector"


def load() -> None:
    """Plugin entry point: make ``HsfarmConnector`` a connector name (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # vLLM may run the plugins twice in one process
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
