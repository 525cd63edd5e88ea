"""The document session's invariants, as predicates over what can be observed.

A :class:`World` is what anyone can look at: the stored documents with their history, the draft
files, and each tab's public view (its state, its local copy, its base version, the draft
status it shows, the transitions it took, the sibling drafts it offers, the stored version of a
conflict). It is the model's own world, or a projection of the real one — rows, draft files,
sessions. The predicates read it together with a :class:`Ledger`: the edits the check made that
nothing has covered yet (no accepted save, user discard or user resolution), kept by the model
from what the seed promises, not from how a session stores its work.

The four invariants of the seed are here under stable names, with three that state what they
mean for the server and for an edit (:data:`INVARIANTS`); :func:`check_invariants` evaluates
them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .contract import Violation
from .document_kinds import Content, same, same_content
from .document_protocol import SaveRequest, draft_key
from .document_server import HistoryEntry
from .document_session import TABLE, USER_EVENTS, State, TabView

WriterKey = tuple[str, str, str]  # (user, doc_id, writer_id)


# ---------------------------------------------------------------------------------------
# Views: what a projection of the real state must produce.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocView:
    id: str
    kind: str
    version: int
    content: Content
    history: tuple[HistoryEntry, ...] = ()


@dataclass(frozen=True)
class DraftView:
    key: str
    kind: str
    user: str
    doc_id: str
    writer_id: str
    content: Content
    base_version: int
    generation: int
    inflight_seq: int | None

    @classmethod
    def from_record(cls, key: str, r: Mapping) -> "DraftView":
        inflight = r.get("inflight")
        return cls(
            key,
            r["kind"],
            r["user"],
            r["fileId"],
            r["writerId"],
            dict(r["content"]),
            int(r["baseVersion"]),
            int(r["generation"]),
            int(inflight["seq"]) if inflight else None,
        )


@dataclass(frozen=True)
class World:
    docs: Mapping[str, DocView]
    drafts: Mapping[str, DraftView]
    tabs: Mapping[str, TabView]  # live and closed sessions (a crashed tab is gone)


@dataclass(frozen=True)
class Ledger:
    """The edits the check made that nothing has covered yet (from the model)."""

    unsaved: Mapping[WriterKey, Mapping[str, object]]
    lost_visibly: Mapping[WriterKey, Mapping[str, object]] = field(default_factory=dict)
    # writers whose draft a sibling tab discarded while their tab lived, and whose tab has not
    # written it again: their unsaved edits are in that tab's memory only, by the user's doing
    undrafted: frozenset[WriterKey] = frozenset()


# ---------------------------------------------------------------------------------------
# The invariants.
# ---------------------------------------------------------------------------------------

INVARIANTS: dict[str, str] = {
    "save-carries-base-version": (
        "Every save carries its base version, and the server rejects a stale one."
    ),
    "unsaved-work-in-one-place": (
        "Unsaved work exists in exactly one place per writer, and nothing deletes it until a "
        "save of that work succeeded or the user discarded it."
    ),
    "conflict-resolved-by-user": (
        "A conflict is a state the user resolves; it is never resolved by last-write-wins."
    ),
    "close-flushes-never-drops": (
        "The session's lifetime is the document's, not a component's. Closing flushes, never drops."
    ),
    "no-edit-lost-silently": (
        "Each edit is in the stored content, in a draft, or was explicitly discarded."
    ),
    "no-stale-save-accepted": "No save based on a stale version is ever accepted.",
    "no-last-write-wins": "A conflict is never resolved by last-write-wins.",
    "one-version-per-save": (
        "A save's identity (user, writerId, saveSeq) produces at most one version: a reused one "
        "with other content is refused, never applied."
    ),
}


def _writer_tabs(world: World) -> dict[WriterKey, TabView]:
    out: dict[WriterKey, TabView] = {}
    for t in world.tabs.values():
        wk = (t.user, t.doc_id, t.writer_id)
        if wk not in out or out[wk].state == State.CLOSED:
            out[wk] = t
    return out


def save_carries_base_version(world: World, sent: Iterable[SaveRequest] = ()) -> list[Violation]:
    out = []
    for r in sent:
        base = r.base_version
        if not isinstance(base, int) or isinstance(base, bool) or base < 1:
            out.append(
                Violation(
                    "save-carries-base-version",
                    f"writer {r.writer_id} sent save #{r.seq} without a base version ({base!r})",
                )
            )
    for d in world.docs.values():
        for h in d.history:
            if h.base_version is None:
                out.append(
                    Violation(
                        "save-carries-base-version",
                        f"document {d.id} v{h.version} was accepted without a base version",
                    )
                )
    return out


def no_stale_save_accepted(world: World) -> list[Violation]:
    out = []
    for d in world.docs.values():
        versions = [h.version for h in d.history]
        for h in d.history:
            if h.base_version is not None and h.version != h.base_version + 1:
                out.append(
                    Violation(
                        "no-stale-save-accepted",
                        f"document {d.id}: v{h.version} by {h.author} was based on "
                        f"v{h.base_version}",
                    )
                )
        if versions != list(range(1, len(versions) + 1)) or (
            versions and versions[-1] != d.version
        ):
            out.append(
                Violation(
                    "no-stale-save-accepted",
                    f"document {d.id}: history versions {versions} do not lead to v{d.version}",
                )
            )
    return out


def one_version_per_save(world: World) -> list[Violation]:
    out = []
    for d in world.docs.values():
        seen: dict[tuple, int] = {}
        for h in d.history:
            if h.writer_id is None:
                continue
            key = (h.author, h.writer_id, h.save_seq)
            if key in seen:
                out.append(
                    Violation(
                        "one-version-per-save",
                        f"document {d.id}: save {h.writer_id}#{h.save_seq} of "
                        f"{h.author} produced v{seen[key]} and v{h.version}",
                    )
                )
            seen[key] = h.version
    return out


def unsaved_work_in_one_place(world: World, ledger: Ledger) -> list[Violation]:
    out = []
    seen: dict[WriterKey, str] = {}
    for key, d in world.drafts.items():
        expected = draft_key(d.kind, d.user, d.doc_id, d.writer_id)
        if key != expected:
            out.append(
                Violation(
                    "unsaved-work-in-one-place",
                    f"draft of writer {d.writer_id} is in slot {key!r}, not its own {expected!r}",
                )
            )
        wk = (d.user, d.doc_id, d.writer_id)
        if wk in seen:
            out.append(
                Violation(
                    "unsaved-work-in-one-place",
                    f"writer {d.writer_id} has drafts in two slots: {seen[wk]!r} and {key!r}",
                )
            )
        seen[wk] = key
    tabs = _writer_tabs(world)
    for wk, edits in ledger.unsaved.items():
        t = tabs.get(wk)
        if wk in ledger.undrafted:
            continue  # a sibling discarded its draft: its live tab holds the work
        if (
            t is not None
            and t.state not in (State.CLOSED, State.LOADING)
            and t.draft_status == "failing"
        ):
            continue
        if edits and wk not in seen:
            out.append(
                Violation(
                    "unsaved-work-in-one-place",
                    f"writer {wk[2]} of {wk[0]} on {wk[1]} has unsaved edits "
                    f"{sorted(edits)} and no draft, with no failure reported",
                )
            )
    return out


def no_edit_lost_silently(world: World, ledger: Ledger) -> list[Violation]:
    out = []
    tabs = _writer_tabs(world)
    slots = {
        (d.user, d.doc_id, d.writer_id): d
        for d in world.drafts.values()
        if d.key == draft_key(d.kind, d.user, d.doc_id, d.writer_id)
    }
    for wk, edits in ledger.unsaved.items():
        t = tabs.get(wk)
        ended = (State.CLOSED, State.LOADING)  # loading: holds nothing yet
        alive = t is not None and t.state not in ended
        slot = slots.get(wk)
        doc = world.docs.get(wk[1])
        for k, v in sorted(edits.items()):
            local_has_it = alive and same(t.local.get(k), v)
            if doc is not None and same(doc.content.get(k), v) and (local_has_it or not alive):
                continue  # in the stored content
            in_draft = slot is not None and same(slot.content.get(k), v)
            if alive:
                if not local_has_it:
                    out.append(
                        Violation(
                            "no-edit-lost-silently",
                            f"tab {t.tab}: edit {k}={v!r} is gone from the local "
                            "copy though no save, discard or resolution covered it",
                        )
                    )
                elif not in_draft and t.draft_status != "failing" and wk not in ledger.undrafted:
                    out.append(
                        Violation(
                            "no-edit-lost-silently",
                            f"tab {t.tab}: unsaved edit {k}={v!r} is in no draft, and "
                            "the draft store reports no failure",
                        )
                    )
            elif not in_draft:
                out.append(
                    Violation(
                        "no-edit-lost-silently",
                        f"writer {wk[2]}: unsaved edit {k}={v!r} survives nowhere "
                        "after its tab ended",
                    )
                )
    return out


def close_flushes_never_drops(world: World, ledger: Ledger) -> list[Violation]:
    out = []
    slots = {(d.user, d.doc_id, d.writer_id): d for d in world.drafts.values()}
    current = _writer_tabs(world)
    for t in world.tabs.values():
        if t.state != State.CLOSED:
            continue
        if t.transitions and t.transitions[-1][1] != "close":
            out.append(
                Violation(
                    "close-flushes-never-drops", f"tab {t.tab} is closed without a close event"
                )
            )
        wk = (t.user, t.doc_id, t.writer_id)
        if current.get(wk) is not t:
            continue  # the writer reopened the document: its live tab holds the work now
        edits = ledger.unsaved.get(wk, {})
        slot = slots.get(wk)
        # no exception for a value the stored copy happens to hold: a close flushes what its
        # session has not seen saved (the save's answer, or the idempotent one to its retry)
        for k, v in sorted(edits.items()):
            if slot is None or not same(slot.content.get(k), v):
                out.append(
                    Violation(
                        "close-flushes-never-drops",
                        f"tab {t.tab} closed with edit {k}={v!r} neither saved nor "
                        "parked in its draft",
                    )
                )
    return out


def conflict_resolved_by_user(world: World) -> list[Violation]:
    out = []
    for t in world.tabs.values():
        for src, event, dst in t.transitions:
            if src == State.CONFLICT and dst != State.CONFLICT and event not in USER_EVENTS:
                out.append(
                    Violation(
                        "conflict-resolved-by-user",
                        f"tab {t.tab} left conflict by {event!r}, which no user caused",
                    )
                )
            if src == State.CONFLICT and not TABLE.allows(src, dst):
                out.append(
                    Violation(
                        "conflict-resolved-by-user",
                        f"tab {t.tab} moved {src} -> {dst}, which the session table does not allow",
                    )
                )
    return out


def no_last_write_wins(world: World, expected: World) -> list[Violation]:
    """Where the model holds a tab in conflict (or closed it straight from conflict, its work
    parked in its draft), the real tab is in conflict too (or closed) and no save of its writer
    has landed since: nothing overwrote the stored copy behind the user's back."""
    out = []
    for tab, m in expected.tabs.items():
        parked = (
            m.state == State.CLOSED
            and bool(m.transitions)
            and m.transitions[-1][0] == State.CONFLICT
        )
        if m.state != State.CONFLICT and not parked:
            continue
        real = world.tabs.get(tab)
        if real is None or real.state != (State.CLOSED if parked else State.CONFLICT):
            out.append(
                Violation(
                    "no-last-write-wins",
                    f"tab {tab} should be in conflict, is {real.state if real else 'gone'}",
                )
            )
        md, rd = expected.docs.get(m.doc_id), world.docs.get(m.doc_id)
        if md is not None and rd is not None:
            extra = [h for h in rd.history if h.version > md.version and h.writer_id == m.writer_id]
            if extra or (rd.version == md.version and not same_content(rd.content, md.content)):
                out.append(
                    Violation(
                        "no-last-write-wins",
                        f"document {m.doc_id}: writer {m.writer_id}'s copy was stored "
                        "while its tab was in conflict",
                    )
                )
    return out


def check_invariants(
    world: World, ledger: Ledger, *, expected: World | None = None, sent: Iterable[SaveRequest] = ()
) -> list[Violation]:
    """All eight invariants over one world (the model's own, or a projection of the real one).
    ``expected`` is the model's world, for the comparisons only it can judge."""
    out = save_carries_base_version(world, sent)
    out += no_stale_save_accepted(world)
    out += one_version_per_save(world)
    out += unsaved_work_in_one_place(world, ledger)
    out += no_edit_lost_silently(world, ledger)
    out += close_flushes_never_drops(world, ledger)
    out += conflict_resolved_by_user(world)
    if expected is not None:
        out += no_last_write_wins(world, expected)
    return out
