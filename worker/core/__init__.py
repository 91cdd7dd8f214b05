"""The farm's core: file formats, the output store and the settings.

Imports no Celery, kombu, Redis, aiohttp or transformers (tests/unit/test_layers.py), so the
training side and the tools that only read an output dir run without them."""
