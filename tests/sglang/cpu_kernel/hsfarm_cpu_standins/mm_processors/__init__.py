"""Test-only multimodal processors, registered by SGLang's tokenizer manager through
``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=hsfarm_cpu_standins.mm_processors`` (set only by the
live Kimi-K2.5 test server)."""
