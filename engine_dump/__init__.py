"""What an engine hook writes and the farm reads, the same for SGLang and vLLM: the dump.

The rid and sample key (``rids``), the dump file (``dumpfile``), the run ``fingerprint``, the
writer (``dump_writer``, ``cuda_stager``, ``fp8``), ready ``markers``, the dump dir's rules
(``dumpdir``), the weights identity (``checkpoint``, ``weights_hash``) and the safetensors header
codec. Both hooks (``sglang_patch``, ``vllm_hook``) import it; it imports neither, nothing of the
farm and no engine; its stdlib-only modules are what the worker imports (no torch).
"""
