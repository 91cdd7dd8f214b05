"""Task ids: one per publication of a sample, the sample key recoverable from each."""

from __future__ import annotations

from worker.state.queue_scan import sample_key_of, task_id


def test_task_ids_name_their_sample_and_publication() -> None:
    fp = "0123456789abcdef"
    tid = task_id(fp, 7, "ex-0001")
    assert tid == "hsd-0123456789abcdef-7:ex-0001" and task_id(fp, 8, "ex-0001") != tid
    assert sample_key_of(tid, fp) == "ex-0001"
    assert sample_key_of(task_id(fp, 12, "a-b-c"), fp) == "a-b-c"  # keys may hold dashes
    assert sample_key_of(f"hsd-{fp}-ex-0001", fp) == "ex-0001"  # before publication numbers
    # keys that start with digits and a dash, in both formats
    for key in ("2024-01-foo", "12345678-abcd-4ef0", "01-foo"):
        assert sample_key_of(task_id(fp, 3, key), fp) == key
        assert sample_key_of(f"hsd-{fp}-{key}", fp) == key
    for other in ("hsd-ffffffffffffffff-1:ex-0001", "plain-3", f"hsd-{fp}-", f"hsd-{fp}-x:y"):
        assert sample_key_of(other, fp) is None, other
