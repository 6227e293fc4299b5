"""``peer-elastic report``: a run's :class:`~peer_elastic.ops.timeline.Timeline` as a
self-contained SVG (or an HTML page around it): world size and throughput over time on one
time axis, every event marked with a line (its details in a tooltip), and a table of the
recoveries' timing phases in the HTML version. No plotting library: a few SVG elements."""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

from peer_elastic.ops.timeline import PHASES, Timeline

W, LEFT, RIGHT = 1000, 60, 20
PANEL_H, GAP, TOP = 160, 40, 40

#: Marker colours by event kind (others grey).
COLOURS = {"generation": "#36c", "expired": "#c33", "left": "#e80", "joined": "#3a3",
           "drain requested": "#e80", "generation formed": "#639", "hung": "#c33",
           "broken": "#c33", "state_lost": "#c0c", "straggler": "#c60", "done": "#000"}


def _fmt_time(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix))


def render_svg(t: Timeline, job: str) -> str:
    """The timeline of ``t`` as one SVG document."""
    stamps = [e.unix for e in t.events] + [p.unix for p in t.progress]
    t0 = min(stamps) if stamps else time.time()
    t1 = max(max(stamps) if stamps else t0, t0 + 1.0)
    height = TOP + 2 * PANEL_H + GAP + 60

    def x(u: float) -> float:
        return LEFT + (W - LEFT - RIGHT) * (u - t0) / (t1 - t0)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
           f'viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{height}" fill="#fff"/>',
           f'<text x="{LEFT}" y="20" font-size="14">job {escape(job)}, run {escape(t.run_id)}: '
           f'{len(t.generations)} generations, {len(t.events)} events</text>']

    def panel(top: float, title: str, points: list[tuple[float, float]], step: bool,
              colour: str, note: str) -> None:
        bottom = top + PANEL_H
        out.append(f'<rect x="{LEFT}" y="{top}" width="{W - LEFT - RIGHT}" height="{PANEL_H}" '
                   'fill="none" stroke="#ccc"/>')
        out.append(f'<text x="{LEFT}" y="{top - 6}">{escape(title)}</text>')
        if not points:
            out.append(f'<text x="{LEFT + 10}" y="{top + 20}" fill="#777">{escape(note)}</text>')
            return
        top_v = max(v for _, v in points) or 1.0

        def y(v: float) -> float:
            return bottom - (PANEL_H - 10) * v / top_v

        d = f"M{x(points[0][0]):.1f} {y(points[0][1]):.1f}"
        for u, v in points[1:]:
            d += (f" H{x(u):.1f} V{y(v):.1f}" if step else f" L{x(u):.1f} {y(v):.1f}")
        if step:
            d += f" H{x(t1):.1f}"
        out.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for v in (0, top_v):
            label = f"{v:g}" if step else f"{v:.2f}"
            out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{label}'
                       '</text>')
        if note:
            out.append(f'<text x="{LEFT + 10}" y="{top + 14}" fill="#777">{escape(note)}</text>')

    sizes = [(g.unix, float(g.world_size)) for g in t.generations if g.world_size is not None]
    old = any(g.world_size is None for g in t.generations)
    panel(TOP, "world size", sizes, True, "#36c",
          "some generations do not record their size (older writer)" if old else
          ("" if sizes else "no generation recorded"))
    panel(TOP + PANEL_H + GAP, "throughput (steps/s, from the progress record)",
          t.throughput(), False, "#444",
          "" if t.progress_complete else "earlier progress compacted away by etcd"
          if t.throughput() else "no throughput: the run records no progress")
    bottom = TOP + 2 * PANEL_H + GAP
    for e in t.events:
        colour = COLOURS.get(e.kind, "#999")
        tip = f"{_fmt_time(e.unix)} gen {e.generation} {e.kind} {e.member_id} {e.detail}"
        if e.causes:
            tip += f" (causes: {', '.join(e.causes)})"
        if e.timings_s:
            tip += " [" + " ".join(f"{k}={v * 1000:.0f}ms" for k, v in e.timings_s.items()) + "]"
        out.append(f'<line class="event" data-kind="{escape(e.kind)}" x1="{x(e.unix):.1f}" '
                   f'x2="{x(e.unix):.1f}" y1="{TOP}" y2="{bottom}" stroke="{colour}" '
                   f'stroke-opacity="0.6"><title>{escape(tip)}</title></line>')
    out.append(f'<text x="{LEFT}" y="{bottom + 18}">{_fmt_time(t0)}</text>')
    out.append(f'<text x="{W - RIGHT}" y="{bottom + 18}" text-anchor="end">{_fmt_time(t1)}'
               '</text>')
    legend_x = LEFT
    for kind, colour in COLOURS.items():
        out.append(f'<line x1="{legend_x}" x2="{legend_x + 14}" y1="{bottom + 40}" '
                   f'y2="{bottom + 40}" stroke="{colour}" stroke-width="3"/>'
                   f'<text x="{legend_x + 18}" y="{bottom + 44}">{escape(kind)}</text>')
        legend_x += 30 + 6 * len(kind)
    out.append("</svg>")
    return "\n".join(out)


def render_html(t: Timeline, job: str) -> str:
    """An HTML page: the SVG, the recoveries' phases and the event log."""
    rows = "".join(
        "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in (
            r.generation, _fmt_time(r.unix),
            *("not recorded" if v is None else f"{v * 1000:.0f} ms" for _, v in r.phases),
            "not recorded" if r.total is None else f"{r.total * 1000:.0f} ms")) + "</tr>"
        for r in t.recoveries)
    head = "".join(f"<th>{escape(h)}</th>" for h in
                   ("generation", "at", *(k for k, _ in PHASES), "total"))
    events = "".join(
        f"<tr><td>{_fmt_time(e.unix)}</td><td>{e.generation}</td><td>{escape(e.kind)}</td>"
        f"<td>{escape(e.member_id)}</td><td>{escape(e.detail)}</td></tr>" for e in t.events)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>peer-elastic report: "
            f"{escape(job)}</title><style>body{{font:14px sans-serif;margin:1em}}"
            "td,th{border:1px solid #ddd;padding:2px 6px}table{border-collapse:collapse}"
            f"</style></head><body><h1>peer-elastic report: {escape(job)}</h1>"
            f"{render_svg(t, job)}<h2>Recoveries</h2>"
            + (f"<table><tr>{head}</tr>{rows}</table>" if rows else
               "<p>none recorded (rank 0 records one at the first step after a reset)</p>")
            + f"<h2>Events</h2><table><tr><th>at</th><th>gen</th><th>kind</th><th>member</th>"
            f"<th>detail</th></tr>{events}</table></body></html>")


def write_report(t: Timeline, job: str, out: Path) -> None:
    """Write ``t`` to ``out``: SVG for ``.svg``, HTML otherwise."""
    text = render_svg(t, job) if out.suffix == ".svg" else render_html(t, job)
    out.write_text(text, encoding="utf-8")
