"""Test-only: a vLLM server's every process uses the plain-torch rotary embedding
(tests/vllm/cpu_rope.py says why), when this directory and the repository's root are on its
PYTHONPATH."""

from tests.vllm.cpu_rope import native_rope_on_import

native_rope_on_import()
