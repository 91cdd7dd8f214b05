// The dashboard page: fetch /api/run, fill in the figures, draw the plots with uPlot.
"use strict";

const GB = 1e9, MB = 1e6;
const plots = {};

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600),
        m = Math.floor(s % 3600 / 60), sec = s % 60;
  if (d) return `${d}d${String(h).padStart(2, "0")}h`;
  if (h) return `${h}h${String(m).padStart(2, "0")}m`;
  return m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

function set(id, text) { document.getElementById(id).textContent = text; }
const scaled = (xs, k) => xs.map(v => (v === null || v === undefined) ? null : v / k);

// Each plot: its series (name, colour, scale) and how to take its data from a snapshot.
const SPECS = {
  progress: {
    series: [["done", "#2b7bd6"], ["failed", "#d6452b"], ["rejected", "#b58a00"]],
    data: s => [s.history.t, s.history.done, s.history.failed, s.history.rejected],
  },
  throughput: {
    series: [["samples/s", "#2b7bd6", "n"], ["MB/s", "#3aa35b", "mb"]],
    axes: [{scale: "n", label: "samples/s"}, {scale: "mb", side: 1, label: "MB/s", grid: {show: false}}],
    data: s => [s.history.t, s.history.samples_per_s, scaled(s.history.bytes_per_s, MB)],
  },
  eta: {  // seconds, shown as 45s / 12m05s / 3h20m / 2d04h on the axis and in the legend
    series: [["ETA", "#7a4fd6", "y", (u, v) => duration(v)]],
    axes: [{scale: "y", size: 60, values: (u, splits) => splits.map(duration)}],
    data: s => [s.sampled.t, s.sampled.eta_s],
  },
  disks: {
    series: [["output free", "#2b7bd6"], ["dump dir free", "#3aa35b"], ["dump dir filesystem used", "#d6452b"]],
    data: s => [s.sampled.t, scaled(s.sampled.output_free_bytes, GB),
                scaled(s.sampled.dump_free_bytes, GB), scaled(s.sampled.dump_used_bytes, GB)],
  },
  broker: {
    series: [["queued", "#2b7bd6"], ["unacked", "#b58a00"], ["running", "#3aa35b"],
             ["retrying", "#d6452b"], ["workers", "#555"], ["paused", "#e07b00"]],
    data: s => [s.sampled.t, s.sampled.queued, s.sampled.unacked, s.sampled.running,
                s.sampled.retrying, s.sampled.workers, s.sampled.paused],
  },
  server: {
    series: [["up (1) / down (0)", "#3aa35b", "up"], ["/health ms", "#2b7bd6", "lat"]],
    axes: [{scale: "up", label: "up"}, {scale: "lat", side: 1, label: "ms", grid: {show: false}}],
    data: s => [s.sampled.t, s.sampled.server_up, scaled(s.sampled.server_latency_s, 1e-3)],
  },
};

function makePlot(name, spec, data) {
  const box = document.getElementById(`plot-${name}`);
  const width = Math.max(box.clientWidth - 16, 400);
  const opts = {
    width, height: 220,
    series: [{}].concat(spec.series.map(([label, stroke, scale, value]) =>
      ({label, stroke, width: 2, scale: scale || "y", spanGaps: false, ...(value ? {value} : {})}))),
    axes: [{}].concat(spec.axes || [{scale: "y"}]),
    scales: {x: {time: true}},
  };
  return new uPlot(opts, data, box);
}

function draw(snap) {
  for (const [name, spec] of Object.entries(SPECS)) {
    const data = spec.data(snap);
    if (plots[name]) plots[name].setData(data);
    else plots[name] = makePlot(name, spec, data);
    document.getElementById(`plot-${name}`).dataset.points = data[0].length;
  }
}

function rows(tableId, items, cells) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...items.map(item => {
    const tr = document.createElement("tr");
    for (const [text, cls] of cells(item)) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    return tr;
  }));
}

function fill(snap) {
  const st = snap.status;
  set("run", snap.run);
  set("updated", new Date(snap.now * 1000).toLocaleTimeString());
  set("v-done", st.done); set("v-total", st.total);
  set("v-pct", st.total ? `${(100 * st.done / st.total).toFixed(1)}%` : "");
  set("v-failed", st.failed); set("v-rejected", st.rejected); set("v-retrying", st.retrying);
  set("v-republished", st.republished);
  set("v-queued", st.queued); set("v-unacked", st.unacked); set("v-running", st.running);
  set("v-rate", st.rate_window_s ? `${st.rate_per_s.toFixed(2)}/s` : "-");
  set("v-bytes-rate", st.rate_window_s ? `${(st.bytes_per_s / MB).toFixed(1)} MB/s` : "");
  set("v-elapsed", duration(st.elapsed_s)); set("v-eta", duration(st.eta_s));
  // a regenerating run: its turns and decode speed beside the samples extracted
  const gen = st.generation;
  document.getElementById("regenerated").hidden = !gen;
  if (gen) {
    const span = (gen.last_at || 0) - (gen.first_at || 0);
    set("v-turns", gen.turns || 0);
    set("v-decode-rate", (span > 0 ? `${(gen.tokens / span).toFixed(1)} tokens/s decoded` : "") +
      (st.generation_eta_s != null ? `, ETA ${duration(st.generation_eta_s)}` : ""));
  }
  // a finished run needs no server: one that is gone then was stopped, not lost
  set("v-server", snap.server.up ? "up" : st.finished ? "stopped" : "DOWN");
  set("v-server-detail", !snap.server.up && st.finished ?
    `after the run finished (${snap.server.detail})` : snap.server.detail);
  const notes = snap.disks.notes || [];
  const note = document.getElementById("disks-note");
  note.hidden = !notes.length;
  note.textContent = notes.join(" ");
  set("v-workers", snap.sampled.workers[snap.sampled.workers.length - 1]);
  const paused = Object.values(st.paused).map(p => p.reason);
  const box = document.getElementById("paused");
  box.hidden = !paused.length;
  box.textContent = paused.length ? `paused (${paused.length}): ${[...new Set(paused)].join("; ")}` : "";
  // the state and the stall are the server's (producer/stall.py): one rule for status too
  const stall = document.getElementById("stall");
  stall.hidden = !st.stall;
  stall.replaceChildren();
  if (st.stall) {
    const why = document.createElement("b");
    why.textContent = `Stalled: ${st.stall.reason}`;
    const fix = document.createElement("div");
    fix.textContent = `Fix: ${st.stall.fix}`;
    stall.append(why, fix);
  }
  set("v-eta", st.stall ? "- (stalled)" : duration(st.eta_s));
  const state = document.getElementById("state");
  state.textContent = st.state;
  state.className = `badge ${st.state}`;
  rows("failures", snap.failures, f => [[f.kind], [f.count], [f.reason, "reason"], [f.example]]);
  rows("workers", snap.workers, w => [[w.process], [w.kind], [w.detail, "reason"]]);
  const beat = h => h.alive ? "" : h.state !== "stopped" ? " (LOST)" :
    st.finished ? " (stopped after the finish)" : " (stopped)";
  rows("hosts", st.hosts, h => [[h.host], [h.done], [h.running], [h.rate_per_s.toFixed(2)],
    [h.server, "reason"], [h.heartbeat_age_s === null ? "never" :
      `${duration(h.heartbeat_age_s)} ago${beat(h)}`], [h.output_dir]]);
}

async function refresh() {
  let wait = 10;
  const err = document.getElementById("error");
  try {
    // location.origin: a page opened as http://user:pw@host/ resolves a relative URL with the
    // credentials in it, which fetch refuses; the browser sends the cached ones by itself
    const resp = await fetch(`${location.origin}/api/run`, {credentials: "same-origin", cache: "no-store"});
    const snap = await resp.json();
    err.hidden = !snap.error;
    err.textContent = snap.error || "";
    if (resp.ok) {
      fill(snap);
      draw(snap);
      wait = snap.sample_s || wait;
      document.body.dataset.ready = "1";
    }
  } catch (e) {
    err.hidden = false;
    err.textContent = `cannot reach the dashboard: ${e}`;
  }
  setTimeout(refresh, wait * 1000);
}

refresh();
