"""Real farm output for the training-side tests: a local farm (Redis, reference server with the
tiny model, one Celery worker) extracts example samples; optionally exported to every trainer.

Used by the ``farm_output`` session fixture and, as a script, by ``make trainer-data`` (the
trainers' own venvs have no Celery or Redis, so their data is made here first)::

    python -m tests.support.training_data DIR [N]
    # DIR/out (indexed, with vocab_mapping-64.pt), DIR/model (the tiny target),
    # DIR/specforge, DIR/modelopt, DIR/speculators (the exports)
    # DIR/fp8/out and DIR/fp8/<trainer>: half as many samples of an fp8 run (FARM_STORE_DTYPE)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from producer.localfarm.farm import LocalFarm, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "data.json"
FORMATS = ("specforge", "modelopt", "speculators")
DRAFT_VOCAB, TARGET_VOCAB = 64, 642  # the tiny model's vocabulary


def produce(work_dir: Path, n: int, cache_dir: Path, store_dtype: str = "bf16") -> Path:
    """Extract the first ``n`` example samples into ``work_dir/farm/out``; returns that dir.
    ``store_dtype``: the run's FARM_STORE_DTYPE (the server dumps the same)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    data = work_dir / "data.json"
    data.write_text(json.dumps(json.loads(EXAMPLES.read_text())[:n], ensure_ascii=False))
    farm = LocalFarm(work_dir / "farm", cache_dir=cache_dir, chunked_prefill_size=256,
                     extra_env={"FARM_STORE_DTYPE": store_dtype})
    try:
        farm.start_redis()
        farm.start_server(["--dump-dtype", "bfloat16" if store_dtype == "bf16" else store_dtype])
        farm.start_worker("w1", concurrency=2)
        res = farm.cli("enqueue", str(data), "--no-progress")
        assert res.returncode == 0, res.stdout + res.stderr
        samples = farm.output_dir / "samples"
        wait_until(lambda: sum(1 for _ in samples.rglob("*.safetensors")) >= n, 240,
                   f"{n} samples to be extracted", poll_s=0.5)
    finally:
        farm.close()
    return farm.output_dir


def export_all(out_dir: Path, dest_root: Path) -> None:
    """Export ``out_dir`` to every trainer's container under ``dest_root/<format>``."""
    from training.export.runner import export

    for fmt in FORMATS:
        summary = export(out_dir, fmt, dest_root / fmt, jobs=2)
        assert summary.ok and summary.exported > 0, summary.lines()


def main(argv: list[str]) -> int:
    from sglang_patch.tiny_model import ensure_tiny_model
    from tests.conftest import CACHE
    from training import index
    from training.cli import write_vocab_mapping

    dest, n = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 16
    shutil.rmtree(dest, ignore_errors=True)
    ensure_tiny_model(CACHE)
    out = produce(dest / "work", n, CACHE)
    shutil.move(str(out), str(dest / "out"))
    shutil.copytree(CACHE / "tiny-llama-v2", dest / "model")
    index.refresh(dest / "out")
    write_vocab_mapping(dest / "out", DRAFT_VOCAB, TARGET_VOCAB)
    export_all(dest / "out", dest)
    fp8 = produce(dest / "work-fp8", n // 2, CACHE, store_dtype="fp8_e4m3")
    (dest / "fp8").mkdir()
    shutil.move(str(fp8), str(dest / "fp8" / "out"))
    shutil.copytree(CACHE / "tiny-llama-v2", dest / "fp8" / "model")
    index.refresh(dest / "fp8" / "out")
    export_all(dest / "fp8" / "out", dest / "fp8")
    shutil.rmtree(dest / "work")
    shutil.rmtree(dest / "work-fp8")
    (dest / ".complete").write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
