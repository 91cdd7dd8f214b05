"""The run-level figures in Prometheus' text exposition format (version 0.0.4).

Written out here rather than with ``prometheus_client``: a dozen gauges rendered from one
snapshot need no registry, collectors or process metrics, and the farm keeps one dependency
fewer. The tests parse this output with prometheus_client's own parser (Flower brings it into
the dev environment), so the format is checked by the reference implementation.
"""

from __future__ import annotations

import math
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Exposition:
    """Gauges, each with its HELP and TYPE lines once, then its samples."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.lines: list[str] = []
        self.seen: set[str] = set()

    def gauge(self, name: str, help_text: str, value: float | None, **labels: str) -> None:
        if value is None:
            return
        if name not in self.seen:
            self.seen.add(name)
            self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        self.lines.append(f"{name}{_labels({'run': self.run, **labels})} {_number(value)}")

    def counter(self, name: str, help_text: str, value: float) -> None:
        """A value that only grows (``name`` ends in ``_total``)."""
        if name not in self.seen:
            self.seen.add(name)
            self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        self.lines.append(f"{name}{_labels({'run': self.run})} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(snapshot: dict[str, Any]) -> str:
    """The exposition of one dashboard snapshot (``Sampler.snapshot``)."""
    st, e = snapshot["status"], Exposition(snapshot["run"])
    for state in ("total", "done", "failed", "rejected", "stale", "retrying", "running",
                  "remaining", "parked", "removed"):
        e.gauge("hsfarm_samples", "Samples of the run by state", st.get(state), state=state)
    for state in ("queued", "unacked"):
        e.gauge("hsfarm_broker_messages", "Task messages waiting in the queue, or delivered "
                "and not acknowledged", st[state], state=state)
    e.counter("hsfarm_republished_total", "Lost task messages the run published again by "
              "itself (the reconciler)", st.get("republished", 0))
    e.gauge("hsfarm_finished", "1 when every sample has an outcome and nothing is in flight",
            1 if st["finished"] else 0)
    stall = st.get("stall") or {}
    e.gauge("hsfarm_stalled", "1 while the run's work waits and nothing moves; reason: "
            "no_worker, server_down, dump_dir, paused, no_progress or redis (none: 0)",
            1 if stall else 0, reason=str(stall.get("kind", "none")))
    e.gauge("hsfarm_written_bytes", "Bytes of verified final files", st["bytes"])
    e.gauge("hsfarm_tokens", "Tokens in verified final files", st["tokens"])
    e.gauge("hsfarm_rate_samples_per_second", "Samples done per second (moving window)",
            st["rate_per_s"])
    e.gauge("hsfarm_rate_bytes_per_second", "Bytes written per second (moving window)",
            st["bytes_per_s"])
    e.gauge("hsfarm_eta_seconds", "Estimated seconds until every sample has an outcome",
            st["eta_s"])
    e.gauge("hsfarm_elapsed_seconds", "Seconds since the run's first enqueue", st["elapsed_s"])
    e.gauge("hsfarm_paused_processes", "Processes waiting out the environment",
            len(st["paused"]))
    _hosts(e, st.get("hosts", []))
    last = {k: v[-1] for k, v in snapshot["sampled"].items() if v}
    for disk in ("output", "dump"):
        e.gauge("hsfarm_disk_free_bytes", "Free bytes on the output disk and the dump dir's "
                "filesystem (as seen by the dashboard's host)",
                last.get(f"{disk}_free_bytes"), disk=disk, path=snapshot["disks"][disk])
    e.gauge("hsfarm_server_up", "1 when the inference server answered /health",
            last.get("server_up"))
    e.gauge("hsfarm_server_health_seconds", "Time the server took to answer /health",
            last.get("server_latency_s"))
    e.gauge("hsfarm_workers", "Worker main processes with a live heartbeat", last.get("workers"))
    for f in snapshot["failures"]:
        e.gauge("hsfarm_failures", "Failed, rejected and retrying samples by reason",
                f["count"], kind=f["kind"], reason=f["reason"])
    return e.text()


def _hosts(e: Exposition, hosts: list[dict[str, Any]]) -> None:
    """Per host of the run: done there, running, rate, alive, server up."""
    for h in hosts:
        host = str(h["host"])
        e.gauge("hsfarm_host_done", "Samples whose final file this host's output dir holds",
                h["done"], host=host)
        e.gauge("hsfarm_host_running", "Samples running on this host", h["running"], host=host)
        e.gauge("hsfarm_host_rate_samples_per_second", "Samples done on this host per second "
                "(moving window)", h["rate_per_s"], host=host)
        e.gauge("hsfarm_host_alive", "1 while this host's heartbeat is fresh",
                1 if h["alive"] else 0, host=host)
        e.gauge("hsfarm_host_server_up", "1 when this host's server answered /health at its "
                "last heartbeat", 1 if h["server"] == "ok" else 0, host=host)
        e.gauge("hsfarm_host_heartbeat_age_seconds", "Seconds since this host's last heartbeat",
                h["heartbeat_age_s"], host=host)
