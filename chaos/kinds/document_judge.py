"""What the document-session check looks at, how it shows it, and what it judges on its own.

**What is compared.** Only what can be observed: the stored documents with their history, the
draft files, and each tab's public view (:class:`~knownstate.model.document_session.TabView`:
its state, local copy, base version, the draft status it shows, its transitions, the sibling
drafts it offers, the stored version of a conflict). The session's private fields are never
compared: model and implementation run the same session machine, so comparing its insides
would compare a machine with itself. What makes the check independent is what it judges.

**What is judged**, on the real world after every step: the model's eight invariants
(:data:`knownstate.model.document.INVARIANTS`: the seed's four, the server's compare-and-swap,
the ledger of unsaved edits) and the check's own (:data:`CHECK_INVARIANTS`), which read the
answers the server gave in the step against what the database holds: a save identity that
saved is answered from its own receipt, and no other user's; an applied read never takes a tab
back; a request the contract refuses changes nothing and is answered clearly (those two are
judged where the hostile requests are sent, :mod:`.document_requests`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from knownstate.model.contract import Rejected, Violation, Won
from knownstate.model.document import (
    CloseResult,
    CopyRequest,
    Created,
    Dropped,
    NoAnswer,
    ReadRequest,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    VersionConflict,
    World,
    save_fingerprint,
)

from ..replay import Exchange, Raised, canon, short
from .document_requests import REQUEST_INVARIANTS

CHECK_INVARIANTS = {
    "retry-answered-from-receipt": (
        "A save whose identity (user, writerId, saveSeq) already saved is answered from that "
        "save's receipt: the same request with its original success, never a conflict against "
        "itself; other content with save_seq_taken."
    ),
    "receipt-is-the-users-own": (
        "Only the user's own receipt answers a save: another user's save under the same writerId "
        "neither answers nor replaces it."
    ),
    "no-stale-read-applied": (
        "A read a tab applies never takes its copy back to a version older than its base."
    ),
    **REQUEST_INVARIANTS,
}
"""Judged on the real world besides the model's eight invariants. Each is what a mutant of the
catalogue breaks."""

RECEIPT_SQL = (
    "SELECT fingerprint, version FROM document_history WHERE document_id = %s "
    "AND author = %s AND writer_id = %s AND save_seq = %s"
)


# ---------------------------------------------------------------------------------------
# Observation.
# ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class Seen:
    """One observation: the world (documents, draft views, tabs' public views) and the draft
    records as stored."""

    world: World
    drafts: dict[str, dict]

    def __post_init__(self):
        tabs = self.world.tabs
        self.key = (
            canon(dict(self.world.docs)),
            canon(self.drafts),
            canon({k: dataclasses.replace(v, transitions=()) for k, v in tabs.items()}),
            canon({k: v.transitions for k, v in tabs.items()}),
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, Seen) and self.key == other.key

    __hash__ = None


def describe_difference(model: Seen, real: Seen) -> str:
    lines = []

    def compare(what: str, a: dict, b: dict) -> None:
        for k in sorted(set(a) | set(b)):
            x, y = a.get(k), b.get(k)
            if canon(x) != canon(y):
                lines.append(
                    f"  {what} {k}:\n    model:          {short(x)}\n    implementation: {short(y)}"
                )

    compare("document", dict(model.world.docs), dict(real.world.docs))
    compare("draft", model.drafts, real.drafts)
    compare("tab", dict(model.world.tabs), dict(real.world.tabs))
    return "\n".join(lines) or "  (no difference found in the projection)"


# ---------------------------------------------------------------------------------------
# One-line descriptions for the trace (no driver error text, no ports: a seed replays the
# same trace).
# ---------------------------------------------------------------------------------------


def show(x: Any) -> str:
    if x is None:
        return "not due"
    if isinstance(x, Won):
        v = x.value
        if isinstance(v, Saved):
            return f"saved v{v.version}" + (" (replayed from the receipt)" if v.replayed else "")
        if isinstance(v, Created):
            return f"copy {v.id[:7]} created" + (" (replayed)" if v.replayed else "")
        if isinstance(v, Snapshot):
            return f"v{v.version}"
        return str(v)
    if isinstance(x, VersionConflict):
        return f"conflict (stored v{x.version})"
    if isinstance(x, SeqTaken):
        return f"refused: {x.writer_id}#{x.seq} already saved v{x.version} (last seq {x.last_seq})"
    if isinstance(x, NoAnswer):
        return "no answer"
    if isinstance(x, Rejected):
        return f"rejected ({x.reason})"
    if isinstance(x, Dropped):
        return f"dropped ({x.reason})"
    if isinstance(x, CloseResult):
        return "closed, flushed" if x.flushed else "closed, work parked in its draft"
    if isinstance(x, Raised):
        return f"refused: {x.error}"
    return str(x)


def show_request(r: Any) -> str:
    if isinstance(r, SaveRequest):
        return f"PUT {r.writer_id}#{r.seq} base v{r.base_version}"
    if isinstance(r, ReadRequest):
        return f"GET ({r.purpose})"
    if isinstance(r, CopyRequest):
        return f"POST copy {r.writer_id}#{r.seq}"
    return str(r)


# ---------------------------------------------------------------------------------------
# The check's own invariants.
# ---------------------------------------------------------------------------------------


def receipt_answers(query, exchanges: list[Exchange]) -> list[Violation]:
    """The HTTP contract's receipts, judged on each save answered in a step against the history
    rows after it (``query(sql, args)`` reads the database): a save identity (user, writerId,
    saveSeq) that saved is answered from its own receipt — the same request with that success,
    other content with save_seq_taken naming it — and no other user's receipt ever answers it."""
    out = []
    for _, req, answer in exchanges:
        if not isinstance(req, SaveRequest) or isinstance(answer, NoAnswer):
            continue
        rows = query(RECEIPT_SQL, (req.doc_id, req.user, req.writer_id, req.seq))
        own = rows[0] if rows else None  # (fingerprint, version) of the user's own receipt
        save = f"{req.user}'s save {req.writer_id}#{req.seq}"
        won = isinstance(answer, Won) and isinstance(answer.value, Saved)
        saved = answer.value if won else None
        cited = (
            answer.version
            if isinstance(answer, SeqTaken)
            else saved.version
            if saved is not None and saved.replayed
            else None
        )
        if cited is not None and (own is None or own[1] != cited):
            mine = f"its own says v{own[1]}" if own else "it never saved"
            out.append(
                Violation(
                    "receipt-is-the-users-own",
                    f"{save} was answered from a receipt of v{cited} ({mine}): {show(answer)}",
                )
            )
        if own is not None and own[0] == save_fingerprint(req.user, req.base_version, req.content):
            if saved is None or saved.version != own[1]:
                out.append(
                    Violation(
                        "retry-answered-from-receipt",
                        f"{save} landed as v{own[1]}, and was answered {show(answer)}",
                    )
                )
        elif own is not None:
            if not (isinstance(answer, SeqTaken) and answer.version == own[1]):
                out.append(
                    Violation(
                        "retry-answered-from-receipt",
                        f"{save} reuses an identity that saved v{own[1]} with "
                        f"other content, and was answered {show(answer)}",
                    )
                )
    return out


class ReadsApplied:
    """The stale-read guard, judged from outside: a tab that applied a read in a step (and
    adopted nothing) ends it with a base no older than it had before, and no older than any
    version it was told in the step (a copy it was sent, a save of its that landed)."""

    def __init__(self) -> None:
        self.bases: dict[str, tuple[str, int, int]] = {}

    def judge(self, world: World, exchanges: list[Exchange]) -> list[Violation]:
        out, before = [], self.bases
        self.bases = {
            slot: (t.writer_id, len(t.transitions), t.base_version)
            for slot, t in world.tabs.items()
        }
        for slot, t in world.tabs.items():
            prev = before.get(slot)
            if prev is None or prev[0] != t.writer_id or len(t.transitions) < prev[1]:
                continue
            events = {e for _, e, _ in t.transitions[prev[1] :]}
            if not events & {"reloaded", "discard_reloaded"} or "adopt" in events:
                continue
            # every version the tab was told in the step: reads it was sent, saves that landed
            seen = [
                a.value.version
                for s, r, a in exchanges
                if s == slot
                and isinstance(a, Won)
                and (
                    isinstance(r, ReadRequest)
                    and r.purpose != "load"
                    and isinstance(a.value, Snapshot)
                    or isinstance(r, SaveRequest)
                    and isinstance(a.value, Saved)
                )
            ]
            newest = max([prev[2], *seen])
            if t.base_version < newest:
                out.append(
                    Violation(
                        "no-stale-read-applied",
                        f"tab {slot} applied a read of v{t.base_version} after it had v{newest}",
                    )
                )
        return out
