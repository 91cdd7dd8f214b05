"""The vLLM hook: a KV connector, found by vLLM's plugin loader, that writes the farm's dumps.

It writes the same files as the SGLang hook (``sglang_patch``) through the same engine-neutral
package, ``engine_dump``: rid and file names (``rids``, ``dumpfile``), the writer
(``dump_writer``), the ready marker (``markers``) and the dump dir's checks (``dumpdir``).
Nothing here runs unless a vLLM launch names the connector ``HsfarmConnector``. Tests:
tests/vllm (``make test-vllm``).
"""
