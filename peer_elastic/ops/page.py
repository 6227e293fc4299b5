"""The dashboard's page: one HTML document with its style and script inline (no build step,
nothing loaded from elsewhere). The script polls ``/api/state`` and rebuilds the page from
it with DOM calls and ``textContent`` only: member ids, event details and reasons come from
etcd, where anyone with write access could have put markup."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>peer-elastic dashboard</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em; color: #222; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .3em; } h2 { font-size: 1.05em; margin: 1.2em 0 .3em; }
table { border-collapse: collapse; background: #fff; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } .muted { color: #777; } .bad { color: #b00; }
#summary span { margin-right: 1.4em; } svg { background: #fff; border: 1px solid #ddd; }
.grid { display: flex; flex-wrap: wrap; gap: 1.5em; }
</style></head>
<body>
<h1>peer-elastic: job <span id="job">?</span></h1>
<div id="summary" class="muted">connecting...</div>
<h2>Members</h2><table id="members"></table>
<div class="grid">
<div><h2>World size over time</h2><svg id="chart" width="560" height="170"></svg>
<div class="muted" id="chart-note"></div></div>
<div><h2>Progress</h2><div id="progress">no progress recorded</div>
<h2>Snapshots</h2><div id="snapshots"></div></div>
</div>
<h2>Generations</h2><table id="generations"></table>
<h2>Recoveries (rank 0's timing breakdown at the first step after a reset)</h2>
<div class="muted" id="recovery-note"></div><table id="recoveries"></table>
<h2>Events (newest first)</h2><table id="events"></table>
<h2>Configuration</h2><table id="config"></table>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function table(t, head, rows) {
  t.replaceChildren();
  const h = el("tr"); head.forEach((x) => h.appendChild(el("th", x))); t.appendChild(h);
  rows.forEach((r) => {
    const tr = el("tr");
    r.forEach((x) => tr.appendChild(el("td", x === null || x === undefined ? "-" : x)));
    t.appendChild(tr);
  });
}
const clock = (u) => new Date(u * 1000).toLocaleTimeString();
const ms = (s) => (s === null || s === undefined) ? "not recorded" : (s * 1000).toFixed(0) + " ms";
function chart(svg, gens, now) {
  svg.replaceChildren();
  const pts = gens.filter((g) => g.world_size !== null);
  if (!pts.length) return;
  const ns = "http://www.w3.org/2000/svg", W = 560, H = 170, L = 30, B = 20;
  const t0 = pts[0].unix, t1 = Math.max(now, t0 + 1);
  const top = Math.max(...pts.map((g) => g.world_size), 1);
  const x = (t) => L + (W - L - 10) * (t - t0) / (t1 - t0);
  const y = (v) => H - B - (H - B - 10) * v / top;
  let d = "";
  pts.forEach((g, i) => {
    d += i ? " H" + x(g.unix) + " V" + y(g.world_size)
           : "M" + x(g.unix) + " " + y(g.world_size);
    const m = document.createElementNS(ns, "circle");
    m.setAttribute("cx", x(g.unix)); m.setAttribute("cy", y(g.world_size));
    m.setAttribute("r", 3); m.setAttribute("fill", "#c33");
    const tip = document.createElementNS(ns, "title");
    tip.textContent = "generation " + g.number + ": " + g.world_size + " (" +
      (g.causes.join(", ") || "cause not recorded") + ")";
    m.appendChild(tip); svg.appendChild(m);
  });
  d += " H" + x(t1);
  const p = document.createElementNS(ns, "path");
  p.setAttribute("d", d); p.setAttribute("fill", "none"); p.setAttribute("stroke", "#36c");
  p.setAttribute("stroke-width", 2); svg.insertBefore(p, svg.firstChild);
  [0, top].forEach((v) => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", 4); t.setAttribute("y", y(v) + 4); t.textContent = v;
    svg.appendChild(t);
  });
}
function render(doc) {
  $("job").textContent = doc.job;
  const s = doc.status;
  if (!s) { $("summary").textContent = doc.note; return; }
  const sum = $("summary"); sum.replaceChildren(); sum.className = "";
  [["run", s.run_id], ["generation", s.generation], ["world size", s.world_size],
   ["leader", s.leader], ["resets", s.resets],
   ["state", s.done ? (s.done.success ? "done" : "failed: " + s.done.reason) : "running"],
   ["updated", clock(doc.now)]].forEach(([k, v]) => {
    const sp = el("span"); sp.id = "summary-" + k.replace(" ", "-");
    sp.appendChild(el("b", k + ": ")); sp.appendChild(el("span", v)); sum.appendChild(sp);
  });
  table($("members"), ["member", "host", "advertised address", "rank", "age",
                       "last seen (lease keep-alive)", "ready ack (this gen)",
                       "straggler score (own / waited per step)", "metrics"],
    s.members.map((m) => [m.id, m.host, m.net_address || "-",
      m.standby ? "standby" : m.rank, m.age_s + " s",
      m.last_seen_s === null ? "lease gone" : m.last_seen_s + " s ago",
      m.ready_acked ? "yes" : "no",
      m.straggler_score === null ? "-" : m.straggler_score.toFixed(2) + " (" +
        (m.own_s * 1000).toFixed(1) + " / " + (m.waited_s * 1000).toFixed(1) + " ms)",
      m.address || "-"]));
  if (s.pace) {
    const limit = s.config.straggler_threshold;
    $("members").querySelectorAll("tr").forEach((tr, i) => {
      const m = s.members[i - 1];
      if (m && m.straggler_score !== null && m.straggler_score >= limit) tr.className = "bad";
    });
  }
  const tlx = doc.timeline;
  chart($("chart"), tlx.generations, doc.now);
  $("chart-note").textContent = tlx.generations.some((g) => g.world_size === null)
    ? "some generations were written by an older peer-elastic that did not record world size" : "";
  const p = s.progress;
  $("progress").textContent = p ? ("epoch " + p.epoch + ", batch " + p.batch + ", step " +
    p.step + " (" + p.age_s + " s ago), " + (doc.steps_per_s === null ? "steps/s: not yet known"
    : doc.steps_per_s.toFixed(2) + " steps/s")) : "no progress recorded (the script does not call record_progress)";
  const snap = s.snapshot;  // the newest durable snapshot's record, or null
  $("snapshots").textContent = snap ? (doc.snapshot_count + " recorded; newest: " +
    snap.name + ", commit " + snap.commits + ", epoch " + snap.epoch + ", step " + snap.step +
    ", " + clock(snap.unix) + " at " + snap.host + ":" + snap.path)
    : "none recorded for this job (durable snapshots need a snapshot_dir)";
  table($("generations"), ["generation", "at", "world size", "causes", "reason"],
    tlx.generations.slice().reverse().map((g) => [g.number, clock(g.unix),
      g.world_size === null ? "not recorded" : g.world_size,
      g.causes.join(", ") || "not recorded", g.reason]));
  $("recovery-note").textContent = "Phases: " + doc.phases.map((x) => x.key + " = " + x.what)
    .join("; ") + ". A reset whose new generation never trained (or that a peer of an " +
    "older version formed) has no row.";
  if (!tlx.recoveries.length) $("recovery-note").textContent += " None recorded yet.";
  table($("recoveries"), ["generation", "at"].concat(doc.phases.map((x) => x.key), ["total"]),
    tlx.recoveries.slice().reverse().map((r) => [r.generation, clock(r.unix)]
      .concat(r.phases.map((ph) => ms(ph[1])), [ms(r.total)])));
  table($("events"), ["at", "gen", "kind", "member", "detail"],
    tlx.events.slice().reverse().slice(0, 60).map((e) => [clock(e.unix), e.generation,
      e.kind, e.member_id, e.detail]));
  table($("config"), ["setting", "value"], Object.entries(s.config));
}
async function poll() {
  try {
    const r = await fetch("/api/state", {cache: "no-store"});
    render(await r.json());
  } catch (err) {
    $("summary").textContent = "dashboard unreachable: " + err; $("summary").className = "bad";
  }
  setTimeout(poll, 500);
}
poll();
</script></body></html>
"""
