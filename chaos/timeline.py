"""A picture of a soak's history: one lane per process, its operations, the nemesis shaded.

Theory of operation
-------------------

:func:`render` turns a :class:`~knownstate.chaos.history.History` and its
:class:`~knownstate.chaos.history.Verdict` into one self-contained HTML page: inline CSS and one
inline SVG, no script, no font or image from anywhere else, so it opens offline and can be
attached to a CI run as it is.

The SVG has a lane per process (``p0`` the producer, ``w0``.. the workers, ``r0`` the reaper or
reader) and one for the database and the stand-in. Along a lane, thin grey bars are the
process's incarnations (a red cross where the nemesis killed one). Its operations are drawn
as a strip per outcome — won, lost or refused (a race lost, a fence refusal), an error
(connection lost, aborted, an external call that failed), indeterminate, cut by a kill — one
mark per pixel column that had any, so a two-minute history of ten thousand operations stays
small and readable. Nemesis periods are shaded on the lane of the process they hit, or across
every lane for what touches them all (the database crashed, its clock moved, the stand-in
slowed or refusing); a dashed line marks where the quiet period began. Violations are red
numbered dots on the lane of the operation that committed them, duplicates orange diamonds on
the lane of the worker whose lease lapsed; hovering shows the text, and the lists below the
picture repeat it.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape
from . import outpath
from .history import History, Verdict

WIDTH = 1500
LEFT = 96
RIGHT = 24
TOP = 34
LANE = 58
ROW = 7

OUTCOMES = (  # strip, colour, outcomes
    ("won", "#2e9d4f", ("won", "ok")),
    ("lost or refused", "#8a8f98", ("lost", "rejected", "retryable", "permanent")),
    ("error", "#d9822b", ("conn-lost", "aborted", "ext-failed", "error")),
    ("indeterminate", "#8e44ad", ("indeterminate",)),
    ("cut by a kill", "#111111", (None,)),
)
FAULT_COLOURS = {  # one per fault the soak's nemesis injects (faults.SOAK_FAULTS)
    "process-kill": "#e74c3c",
    "worker-stall": "#f1c40f",
    "worker-hold": "#d4ac0d",
    "link-down": "#3498db",
    "db-crash": "#c0392b",
    "db-clock-jump": "#16a085",
    "db-clock-strobe": "#1abc9c",
    "stand-in-refuses": "#e67e22",
    "stand-in-slow": "#9b59b6",
}


def _lanes(h: History) -> list[str]:
    names = sorted(
        {p.name for p in h.procs} | {o.proc for o in h.ops},
        key=lambda n: ({"p": 0, "w": 1, "r": 2}.get(n[0], 3), n),
    )
    return names + ["db / stand-in"]


def render(h: History, v: Verdict, title: str = "knownstate soak") -> str:
    lanes = _lanes(h)
    lane_of = {name: i for i, name in enumerate(lanes)}
    starts = [p.start for p in h.procs] + [o.t0 for o in h.ops] + [h.t0]
    ends = (
        [p.end or p.start for p in h.procs]
        + [o.t1 or o.t0 for o in h.ops]
        + [p.end for p in h.periods]
    )
    lo, hi = min(starts), max(ends + [h.t0 + 1])
    span = (hi - lo) or 1.0
    usable = WIDTH - LEFT - RIGHT

    def x(t: float) -> float:
        return LEFT + (t - lo) / span * usable

    height = TOP + LANE * len(lanes) + 30
    svg: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">'
    ]
    # lanes and labels
    for i, name in enumerate(lanes):
        y = TOP + i * LANE
        fill = "#f7f7f9" if i % 2 else "#fff"
        svg.append(f'<rect x="{LEFT}" y="{y}" width="{usable}" height="{LANE - 4}" fill="{fill}"/>')
        svg.append(f'<text x="8" y="{y + LANE / 2}" font-weight="bold">{escape(name)}</text>')
    # time axis
    step = next(s for s in (1, 2, 5, 10, 20, 30, 60, 120, 300, 600) if span / s <= 16)
    t = (int((lo - h.t0) / step) - 1) * step
    while h.t0 + t <= hi:
        if h.t0 + t >= lo:
            xx = x(h.t0 + t)
            svg.append(
                f'<line x1="{xx:.1f}" y1="{TOP - 4}" x2="{xx:.1f}" y2="{height - 26}" '
                'stroke="#ddd"/>'
            )
            svg.append(
                f'<text x="{xx:.1f}" y="{TOP - 8}" text-anchor="middle" fill="#555">{t:+d} s</text>'
            )
        t += step
    # nemesis periods
    for p in h.periods:
        colour = FAULT_COLOURS.get(p.kind, "#999")
        x0, x1 = x(p.start), max(x(p.end), x(p.start) + 2)
        tip = escape(p.describe(h.t0))
        if p.target not in lane_of:  # the database, its clock, the stand-in: every process
            y0, hh, opacity = TOP, LANE * len(lanes) - 4, 0.14
        else:
            lane = lane_of.get(p.target, len(lanes) - 1)
            y0, hh, opacity = TOP + lane * LANE, LANE - 4, 0.35
        svg.append(
            f'<rect x="{x0:.1f}" y="{y0}" width="{x1 - x0:.1f}" height="{hh}" fill="{colour}" '
            f'fill-opacity="{opacity}"><title>{tip}</title></rect>'
        )
        if p.target not in lane_of:
            yb = TOP + (len(lanes) - 1) * LANE
            svg.append(
                f'<rect x="{x0:.1f}" y="{yb + 4}" width="{x1 - x0:.1f}" height="{LANE - 12}" '
                f'fill="{colour}" fill-opacity="0.8"><title>{tip}</title></rect>'
            )
    # incarnations
    for p in h.procs:
        y = TOP + lane_of[p.name] * LANE + 6
        x0, x1 = x(p.start), x(p.end or hi)
        svg.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="3" fill="#b8bcc4">'
            f"<title>{escape(f'{p.name}.{p.inc} pid {p.pid} {h.rel(p.start)}..{h.rel(p.end)}')}"
            f" {escape(p.how)}"
            f"</title></rect>"
        )
        if p.how in ("killed", "died") and p.end:
            svg.append(
                f'<text x="{x1:.1f}" y="{y + 5}" text-anchor="middle" fill="#c0392b" '
                f'font-weight="bold">×</text>'
            )
    # operations, binned by pixel column
    strips = {o: row for row, (_, _, outs) in enumerate(OUTCOMES) for o in outs}
    marks: dict[tuple[str, int, int], int] = defaultdict(int)
    for o in h.ops:
        marks[(o.proc, int(x(o.t0)), strips.get(o.out, 2))] += 1
    for proc, col, row in marks:
        y = TOP + lane_of[proc] * LANE + 14 + row * ROW
        svg.append(
            f'<rect x="{col}" y="{y}" width="1.2" height="{ROW - 2}" fill="{OUTCOMES[row][1]}"/>'
        )
    # quiet period
    if h.quiet_from and lo <= h.quiet_from <= hi:
        xq = x(h.quiet_from)
        svg.append(
            f'<line x1="{xq:.1f}" y1="{TOP}" x2="{xq:.1f}" y2="{height - 26}" stroke="#333" '
            f'stroke-dasharray="5,4"/>'
            f'<text x="{xq - 4:.1f}" y="{height - 12}" text-anchor="end">nemesis ends, '
            "quiet period begins ┆</text>"
        )
    # duplicates and violations
    refs = h.by_ref()
    for d in v.duplicates:
        lane = lane_of.get(d.owner.split(".")[0], len(lanes) - 1)
        cx, cy = x(d.t), TOP + lane * LANE + LANE - 12
        svg.append(
            f'<path d="M{cx:.1f},{cy - 5} l5,5 l-5,5 l-5,-5 z" fill="#f39c12" stroke="#7a4a00" '
            f'stroke-width="0.6"><title>{escape(d.line(h.t0))}</title></path>'
        )
    for n, f in enumerate(v.findings, 1):
        op = refs.get(f.ref or "")
        lane = lane_of.get(op.proc, len(lanes) - 1) if op else len(lanes) - 1
        cx, cy = x(f.t if f.t is not None else hi), TOP + lane * LANE + LANE / 2
        svg.append(
            f'<circle cx="{cx:.1f}" cy="{cy}" r="7" fill="#e0142c" stroke="#fff" '
            'stroke-width="1.5">'
            f"<title>{escape(f.line(h.t0))}</title></circle>"
            f'<text x="{cx:.1f}" y="{cy + 3.5}" text-anchor="middle" fill="#fff" font-size="9" '
            f'font-weight="bold">{n if n < 100 else ""}</text>'
        )
    svg.append("</svg>")
    return _page(h, v, title, "\n".join(svg))


def _legend() -> str:
    items = [
        f'<span class="key"><i style="background:{c}"></i>{escape(name)}</span>'
        for name, c, _ in OUTCOMES
    ]
    items += [
        f'<span class="key"><i style="background:{c};opacity:.6"></i>{escape(k)}</span>'
        for k, c in FAULT_COLOURS.items()
    ]
    items += [
        '<span class="key"><i style="background:#e0142c;border-radius:6px"></i>violation</span>',
        '<span class="key"><i style="background:#f39c12;transform:rotate(45deg)"></i>'
        "duplicate effect</span>",
        '<span class="key"><i style="background:#b8bcc4;height:3px"></i>process incarnation '
        "(× killed)</span>",
    ]
    return '<div class="legend">' + "".join(items) + "</div>"


def _page(h: History, v: Verdict, title: str, svg: str) -> str:
    verdict = "passed" if v.passed else f"FAILED — {len(v.findings)} violation(s)"
    findings = "".join(
        f"<li><b>{n}.</b> {escape(f.line(h.t0))}</li>" for n, f in enumerate(v.findings[:200], 1)
    )
    dups = "".join(f"<li>{escape(d.line(h.t0))}</li>" for d in v.duplicates[:200])
    periods = "".join(f"<li>{escape(p.describe(h.t0))}</li>" for p in h.periods)

    def more(items: list, shown: int) -> str:
        return (
            f"<p>... {len(items) - shown} more in the JSON report</p>" if len(items) > shown else ""
        )

    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 4px; }}
.verdict {{ font-weight: bold; color: {"#1e7d3a" if v.passed else "#c0142c"}; }}
.legend {{ margin: 8px 0; font-size: 12px; }}
.key {{ margin-right: 14px; white-space: nowrap; }}
.key i {{ display: inline-block; width: 12px; height: 10px; margin-right: 4px;
          vertical-align: middle; }}
ul {{ font-size: 12px; font-family: monospace; }}
h2 {{ font-size: 14px; margin: 16px 0 4px; }}
</style></head><body>
<h1>{escape(title)}</h1>
<div>Verdict: <span class="verdict">{escape(verdict)}</span> · {v.runs} runs,
{len(h.ops)} operations, {len(h.audit)} committed changes, {len(h.periods)} nemesis periods,
{len(v.duplicates)} duplicate effects.
Times are seconds from the start of the nemesis phase; hover a mark for details.</div>
{_legend()}
{svg}
<h2>Violations</h2><ul>{findings or "<li>none</li>"}</ul>{more(v.findings, 200)}
<h2>Duplicate external effects, attributed</h2><ul>{dups or "<li>none</li>"}</ul>
{more(v.duplicates, 200)}
<h2>Nemesis periods</h2><ul>{periods or "<li>none</li>"}</ul>
</body></html>
"""


def write(path: str, h: History, v: Verdict, title: str = "knownstate soak") -> None:
    """Write the timeline as a report is written (:func:`.outpath.write`: never replacing what
    is at the path); OutputError with one line when it cannot."""
    outpath.write(path, render(h, v, title), "timeline")
