"""A failing run of the browser check as a picture: its counterexample, one lane per tab.

``python -m knownstate.chaos.browser_timeline REPORT.json OUT.png`` reads a JSON report
(``knownstate verify ... --json``, or ``mutants``), takes its first run that failed (or caught
a mutant), and draws the shrunk counterexample: one row per step, in the lane of the tab it acted
on (alice's a1 and a2, bob's b1), faults and the other clients in lanes of their own, the
failure underneath. The HTML (``OUT.html`` beside the picture) is drawn by headless Chromium
into a PNG (``docs/images/failing-run.png`` in the README is one).
"""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

LANES = ("faults", "a1", "a2", "b1", "others")
TITLES = {
    "faults": "faults",
    "a1": "alice, tab a1",
    "a2": "alice, tab a2",
    "b1": "bob, tab b1",
    "others": "server-side writer, other clients",
}


def lane_of(line: str) -> str:
    if line.startswith(("FAULT", "heal", "the draft store")):
        return "faults"
    m = re.search(r"\b(a1|a2|b1)\b", line)
    if m and not line.startswith(("a client", "server-side")):
        return m.group(1)
    return "others"


def render(title: str, failure: str, trace: list[str]) -> str:
    """The counterexample as an HTML page (self-contained)."""
    rows: list[tuple[str, str, list[str]]] = []
    for line in trace:
        if line.startswith("  ") and rows:
            rows[-1][2].append(line.strip())
        else:
            rows.append((lane_of(line), line, []))
    head = "".join(f"<th>{html.escape(TITLES[lane])}</th>" for lane in LANES)
    body = []
    for i, (lane, line, notes) in enumerate(rows, 1):
        action, _, outcome = line.partition(" => ")
        cell = f"<div class='step {lane}'><b>{html.escape(action)}</b>"
        if outcome:
            cell += f"<div class='outcome'>⇒ {html.escape(outcome)}</div>"
        for n in notes:
            cell += f"<div class='note'>{html.escape(n)}</div>"
        cell += "</div>"
        cells = "".join(f"<td>{cell if lane == x else ''}</td>" for x in LANES)
        body.append(f"<tr><th class='n'>{i}</th>{cells}</tr>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ font: 13px/1.35 system-ui, sans-serif; margin: 16px; color: #1d2330; width: 1280px; }}
h1 {{ font-size: 16px; margin: 0 0 10px; }}
table {{ border-collapse: collapse; width: 100%; table-layout: fixed; }}
th {{ background: #eef0f4; padding: 4px 6px; font-weight: 600; text-align: left; }}
th.n {{ width: 28px; text-align: right; background: #f6f7f9; color: #6a7385; }}
td {{ border-left: 1px dashed #d7dbe3; vertical-align: top; padding: 3px 5px; }}
.step {{ border-radius: 4px; padding: 4px 6px; background: #e7f0ff; word-wrap: break-word; }}
.step.faults {{ background: #ffe7cc; }} .step.others {{ background: #eceff3; }}
.outcome {{ color: #2a5d2a; }} .note {{ color: #6a7385; font-size: 12px; }}
.failure {{ margin-top: 12px; padding: 8px; background: #ffe3e3; border: 1px solid #f0a0a0;
  border-radius: 4px; white-space: pre-wrap; font: 12px/1.35 ui-monospace, monospace; }}
</style></head><body><h1>{html.escape(title)}</h1>
<table><tr><th class="n">#</th>{head}</tr>{"".join(body)}</table>
<div class="failure">{html.escape(failure)}</div></body></html>"""


def picture(page_html: str, out: Path) -> None:
    """Draw the page with headless Chromium (the check's own) into a PNG."""
    from playwright.sync_api import sync_playwright

    from .browser import CHROMIUM_ARGS, chromium_path, on_a_thread_of_its_own

    def draw():
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            try:
                page = b.new_page(viewport={"width": 1312, "height": 400})
                page.set_content(page_html)
                page.screenshot(path=str(out), full_page=True)
            finally:
                b.close()

    on_a_thread_of_its_own(draw)


def from_report(report: dict) -> tuple[str, str, list[str]]:
    """Title, failure and counterexample of the report's first failing (or catching) run."""
    for r in report.get("runs", []):
        if r.get("counterexample"):
            mutant = r.get("mutant") or {}
            who = f"mutant {mutant['name']}" if mutant else "the client"
            steps = len(r["counterexample"])
            title = f"{r['kind']}, {who}, seed {r['seed']}: {steps} steps"
            return title, (r.get("failure") or "")[:1500], r["counterexample"]
    raise SystemExit("the report has no run with a counterexample")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m knownstate.chaos.browser_timeline REPORT.json OUT.png")
        return 2
    title, failure, trace = from_report(json.loads(Path(args[0]).read_text()))
    out = Path(args[1])
    page_html = render(title, failure, trace)
    out.with_suffix(".html").write_text(page_html)
    picture(page_html, out)
    print(f"{out} ({out.with_suffix('.html')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
