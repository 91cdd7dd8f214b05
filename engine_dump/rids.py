"""The request id (rid) and the sample key it carries, shared by the hooks and the farm.

``hsd-<run>-<sample_key>-a<attempt>-n<tokens>``: the run first, at a fixed width, so a rid
parses one way and every dump file name says whose it is. A sample key is a record's id made
safe for a file name (or its content's hash), never longer than every name of its files allows.
Standard library only: the hooks load it without the farm. Test: tests/unit/test_rids.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

RID_PREFIX = "hsd-"
_KEY_CHARS = r"A-Za-z0-9_.\-"
RUN_ID_LEN = 16
# The run a request belongs to leads the rid, at a fixed width, so a rid always parses the
# one way (a sample key may itself hold hex digits and dashes), and every dump file name says
# whose it is: two runs sharing a dump dir never take, collect or delete each other's dumps.
RID_RE = re.compile(rf"^hsd-(?P<run>[0-9a-f]{{{RUN_ID_LEN}}})-(?P<key>[{_KEY_CHARS}]+)"
                    r"-a(?P<attempt>\d+)-n(?P<n>\d+)$")
RUN_ID_RE = re.compile(rf"^[0-9a-f]{{{RUN_ID_LEN}}}$")
MAX_KEY_LEN = 96
# The longest rid of ours: every file of it must be nameable, or not even its ``.err`` can be
# written. Its longest name, the writer's temp ``.err`` (``.<rid>.tmp.<pid>.err``), is 20
# bytes more with a 10-digit pid, under a file system's 255 (NAME_MAX); the longest rid the
# farm makes (a 96-character key) is about 150.
MAX_RID_LEN = 200
# The run of requests that belong to no run (the probe ``sglang_patch verify`` sends)
NO_RUN = "0" * RUN_ID_LEN


@dataclass(frozen=True)
class Rid:
    """A parsed request id: which run, which sample, which attempt, how many tokens were sent."""

    sample_key: str
    attempt: int
    token_count: int
    run: str = NO_RUN

    def __str__(self) -> str:
        return (f"{RID_PREFIX}{self.run}-{self.sample_key}-a{self.attempt}"
                f"-n{self.token_count}")


def make_rid(sample_key: str, attempt: int, token_count: int, run: str = NO_RUN) -> str:
    """Build the rid for one extraction request of run ``run``.

    Raises:
        ValueError: the key is not a sanitised sample key, the run is not a run id, or the
            numbers are out of range.
    """
    if not is_valid_sample_key(sample_key):
        raise ValueError(f"not a sanitised sample key: {sample_key!r}")
    if not RUN_ID_RE.match(run):
        raise ValueError(f"not a run id ({RUN_ID_LEN} hex digits): {run!r}")
    if attempt < 0 or token_count < 1:
        raise ValueError(f"bad attempt/token_count: {attempt}/{token_count}")
    rid = str(Rid(sample_key, attempt, token_count, run))
    if len(rid) > MAX_RID_LEN:
        raise ValueError(f"rid of {len(rid)} characters, over {MAX_RID_LEN}: {rid[:40]}...")
    return rid


def parse_rid(rid: object) -> Rid | None:
    """Parse a rid; None for anything that is not an extraction request of ours, a rid
    too long for its files' names included (over ``MAX_RID_LEN``, or its key over
    ``MAX_KEY_LEN``): the hooks take only a request whose dump or ``.err`` can be written.
    Test: tests/unit/test_rids.py::test_a_rid_parses_only_if_every_file_name_of_it_fits."""
    if not isinstance(rid, str) or len(rid) > MAX_RID_LEN:
        return None
    m = RID_RE.match(rid)
    if m is None or len(m["key"]) > MAX_KEY_LEN:
        return None
    return Rid(m["key"], int(m["attempt"]), int(m["n"]), m["run"])


# The keys of the requests the farm sends for itself (the canary, ``sglang_patch verify``): a
# record's id never becomes one, and the hooks dump them in bf16 whatever the server stores
# (``dumpfile.dump_dtype_for``): the canary compares unquantized states, as sensitive as in a
# bf16 run (rounding to fp8 would turn a 0.5% numerics change into ~2% of flipped steps).
INTERNAL_KEY_PREFIX = "_hsfarm_"

_SAFE_KEY_RE = re.compile(rf"^[A-Za-z0-9_][{_KEY_CHARS}]*$")
_UNSAFE_CHAR_RE = re.compile(rf"[^{_KEY_CHARS}]")


def is_valid_sample_key(key: str) -> bool:
    """True if ``key`` is usable as a file name and inside a rid as it is."""
    return len(key) <= MAX_KEY_LEN and bool(_SAFE_KEY_RE.match(key)) and ".." not in key


def is_user_sample_key(key: str) -> bool:
    """A valid key that is not the farm's own (``INTERNAL_KEY_PREFIX``: the canary and the
    probes, dumped in bf16 whatever the run stores): a record's id never becomes one."""
    return is_valid_sample_key(key) and not key.startswith(INTERNAL_KEY_PREFIX)


def sample_key_for(source_id: object, content_sha256: str) -> str:
    """Turn a record's id (any JSON scalar, or None) into a safe, stable sample key.

    A safe id is kept; any other is replaced character by character and suffixed with a hash of
    the original, so two ids never collide by sanitising. A record without an id is keyed by its
    content (``rec-<content hash>``), not its position: two data files both have a record 5, and
    an inserted record would shift every key after it.
    Test: tests/unit/test_rids.py::test_records_without_id_are_keyed_by_content_not_position.
    """
    if source_id is None:
        return f"rec-{content_sha256[:20]}"
    text = source_id if isinstance(source_id, str) else json.dumps(source_id)
    if is_user_sample_key(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    cleaned = _UNSAFE_CHAR_RE.sub("_", text).replace("..", "__").lstrip("._-")
    cleaned = cleaned[: MAX_KEY_LEN - len(digest) - 1]
    return f"{cleaned}_{digest}" if cleaned else f"id_{digest}"
