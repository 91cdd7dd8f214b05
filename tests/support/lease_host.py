"""One host's writer of one sample, run inside the host's network namespace by
tests/farm/test_lease_partition.py: it takes the sample's lease in Redis (waiting for it while
another holds it), waits for the test's go file, then writes the sample's final file under
the lease as an attempt does (``Lease.check`` just before ``OutputStore.write``), and prints
what happened: ``leased``, then ``wrote`` or ``LeaseLost: ...``.

    python -m tests.support.lease_host REDIS_URL OUT_DIR KEY NAME TTL_S GO_FILE WRITE_DELAY_S
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import redis

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from engine_dump.fingerprint import LAYER_CONVENTION, Fingerprint
from worker.core.errors import LeaseLost
from worker.core.finalfile import M_CONTENT
from worker.core.store import OutputStore, Part
from worker.state import lease as leases

H = 4
N_TOKENS = 64


def fingerprint() -> Fingerprint:
    return Fingerprint(
        config_sha256="a", tokenizer_sha256="b", chat_template_sha256="c",
        layers_to_capture=(2, 4, 5), layer_convention=LAYER_CONVENTION, hidden_size=H,
        dtype="bfloat16", max_tokens=8192, overlong="reject")


def parts(seed: int) -> dict[str, Part]:
    rng = np.random.default_rng(seed)
    n = N_TOKENS
    return {T_INPUT_IDS: Part.from_array("I64", np.arange(n, dtype=np.int64)),
            T_LOSS_MASK: Part.from_array("I64", np.ones(n, dtype=np.int64)),
            T_HIDDEN: Part.from_array("BF16", rng.integers(0, 0x3F00, (n, H), dtype=np.uint16)),
            T_AUX: Part.from_array("BF16",
                                   rng.integers(0, 0x3F00, (n, 3 * H), dtype=np.uint16))}


def main(argv: list[str]) -> int:
    url, out, key, name, ttl_s, go, delay_s = argv
    r = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    store = OutputStore(Path(out), fingerprint(), debug_write_delay_s=float(delay_s)).open()
    lease_key = leases.lease_name("partition-test", key)
    while not isinstance(got := leases.try_acquire(r, lease_key, float(ttl_s)), leases.Lease):
        time.sleep(0.1)
    print("leased", flush=True)
    while not Path(go).exists():
        time.sleep(0.05)
    try:
        got.check()
        store.write(key, parts(sum(map(ord, name))), {M_CONTENT: name})
    except LeaseLost as e:
        print(f"LeaseLost: {e}", flush=True)
        return 3
    print("wrote", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
