"""The worker package imports its Celery app lazily: Celery finds it, the file code needs none."""

from __future__ import annotations

import os
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
    out = _py("from celery import Celery; from celery.app.utils import find_app; "
              "a = find_app('worker'); "
              "print(isinstance(a, Celery), a.main, 'hsfarm.extract' in a.tasks or a.conf.imports)")
    # Then it gets the Celery app
    assert out.startswith("True hsfarm")


def test_file_format_code_imports_without_celery() -> None:
    out = _py("import sys, worker.core.store, worker.core.tensorfile, worker.core.final_norm; "
              "print(sorted(m for m in ('celery', 'kombu', 'redis') if m in sys.modules))")
    assert out == "[]"


def test_importing_the_producer_reads_no_environment() -> None:
    # Given a setting that cannot be read (the worker's app would stop with exit 2)
    env = {**os.environ, "FARM_TASK_TIME_LIMIT_S": "nonsense"}
    # When a fresh interpreter imports the producer's commands
    res = subprocess.run([sys.executable, "-c", "import producer.cli, producer.enqueue, "
                          "producer.status"], capture_output=True, text=True, timeout=60, env=env)
    # Then it imports: settings are read where a command runs, not at import
    assert res.returncode == 0, res.stderr
