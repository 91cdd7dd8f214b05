"""How ``status`` reads to a person: a few labelled lines, the reasons spelled out."""

from __future__ import annotations

from collections import Counter
from typing import Any

from producer.status import Status
from worker.core.units import size_text

SHOW_RETRYING = 20  # retrying samples listed by name (the count is always shown)


def duration(seconds: float | None) -> str:
    """``3d04h``, ``2h05m``, ``7m12s``, ``45s``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = round(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def render(st: Status, run_id: str, source: str) -> list[str]:
    """The text of ``status``: progress, broker, speed, time, pauses, retrying, finished."""
    pct = 100.0 * st.done / st.total if st.total else 0.0
    lines = [
        f"run {run_id} (from {source})",
        f"progress  {st.done}/{st.total} done ({pct:.1f}%), failed {st.failed}, "
        f"rejected {st.rejected}, remaining {st.remaining}"
        + (f", stale {st.stale} (re-run enqueue)" if st.stale else ""),
        f"broker    queued {st.queued}, unacked {st.unacked} (delivered, not yet acknowledged)"
        f"; running {st.running}, retrying {st.retrying}"
        + (f" ({st.pruned_running} stale running entries removed)" if st.pruned_running else ""),
        f"speed     {_speed(st)}; {size_text(st.bytes)} written",
        f"time      elapsed {duration(st.elapsed_s)}, ETA {_eta(st)}",
    ]
    if st.generation is not None:
        eta = (f"; ETA {duration(st.generation_eta_s)}" if st.generation_eta_s is not None
               else "")
        lines.insert(4, f"generate  {_generation_text(st.generation)}{eta}")
        if st.generation_settings:
            lines.insert(5, f"          {_generation_settings_text(st.generation_settings)}")
    lines += stall_lines(st)
    if st.admission:
        lines.append(f"host      {_admission_text(st.admission)}")
    if st.republished:
        lines.append(f"healed    {st.republished} lost task message(s) published again by the "
                     f"run itself: {', '.join(st.republished_samples)}"
                     + (" …" if len(st.republished_samples) < st.republished else ""))
    lines += host_lines(st.hosts)
    lines += _paused_lines(st)
    lines += unreadable_lines(st)
    if st.removed:
        lines.append(f"removed   {st.removed} samples left the run: their records were removed "
                     "from the corpus or corrected (output files kept in <output dir>/removed/)")
    if st.files_gone:
        lines.append(f"gone      {st.files_gone} samples marked done have no final file here any "
                     "more, not counted done ('enqueue <data file>' extracts them again): "
                     f"{', '.join(st.files_gone_samples)}"
                     + (" …" if len(st.files_gone_samples) < st.files_gone else ""))
    lines += _retrying_lines(st)
    if st.finished:
        lines.append(f"finished: every sample has an outcome ({st.done} done, {st.failed} "
                     f"failed, {st.rejected} rejected) in {duration(st.elapsed_s)}"
                     + ("; see --failures" if st.failed or st.rejected else ""))
    return lines


def host_lines(per_host: list[dict[str, Any]]) -> list[str]:
    """One line per host of a run over several hosts (none for a run on one host)."""
    if len(per_host) < 2:
        return []
    out = []
    for h in per_host:
        age = h["heartbeat_age_s"]
        seen = "never seen" if age is None else (
            f"heartbeat {duration(age)} ago" + ("" if h["alive"] else
                                                ", stopped" if h.get("state") == "stopped"
                                                else ", LOST"))
        server = h["server"] if h["alive"] else f"unknown (last seen: {h['server']})"
        out.append(f"host {h['host']:<10} done {h['done']}, running {h['running']}, "
                   f"{h['rate_per_s']:.2f}/s; server {server}; {seen}; "
                   f"output {h['output_dir']}")
    return out


def _speed(st: Status) -> str:
    if not st.rate_window_s:
        return "no sample done yet"
    return (f"{st.rate_per_s:.2f} samples/s, {size_text(st.bytes_per_s)}/s "
            f"(over the last {duration(st.rate_window_s)})")


def _generation_text(g: dict[str, float]) -> str:
    """A regenerating run's turns and decode speed: in all, since its first turn, and per
    request (its tokens over the seconds its requests took)."""
    turns, tokens = int(g.get("turns", 0)), int(g.get("tokens", 0))
    if not turns:
        return "no turn regenerated yet"
    span_s = g.get("last_at", 0.0) - g.get("first_at", 0.0)
    per_request = tokens / g["seconds"] if g.get("seconds") else 0.0
    overall = f"{tokens / span_s:.1f} tokens/s decoded, " if span_s > 0 else ""
    return (f"{turns} turns regenerated, {tokens} tokens ({overall}{per_request:.1f} tokens/s "
            "per request)")


def _generation_settings_text(g: dict[str, Any]) -> str:
    """A regenerating run's settings, as its fingerprint holds them."""
    stops = ", stop ids " + " ".join(map(str, g["stop_token_ids"])) if g.get("stop_token_ids") \
        else ""
    return (f"at most {g['max_new_tokens']} new tokens a turn, temperature {g['temperature']}, "
            f"top-p {g['top_p']}, top-k {g['top_k']}{stops}; reasoning {g['reasoning']}, a cut "
            f"turn {g['on_length']}, an empty reply {g['on_empty']}")


def _eta(st: Status) -> str:
    if st.remaining == 0:
        return "-" if st.finished else "- (nothing left to start; waiting for the broker)"
    if st.eta_s is not None:
        return duration(st.eta_s)
    if st.stall:
        return "- (STALLED, see below)"
    if st.paused:
        return "- (paused, see below)"
    return "- (no sample done in the rate window)"


def stall_lines(st: Status) -> list[str]:
    """Two lines while the run is stalled: why, and the fix."""
    if not st.stall:
        return []
    return [f"STALLED   {st.stall['reason']}", f"fix       {st.stall['fix']}"]


def _paused_lines(st: Status) -> list[str]:
    """One line per distinct pause reason, with how many processes wait on it."""
    by_reason = Counter(str(b.get("reason")) for b in st.paused.values())
    return [f"paused    {n} process{'es' if n > 1 else ''}: {reason}"
            for reason, n in by_reason.most_common()]


def unreadable_lines(st: Status) -> list[str]:
    """One line per data file whose samples are parked, with the fix."""
    return [f"parked    {b.get('parked', 0)} samples of data file #{fid}, unreadable on "
            f"{b.get('host')}: {b.get('reason')} (nothing else waits). "
            "Fix: put it back at that path (they resume by themselves), or run "
            "'python -m producer enqueue <its new path>'"
            for fid, b in st.unreadable.items()]


def _retrying_lines(st: Status) -> list[str]:
    if not st.retrying_samples:
        return []
    items = sorted(st.retrying_samples.items(), key=lambda kv: -float(kv[1].get("at", 0)))
    lines = [f"retrying: {len(items)} (last error of each; newest first)"]
    lines += [f"  {key} after attempt {body.get('attempt')}: {body.get('reason')}"
              for key, body in items[:SHOW_RETRYING]]
    if len(items) > SHOW_RETRYING:
        lines.append(f"  … and {len(items) - SHOW_RETRYING} more (status --failures lists all)")
    return lines


def _admission_text(a: dict[str, object]) -> str:
    held = f"{a['in_flight']}/" if "in_flight" in a else "max "
    gb = f"{int(str(a['dump_bytes_held'])) / 1e9:.2f}/" if "dump_bytes_held" in a else ""
    budget_gb = int(str(a["dump_budget_bytes"])) / 1e9
    groups = int(str(a.get("dp_groups", 1)))
    layout = f" ({groups} DP groups; one tmpfs budget)" if groups > 1 else ""
    return f"in flight {held}{a['max_in_flight']}, dumps {gb}{budget_gb:.2f} GB{layout}"
