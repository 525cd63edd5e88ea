"""specs/ generated from model/: each protocol's state diagram, and the contract side by side
(from each durable kind's description, its model module's ``DESCRIPTION``).

A spec file holds prose written by people and blocks generated from the models, fenced by
``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``. ``knownstate specs`` rewrites
the blocks; ``knownstate specs --check`` (and the drift test) fails when a block and the model
disagree, so one fact never lives twice unchecked.
"""

from __future__ import annotations

import importlib
import re

from knownstate.model.contract import Contract, TransitionTable
from . import kinds
from .tools import PROJECT_ROOT

SPECS = PROJECT_ROOT / "specs"

PROTOCOLS = {"document-session.md": "knownstate.model.document"}
"""The client protocols' specs: spec file -> model module whose ``TABLE`` is its diagram. A
durable kind's spec is ``<its name>.md``, its diagram its description's table: a new kind is
its model module's ``DESCRIPTION`` (found through the kind registry), nothing here."""


def diagrams() -> dict[str, TransitionTable]:
    """Spec file -> the table its diagram is generated from."""
    out = {f"{d.name}.md": d.contract().table for d in kinds.described()}
    for file, module in PROTOCOLS.items():
        out[file] = importlib.import_module(module).TABLE
    return out


def diagram(table: TransitionTable) -> str:
    return f"```mermaid\n{table.mermaid()}\n```"


def _status_machine(c: Contract) -> str:
    terminal = " | ".join(s for s in c.statuses if s in c.terminal)
    live = " → ".join(s for s in c.statuses if s not in c.terminal)
    return f"{live} → {terminal}"


def contract_table() -> str:
    """The seed's contract table, one column per durable kind, generated from each kind's
    description (which a drift test holds equal to its model's CONTRACT)."""
    contracts: list[Contract] = [d.contract() for d in kinds.described()]
    rows = [
        (
            "Status machine",
            "every transition is a conditional UPDATE … WHERE status = <from>",
            [_status_machine(c) for c in contracts],
        ),
        ("Claim", "exactly one worker owns the run", [c.claim for c in contracts]),
        (
            "Lease + reaper",
            "a dead owner is detected, never waited on forever",
            [f"{c.lease}; {c.reaper}" for c in contracts],
        ),
        ("Lease clock", "whose clock judges the lease", [c.lease_clock.value for c in contracts]),
        (
            "Fence",
            "a stale owner cannot write after losing the lease",
            [c.fence for c in contracts],
        ),
        (
            "Receipts",
            "what committed is recorded with the effect, not after it",
            [c.receipts for c in contracts],
        ),
        ("Retry policy", "retries are bounded and spaced", [c.retry_policy for c in contracts]),
        (
            "External effect",
            "at-least-once unless the external API takes an idempotency key",
            [c.external_effect.value for c in contracts],
        ),
        (
            "Recorded deviations",
            "where a kind departs from the contract, and why",
            ["; ".join(c.deviations) or "none" for c in contracts],
        ),
        (
            "Described as",
            "the description's structured facts (DESCRIPTION in model/<kind>.py)",
            [d.summary() for d in kinds.described()],
        ),
    ]
    head = "| Element | What it guarantees | " + " | ".join(f"`{c.kind}`" for c in contracts) + " |"
    sep = "|" + "---|" * (len(contracts) + 2)
    body = [
        f"| {name} | {what} | " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
        for name, what, cells in rows
    ]
    return "\n".join([head, sep, *body])


def blocks() -> dict[tuple[str, str], str]:
    """(file, block name) -> generated content."""
    out = {(f, "diagram"): diagram(table) for f, table in diagrams().items()}
    out[("contract.md", "contract")] = contract_table()
    return out


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- generated:{name} -->\n)(.*?)(\n<!-- /generated:{name} -->)", re.S)


def drift() -> list[str]:
    """What differs between specs/ and the models (empty: nothing)."""
    problems = []
    for (file, name), content in blocks().items():
        path = SPECS / file
        if not path.exists():
            problems.append(f"specs/{file} is missing: run `knownstate specs`")
            continue
        m = _pattern(name).search(path.read_text())
        if m is None:
            problems.append(f"specs/{file} has no generated:{name} block")
        elif m.group(2) != content:
            problems.append(
                f"specs/{file}: the {name} block differs from the model: run `knownstate specs`"
            )
    return problems


def write() -> list[str]:
    """Rewrite every generated block from the models. Returns the files changed."""
    changed = []
    for (file, name), content in blocks().items():
        path = SPECS / file
        text = path.read_text()
        new = _pattern(name).sub(lambda m: m.group(1) + content + m.group(3), text)
        if new != text:
            path.write_text(new)
            changed.append(f"specs/{file}")
    return changed
