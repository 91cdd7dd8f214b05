"""What an engine hook writes and the farm reads, the same for SGLang and vLLM: the dump.

The rid and file names (``contracts``), the writer (``dump_writer``, ``cuda_stager``, ``fp8``),
ready markers (``markers``), the dump dir's ownership rules (``dumpdir``), the weights identity
(``weights``, ``weights_hash``) and the one safetensors header codec. Both hooks (``sglang_patch``,
``vllm_hook``) import it; it imports neither, nothing of the farm and no engine, and its
stdlib-only modules are what the worker imports (no torch). Test: tests/unit/test_layers.py.
"""
