"""The worker package imports its Celery app lazily: Celery finds it, the file code needs none."""

from __future__ import annotations

import subprocess
import sys


def _py(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_celery_finds_the_app_as_celery_dash_a_worker_does() -> None:
    # Given a fresh interpreter, When Celery's own find_app resolves "worker" (what
    # `celery -A worker worker` runs; the e2e test starts real workers that way)
    out = _py("from celery.app.utils import find_app; a = find_app('worker'); "
              "print(type(a).__name__, a.main, 'hsfarm.extract' in a.tasks or a.conf.imports)")
    # Then it gets the Celery app
    assert out.startswith("Celery hsfarm")


def test_file_format_code_imports_without_celery() -> None:
    out = _py("import sys, worker.core.store, worker.core.tensorfile, worker.core.final_norm; "
              "print(sorted(m for m in ('celery', 'kombu', 'redis') if m in sys.modules))")
    assert out == "[]"
