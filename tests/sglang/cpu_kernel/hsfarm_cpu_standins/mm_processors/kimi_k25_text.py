"""Kimi-K2.5 without Kimi's own (remote-code) processor: text requests only.

SGLang 0.5.23's ``KimiK2_5VLImageProcessor`` reads ``_processor.media_processor.media_proc_cfg``
(``multimodal/processors/kimi_k25.py``), an attribute of the processor shipped as remote code in
Kimi-K2.5's checkpoint, which a tiny local checkpoint does not have; transformers' own
``Kimi_K25Processor`` lacks it, so the tokenizer manager fails at start-up. The farm sends
token ids only and no image, so this stand-in takes that processor's place for the tiny model
and refuses any request that carries media.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor


class KimiK25TextOnlyProcessor(BaseMultimodalProcessor):
    models: ClassVar[list[type]] = [KimiK25ForConditionalGeneration]

    async def process_mm_data_async(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("hsfarm test-only Kimi-K2.5 processor: text requests only")
