"""The pure model of the versioned document session: fast, no I/O."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from knownstate.model.contract import CREATED, IllegalTransition, LostRace, Rejected, Won
from knownstate.model.document import (
    INVARIANTS,
    SeqTaken,
    RECORD,
    SHEET,
    TABLE,
    USER_EVENTS,
    DocumentModel,
    DocView,
    DraftView,
    HistoryEntry,
    KindError,
    Ledger,
    MergeUnsupported,
    NoAnswer,
    Saved,
    State,
    TabView,
    UnsavedWork,
    VersionConflict,
    World,
    check_invariants,
    created_id,
    draft_key,
    prefer_local,
    prefer_stored,
)

REC_SCHEMA = {"attributes": {"title": "text", "qty": "number", "done": "bool"}}
SHEET_SCHEMA = {"rows": 10, "cols": 3}
LOST = NoAnswer("lost")


def world_with(m: DocumentModel) -> list:
    return check_invariants(m.world(), m.ledger(), expected=m.world())


def open_tab(m: DocumentModel, tab="t1", user="alice", doc="r1", kind="record", writer=None):
    t = m.open_tab(tab, user, doc, kind, writer or f"w-{tab}")
    req = t.begin_read("load")
    assert isinstance(m.tabs[tab].finish_read(req, m.deliver(req)), Won)
    return t


def save(m: DocumentModel, tab: str, answer=None):
    req = m.tabs[tab].begin_save()
    return m.tabs[tab].finish_save(req, m.deliver(req) if answer is None else answer)


@contextlib.contextmanager
def network(tab, send):
    """The tab's requests go through ``send`` inside the block (its port, swapped)."""
    before, tab.send = tab.send, send
    try:
        yield tab
    finally:
        tab.send = before


@pytest.fixture
def m():
    model = DocumentModel(debounce=1.0)
    model.seed("r1", "record", REC_SCHEMA, {"title": "a"}, "alice", {"bob": True, "carol": False})
    model.seed("s1", "sheet", SHEET_SCHEMA, {"A1": 1}, "alice")
    return model


# -- the table ---------------------------------------------------------------------------------


def test_every_state_is_reachable_and_closed_is_terminal():
    states = {s.value for s in State}
    assert set(TABLE.statuses()) == states
    reach, frontier = set(), [CREATED]
    while frontier:
        s = frontier.pop()
        for t in TABLE.transitions:
            if t.source == s and t.target not in reach:
                reach.add(t.target)
                frontier.append(t.target)
    assert reach == states
    assert not [t for t in TABLE.transitions if t.source == State.CLOSED.value]


def test_conflict_is_left_only_by_user_events():
    exits = [t for t in TABLE.transitions if t.source == "conflict" and t.target != "conflict"]
    assert exits and all(t.event in USER_EVENTS for t in exits)
    # and nothing but a save answer ever enters it
    assert {
        t.event for t in TABLE.transitions if t.target == "conflict" and t.source != "conflict"
    } == {"version_conflict", "copy_failed"}


def test_illegal_transition_raises_and_leaves_state_unchanged(m):
    t = open_tab(m)
    with pytest.raises(IllegalTransition) as e:
        t.begin_save()
    assert e.value.status == "clean" and e.value.event == "save"
    assert t.state is State.CLEAN and t.next_seq == 1
    with pytest.raises(IllegalTransition):
        t.discard()
    assert t.state is State.CLEAN and t.transitions[-1] == ("loading", "loaded", "clean")


def test_spec_diagram_is_the_session_table():
    """specs/document-session.md embeds TABLE.mermaid() verbatim (drift test)."""
    spec = (Path(__file__).resolve().parent.parent / "specs" / "document-session.md").read_text()
    m = re.search(
        r"<!-- generated:diagram -->\n```mermaid\n(.*?)\n```\n"
        r"<!-- /generated:diagram -->",
        spec,
        re.S,
    )
    assert m, "specs/document-session.md has no generated diagram block"
    assert m.group(1) == TABLE.mermaid(), (
        "the diagram drifted from model/document.py: regenerate it"
    )
    for name in INVARIANTS:
        assert f"`{name}`" in spec


def test_invariant_names_are_stable():
    assert sorted(INVARIANTS) == sorted(
        [
            "save-carries-base-version",
            "unsaved-work-in-one-place",
            "conflict-resolved-by-user",
            "close-flushes-never-drops",
            "no-edit-lost-silently",
            "no-stale-save-accepted",
            "no-last-write-wins",
            "one-version-per-save",
        ]
    )


# -- kinds -------------------------------------------------------------------------------------


def test_record_merges_by_attribute_id():
    base = {"title": "a", "qty": 1}
    local = {"title": "a", "qty": 2, "done": True}
    stored = {"title": "b", "qty": 1}
    assert RECORD.merge(base, local, stored, prefer_stored) == {
        "title": "b",
        "qty": 2,
        "done": True,
    }
    clash_local = {"title": "L"}
    clash_stored = {"title": "S"}
    assert RECORD.merge({"title": "a"}, clash_local, clash_stored, prefer_local) == {"title": "L"}
    assert RECORD.merge({"title": "a"}, clash_local, clash_stored, prefer_stored) == {"title": "S"}
    # a deletion on one side survives the merge
    assert RECORD.merge(
        {"title": "a", "qty": 1}, {"qty": 1}, {"title": "a", "qty": 3}, prefer_local
    ) == {"qty": 3}
    # True is not 1
    assert RECORD.merge({"done": True}, {"done": 1}, {"done": True}, prefer_stored) == {"done": 1}


def test_sheet_does_not_merge():
    with pytest.raises(MergeUnsupported):
        SHEET.merge({}, {"A1": 1}, {"A1": 2}, prefer_local)


@pytest.mark.parametrize(
    "kind,schema,content,words",
    [
        (RECORD, REC_SCHEMA, {"colour": "red"}, "unknown attribute id 'colour'"),
        (RECORD, REC_SCHEMA, {"qty": "three"}, "'qty' must be a number"),
        (RECORD, REC_SCHEMA, {"done": 1}, "'done' must be a boolean"),
        (RECORD, REC_SCHEMA, {"qty": float("nan")}, "finite"),
        (RECORD, REC_SCHEMA, {"title": "x\x00y"}, "NUL"),
        (RECORD, REC_SCHEMA, {"title": "\ud800"}, "surrogate"),
        (RECORD, REC_SCHEMA, {"title": None}, "null"),
        (SHEET, SHEET_SCHEMA, {"D1": 1}, "outside the sheet"),
        (SHEET, SHEET_SCHEMA, {"A11": 1}, "outside the sheet"),
        (SHEET, SHEET_SCHEMA, {"a1": 1}, "unknown cell id"),
        (SHEET, SHEET_SCHEMA, {"A1\n": 1}, "unknown cell id"),  # in full: no "$" before "\n"
        (SHEET, SHEET_SCHEMA, {"A1 ": 1}, "unknown cell id"),
        (SHEET, SHEET_SCHEMA, {"A1": True}, "must be a number"),
        (SHEET, SHEET_SCHEMA, {"A1": 2**60}, "out of range"),
    ],
)
def test_content_rejections_name_the_problem(kind, schema, content, words):
    with pytest.raises(KindError) as e:
        kind.validate_content(kind.validate_schema(schema), content)
    assert words in str(e.value)


# -- the server model ----------------------------------------------------------------------------


def test_server_cas_replay_and_authorization(m):
    s = m.server
    assert s.put("alice", "r1", 1, {"title": "b"}, "w1", 1) == Won(Saved(2))
    stale = s.put("bob", "r1", 1, {"title": "c"}, "w2", 1)
    assert isinstance(stale, VersionConflict) and isinstance(stale, LostRace)
    assert (stale.version, stale.content) == (2, {"title": "b"})
    # the retry of the applied save: the original success, not a conflict against itself
    assert s.put("alice", "r1", 1, {"title": "b"}, "w1", 1) == Won(Saved(2, replayed=True))
    # the same (writer, seq) with other content: refused, naming the receipt, whatever the base
    for base in (1, 2):
        assert s.put("alice", "r1", base, {"title": "z"}, "w1", 1) == SeqTaken(
            "save_seq_taken", "w1", 1, 2, 1
        )
    # another user's identity is another identity: bob's w1#1 is his own save
    assert s.put("bob", "r1", 2, {"title": "c"}, "w1", 1) == Won(Saved(3))
    assert s.put("alice", "r1", 1, {"title": "b"}, "w1", 1) == Won(Saved(2, replayed=True))
    s.docs["r1"].version, s.docs["r1"].history = 2, s.docs["r1"].history[:2]  # back to v2
    assert s.put("alice", "r1", None, {"title": "b"}, "w1", 2) == Rejected("precondition_required")
    # authorization before any version check
    assert s.put("dave", "r1", None, {"title": "b"}, "w3", 1) == Rejected("not_found")
    assert s.put("dave", "r1", 1, {"title": "b"}, "w3", 1) == Rejected("not_found")
    assert s.put("carol", "r1", 1, {"title": "b"}, "w3", 1) == Rejected("forbidden")
    assert s.get("dave", "r1") == Rejected("not_found")
    assert s.docs["r1"].version == 2


def test_only_the_owner_shares(m):
    s = m.server
    assert s.share("alice", "r1", "erin", False) == Won(False) and s.docs["r1"].acl["erin"] is False
    assert s.get("erin", "r1").value.version == 1
    assert s.share("bob", "r1", "erin", True) == Rejected("not_owner")
    assert s.share("dave", "r1", "erin", True) == Rejected("not_found")
    assert s.share("alice", "r1", "alice", False) == Rejected("owner_access")
    assert s.access_list("alice", "r1") == Won(
        {"alice": True, "bob": True, "carol": False, "erin": False}
    )
    assert s.unshare("alice", "r1", "erin") == Won(True) and s.get("erin", "r1") == Rejected(
        "not_found"
    )
    assert s.unshare("alice", "r1", "erin") == Won(False)


def test_server_create_is_idempotent(m):
    s = m.server
    first = s.create("alice", "w1", 7, {"title": "mine"}, copy_of="r1")
    assert first.value.id == created_id("alice", "w1", 7) and not first.value.replayed
    assert s.create("alice", "w1", 7, {"title": "mine"}, copy_of="r1").value.replayed
    assert s.create("dave", "w1", 7, {"title": "mine"}, copy_of="r1") == Rejected("not_found")
    assert len(s.docs) == 3


# -- sessions --------------------------------------------------------------------------------------


def test_edit_during_in_flight_save_stays_pending(m):
    t = open_tab(m)
    m.tabs["t1"].edit({"title": "one"}, now=0)
    req = t.begin_save()
    m.tabs["t1"].edit({"qty": 5}, now=0.5)  # typed while the save is in flight
    assert m.tabs["t1"].finish_save(req, m.deliver(req)) == Won(Saved(2))
    assert t.state is State.DIRTY and t.local == {"title": "one", "qty": 5}
    assert m.drafts.read(t.key)["content"] == {"title": "one", "qty": 5}
    assert world_with(m) == []
    save(m, "t1")
    assert t.state is State.CLEAN and m.drafts.read(t.key) is None
    assert m.server.docs["r1"].content == {"title": "one", "qty": 5}
    assert world_with(m) == []


def test_lost_response_is_retried_unchanged_and_answered_from_the_receipt(m):
    t = open_tab(m)
    m.tabs["t1"].edit({"title": "one"}, now=0)
    req = t.begin_save()
    m.deliver(req)  # applied ...
    m.tabs["t1"].finish_save(req, LOST)  # ... but the answer was lost
    assert t.state is State.OFFLINE and t.local == {"title": "one"}
    assert m.drafts.read(t.key)["inflight"]["seq"] == req.seq
    m.server_write("r1", {"qty": 9})  # someone else writes meanwhile
    retry = t.begin_save()
    assert retry == req
    assert m.tabs["t1"].finish_save(retry, m.deliver(retry)) == Won(Saved(2, replayed=True))
    assert t.state is State.CLEAN and t.counters["idempotent_replays"] == 1
    assert world_with(m) == []


def test_conflict_is_explicit_and_rebase_merges_records(m):
    open_tab(m, "a", "alice")
    b = open_tab(m, "b", "bob")
    m.tabs["a"].edit({"title": "A"}, 0)
    m.tabs["b"].edit({"qty": 3}, 0)
    save(m, "a")
    out = save(m, "b")
    assert isinstance(out, VersionConflict) and b.state is State.CONFLICT
    assert m.server.docs["r1"].content == {"title": "A"}  # nothing overwritten
    assert world_with(m) == []
    with pytest.raises(IllegalTransition):
        b.begin_save()  # no save from conflict
    m.tabs["b"].rebase(prefer_local)
    assert b.state is State.DIRTY and b.local == {"title": "A", "qty": 3} and b.base_version == 2
    save(m, "b")
    assert m.server.docs["r1"].content == {"title": "A", "qty": 3}
    assert world_with(m) == []


def test_sheet_conflict_keeps_a_copy(m):
    open_tab(m, "a", doc="s1", kind="sheet")
    b = open_tab(m, "b", doc="s1", kind="sheet")
    m.tabs["a"].edit({"A1": 2}, 0)
    m.tabs["b"].edit({"B2": "=A1*2"}, 0)
    save(m, "a")
    save(m, "b")
    with pytest.raises(MergeUnsupported):
        b.rebase(prefer_local)
    assert b.state is State.CONFLICT
    req = b.begin_copy()
    out = m.tabs["b"].finish_copy(req, m.deliver(req))
    assert b.state is State.CLEAN and b.local == {"A1": 2}
    assert m.server.docs[out.value.id].content == {"A1": 1, "B2": "=A1*2"}
    assert world_with(m) == []


def test_stale_reads_are_dropped(m):
    t = open_tab(m)
    r1 = t.begin_read()
    a1 = m.deliver(r1)
    m.server_write("r1", {"qty": 1})
    r2 = t.begin_read()
    a2 = m.deliver(r2)
    assert m.tabs["t1"].finish_read(r2, a2) == Won("clean") and t.base_version == 2
    assert m.tabs["t1"].finish_read(r1, a1).reason == "out_of_order"
    assert t.base_version == 2 and t.local == {"title": "a", "qty": 1}
    r3 = t.begin_read()
    a3 = m.deliver(r3)
    m.tabs["t1"].edit({"title": "mine"}, 0)
    assert m.tabs["t1"].finish_read(r3, a3).reason == "raced_local_edit"
    assert t.local["title"] == "mine" and t.counters["stale_reads_dropped"] == 2


def test_discard_and_reload_offline_keeps_local_state(m):
    t = open_tab(m)
    m.tabs["t1"].edit({"title": "mine"}, 0)
    req = t.begin_read("replace")
    assert m.tabs["t1"].finish_read(req, LOST) == LOST
    assert t.state is State.DIRTY and t.local == {"title": "mine"}
    assert m.drafts.read(t.key) is not None
    req = t.begin_read("replace")
    assert m.tabs["t1"].finish_read(req, m.deliver(req)) == Won("clean")
    assert t.local == {"title": "a"} and m.drafts.read(t.key) is None and m.ledger().unsaved == {}


def test_a_save_asked_for_without_a_time_retries_its_delay_after_it_was_sent(m):
    """A session with a clock (the real client's): a save the user asks for (flush, "Save
    now") is sent at the clock's time, and its retry counts from then, not from the last tick."""
    clock = [0.0]
    t = open_tab(m)
    t.clock, t.retry_delay = (lambda: clock[0]), 2.0
    t.edit({"title": "offline"}, 0.0)
    with network(t, lambda request: LOST):
        assert t.tick(1.0) == LOST and t.state is State.OFFLINE and t.due_at == 3.0
        clock[0] = 1.5
        t.flush(max_failures=1)
    assert t.state is State.OFFLINE and t.due_at == 3.5


def test_close_flushes_or_parks_never_drops(m):
    t = open_tab(m)
    m.tabs["t1"].edit({"title": "x"}, 0)
    assert m.tabs["t1"].close().flushed and m.server.docs["r1"].content == {"title": "x"}
    assert t.state is State.CLOSED
    t2 = open_tab(m, "t2")
    m.tabs["t2"].edit({"title": "y"}, 0)
    with network(m.tabs["t2"], lambda r: LOST):
        res = m.tabs["t2"].close()
    assert res.parked_in_draft and t2.state is State.CLOSED
    assert m.drafts.read(t2.key)["content"] == {"title": "y"}
    assert world_with(m) == []
    # reopened by the same writer: restored, and saved
    t3 = open_tab(m, "t3", writer=t2.writer_id)
    assert t3.state is State.DIRTY and t3.local == {"title": "y"}
    save(m, "t3")
    assert m.server.docs["r1"].content == {"title": "y"} and world_with(m) == []


def test_close_refuses_when_nothing_durable_holds_the_edit(m):
    t = open_tab(m)
    m.set_drafts_failing(True)
    m.tabs["t1"].edit({"title": "x"}, 0)
    assert t.draft_status == "failing"
    with pytest.raises(UnsavedWork):
        with network(m.tabs["t1"], lambda r: LOST):
            m.tabs["t1"].close()
    assert t.state is State.OFFLINE and t.local == {"title": "x"}
    m.set_drafts_failing(False)
    with network(m.tabs["t1"], lambda r: LOST):
        assert m.tabs["t1"].close().parked_in_draft
    assert t.draft_status == "ok" and t.counters["draft_recoveries"] == 1


def test_siblings_are_offered_not_applied(m):
    open_tab(m, "t1")
    m.tabs["t1"].edit({"title": "draft of t1"}, 0)
    m.crash_tab("t1")
    t2 = open_tab(m, "t2")  # another writer, same user
    assert t2.state is State.CLEAN and t2.local == {"title": "a"}
    assert [d["writerId"] for d in t2.siblings] == ["w-t1"]
    assert world_with(m) == []
    assert m.tabs["t2"].adopt("w-t1") == Won("w-t1")
    assert t2.local == {"title": "draft of t1"} and t2.state is State.DIRTY
    assert m.drafts.read(draft_key("record", "alice", "r1", "w-t1")) is None
    assert world_with(m) == []
    t3 = open_tab(m, "t3")
    assert [d["writerId"] for d in t3.siblings] == ["w-t2"]
    assert m.tabs["t3"].discard_sibling("w-t2") == Won("w-t2")


def test_an_adopted_save_that_landed_unanswered_is_flushed_on_close(m):
    """alice's tab dies after its save reached the server; her new tab adopts the draft. Until
    it sees that save succeed the work is unsaved, though the stored copy holds its value: its
    close retries the save (answered idempotently) and leaves nothing unsaved."""
    t1 = open_tab(m, "t1")
    t1.edit({"title": "x"}, 0)
    m.deliver(t1.begin_save(1))  # lands; the answer dies with the tab
    m.crash_tab("t1")
    t2 = open_tab(m, "t2")
    assert m.server.docs["r1"].content == {"title": "x"}
    assert t2.adopt("w-t1") == Won("w-t1")
    assert m.ledger().unsaved == {("alice", "r1", "w-t2"): {"title": "x"}}
    assert t2.close().flushed and world_with(m) == [] and not m.ledger().unsaved


def test_a_sibling_discards_a_copy_not_the_work_of_a_live_tab(m):
    """A fresh tab discards the draft of alice's tab that is still open: that tab still shows
    the edit and will save it, so it stays unsaved work, held in memory until the tab writes
    its draft again; a draft removed after that is caught."""
    t1 = open_tab(m, "t1")
    t1.edit({"title": "x"}, 0)
    t2 = open_tab(m, "t2")
    assert t2.discard_sibling("w-t1") == Won("w-t1")
    assert m.ledger().unsaved == {("alice", "r1", "w-t1"): {"title": "x"}}
    assert m.ledger().undrafted == {("alice", "r1", "w-t1")}
    assert world_with(m) == []  # no draft is owed until the tab writes one
    req = t1.begin_save(1)  # writes the draft again, the save in flight
    assert m.ledger().undrafted == frozenset() and world_with(m) == []
    w = m.world()
    cleared = World(w.docs, {}, w.tabs)  # a client that drops its draft when a save starts
    assert "unsaved-work-in-one-place" in _names(check_invariants(cleared, m.ledger()))
    assert isinstance(t1.finish_save(req, m.deliver(req)), Won)
    assert world_with(m) == [] and not m.ledger().unsaved


def test_a_discarded_draft_covers_the_work_once_its_live_tab_ends(m):
    """The tab whose draft a sibling discarded ends before writing it again (killed, or closed
    from a conflict it had parked in that draft): nothing holds the edit any more, and the
    user's discard covers it. A tab already gone when its draft is discarded: the same."""
    t1 = open_tab(m, "t1")
    t1.edit({"title": "x"}, 0)
    m.server_write("r1", {"title": "theirs"})
    req = t1.begin_save(1)
    assert t1.finish_save(req, m.deliver(req)) and t1.state is State.CONFLICT
    t2 = open_tab(m, "t2")
    assert t2.discard_sibling("w-t1") == Won("w-t1")
    assert world_with(m) == [] and m.ledger().unsaved
    t1.close()
    assert world_with(m) == [] and not m.ledger().unsaved
    t3 = open_tab(m, "t3")
    t3.edit({"title": "y"}, 0)
    m.crash_tab("t3")
    t4 = open_tab(m, "t4")
    assert t4.discard_sibling("w-t3") == Won("w-t3")
    assert world_with(m) == [] and not m.ledger().unsaved


# -- the invariants catch what they name -------------------------------------------------------


def _doc(history, version=None, content=None):
    return {
        "r1": DocView("r1", "record", version or history[-1].version, content or {}, tuple(history))
    }


def _names(violations):
    return {v.invariant for v in violations}


def test_stale_accepted_save_is_caught():
    w = World(
        _doc([HistoryEntry(1, 0, "a"), HistoryEntry(2, 1, "a"), HistoryEntry(3, 1, "b")]), {}, {}
    )
    assert _names(check_invariants(w, Ledger({}))) == {"no-stale-save-accepted"}


def test_draft_in_a_slot_without_the_writer_is_caught():
    key = "knownstate:record-draft:alice:r1"
    d = DraftView(key, "record", "alice", "r1", "w1", {"title": "x"}, 1, 1, None)
    w = World(_doc([HistoryEntry(1, 0, "a")]), {key: d}, {})
    names = _names(check_invariants(w, Ledger({("alice", "r1", "w1"): {"title": "x"}})))
    assert {"unsaved-work-in-one-place", "no-edit-lost-silently"} <= names


def test_edit_cleared_from_memory_is_caught():
    key = draft_key("record", "alice", "r1", "w1")
    tab = TabView("t", "alice", "r1", "w1", "record", "clean", {"title": "old"}, 2, 2, "ok")
    w = World(_doc([HistoryEntry(1, 0, "a"), HistoryEntry(2, 1, "alice")]), {}, {"t": tab})
    names = _names(check_invariants(w, Ledger({("alice", "r1", "w1"): {"title": "new"}})))
    assert "no-edit-lost-silently" in names and key not in w.drafts


def test_close_that_drops_is_caught():
    tab = TabView(
        "t",
        "alice",
        "r1",
        "w1",
        "record",
        "closed",
        {"title": "x"},
        1,
        1,
        "ok",
        (("clean", "close", "closed"),),
    )
    w = World(_doc([HistoryEntry(1, 0, "a")]), {}, {"t": tab})
    ledger = Ledger({("alice", "r1", "w1"): {"title": "x"}})
    assert "close-flushes-never-drops" in _names(check_invariants(w, ledger))


def test_close_that_drops_a_value_the_stored_copy_holds_is_caught():
    """The stored copy holds the value (another save put it there), but the closing tab never
    saw its own save of it succeed: dropping it is still a close that drops."""
    tab = TabView(
        "t",
        "alice",
        "r1",
        "w1",
        "record",
        "closed",
        {"title": "x"},
        1,
        1,
        "ok",
        (("dirty", "close", "closed"),),
    )
    w = World(
        _doc([HistoryEntry(1, 0, "a"), HistoryEntry(2, 1, "b")], content={"title": "x"}),
        {},
        {"t": tab},
    )
    ledger = Ledger({("alice", "r1", "w1"): {"title": "x"}})
    assert "close-flushes-never-drops" in _names(check_invariants(w, ledger))


def test_conflict_left_without_the_user_is_caught():
    tab = TabView(
        "t",
        "alice",
        "r1",
        "w1",
        "record",
        "dirty",
        {},
        1,
        1,
        "ok",
        (("saving", "version_conflict", "conflict"), ("conflict", "auto_rebase", "dirty")),
    )
    w = World(_doc([HistoryEntry(1, 0, "a")]), {}, {"t": tab})
    assert _names(check_invariants(w, Ledger({}))) == {"conflict-resolved-by-user"}


def test_last_write_wins_is_caught():
    expected = World(
        _doc([HistoryEntry(1, 0, "a"), HistoryEntry(2, 1, "b")], content={"title": "B"}),
        {},
        {"t": TabView("t", "alice", "r1", "w1", "record", "conflict", {"title": "A"}, 1, 1, "ok")},
    )
    real = World(
        _doc(
            [
                HistoryEntry(1, 0, "a"),
                HistoryEntry(2, 1, "b"),
                HistoryEntry(3, 2, "alice", "w1", 2),
            ],
            content={"title": "A"},
        ),
        {},
        {"t": TabView("t", "alice", "r1", "w1", "record", "clean", {"title": "A"}, 3, 1, "ok")},
    )
    assert _names(check_invariants(real, Ledger({}), expected=expected)) == {"no-last-write-wins"}


def test_last_write_wins_by_a_close_from_conflict_is_caught():
    """The model's tab closed straight from conflict (its work parked in the draft); the real one
    resaved over the stored copy on its way out."""
    parked = (("saving", "version_conflict", "conflict"), ("conflict", "close", "closed"))
    expected = World(
        _doc([HistoryEntry(1, 0, "a"), HistoryEntry(2, 1, "b")], content={"title": "B"}),
        {},
        {
            "t": TabView(
                "t", "alice", "r1", "w1", "record", "closed", {"title": "A"}, 1, 1, "ok", parked
            )
        },
    )
    real = World(
        _doc(
            [
                HistoryEntry(1, 0, "a"),
                HistoryEntry(2, 1, "b"),
                HistoryEntry(3, 2, "alice", "w1", 2),
            ],
            content={"title": "A"},
        ),
        {},
        {
            "t": TabView(
                "t",
                "alice",
                "r1",
                "w1",
                "record",
                "closed",
                {"title": "A"},
                3,
                2,
                "ok",
                (
                    ("saving", "version_conflict", "conflict"),
                    ("conflict", "rebase", "dirty"),
                    ("dirty", "save", "saving"),
                    ("saving", "saved", "clean"),
                    ("clean", "close", "closed"),
                ),
            )
        },
    )
    assert _names(check_invariants(real, Ledger({}), expected=expected)) == {"no-last-write-wins"}
    assert check_invariants(expected, Ledger({}), expected=expected) == []


def test_record_schema_ids_are_matched_in_full():
    for attr in ("title\n", "title ", "Title"):
        with pytest.raises(KindError, match="attribute id"):
            RECORD.validate_schema({"attributes": {attr: "text"}})


def test_a_save_identity_applied_twice_is_caught():
    history = [
        HistoryEntry(1, 0, "a"),
        HistoryEntry(2, 1, "alice", "w1", 3),
        HistoryEntry(3, 2, "alice", "w1", 3),
        HistoryEntry(4, 3, "bob", "w1", 3),
    ]
    w = World(_doc(history), {}, {})
    violations = check_invariants(w, Ledger({}))
    assert _names(violations) == {"one-version-per-save"} and len(violations) == 1
    assert "w1#3" in str(violations[0]) and "v2 and v3" in str(violations[0])


def test_a_writer_reopened_without_its_draft_goes_on_with_a_fresh_seq(m):
    t = open_tab(m, writer="w1")
    m.tabs["t1"].edit({"title": "one"}, now=0)
    assert save(m, "t1") == Won(Saved(2))
    m.tabs["t1"].close()
    t = open_tab(m, writer="w1")  # the same writer again, its draft long gone
    assert t.next_seq == 1
    m.tabs["t1"].edit({"title": "two"}, now=0)
    taken = save(m, "t1")
    assert taken == SeqTaken("save_seq_taken", "w1", 1, 2, 1)
    assert t.state is State.DIRTY and t.next_seq == 2 and t.local == {"title": "two"}
    assert t.transitions[-1] == ("saving", "seq_taken", "dirty")
    assert save(m, "t1") == Won(Saved(3)) and t.state is State.CLEAN
    assert world_with(m) == []


def test_save_without_base_is_caught():
    from knownstate.model.document import SaveRequest

    w = World(_doc([HistoryEntry(1, 0, "a")]), {}, {})
    bad = SaveRequest("r1", "alice", "w1", 1, None, {}, 1)
    assert _names(check_invariants(w, Ledger({}), sent=[bad])) == {"save-carries-base-version"}


# -- a random walk: the model keeps its own invariants ---------------------------------------------


class ModelWalk(RuleBasedStateMachine):
    """Random operations (and network losses) over two users' tabs; every invariant holds after
    every step. This checks the model's own consistency; the real session is checked against it
    by the stateful check in chaos/."""

    @initialize()
    def setup(self):
        self.m = DocumentModel(debounce=0.0)
        self.m.seed("r1", "record", REC_SCHEMA, {"title": "a"}, "alice", {"bob": True})
        self.pending: dict[str, object] = {}
        self.n = 0

    def _live(self):
        return [k for k, t in self.m.tabs.items() if t.state is not State.CLOSED]

    @precondition(lambda self: len(self.m.tabs) < 4)
    @rule(
        user=st.sampled_from(["alice", "bob"]),
        writer=st.sampled_from(["w1", "w2", "w3"]),
        online=st.booleans(),
    )
    def open(self, user, writer, online):
        if any(
            t.writer_id == writer and t.user == user and t.state is not State.CLOSED
            for t in self.m.tabs.values()
        ):
            return
        self.n += 1
        tab = f"t{self.n}"
        self.m.open_tab(tab, user, "r1", "record", writer)
        req = self.m.tabs[tab].begin_read("load")
        self.m.tabs[tab].finish_read(req, self.m.deliver(req) if online else LOST)

    @precondition(lambda self: any(t.state is State.LOADING for t in self.m.tabs.values()))
    @rule(data=st.data())
    def load_again(self, data):
        tab = data.draw(
            st.sampled_from(sorted(k for k, t in self.m.tabs.items() if t.state is State.LOADING))
        )
        req = self.m.tabs[tab].begin_read("load")
        self.m.tabs[tab].finish_read(req, self.m.deliver(req))

    @precondition(lambda self: self._live())
    @rule(data=st.data(), attr=st.sampled_from(["title", "qty"]), v=st.integers(0, 3))
    def edit(self, data, attr, v):
        tab = data.draw(st.sampled_from(self._live()))
        t = self.m.tabs[tab]
        if t.state in (State.LOADING, State.COPYING):
            return
        self.m.tabs[tab].edit({attr: f"v{v}" if attr == "title" else v}, now=0)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), fate=st.sampled_from(["ok", "ok", "lost_request", "lost_answer"]))
    def save(self, data, fate):
        tab = data.draw(st.sampled_from(self._live()))

        def net(req):
            answer = LOST if fate == "lost_request" else self.m.deliver(req)
            return LOST if fate == "lost_answer" else answer

        with network(self.m.tabs[tab], net):
            self.m.tabs[tab].tick(0)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), v=st.integers(0, 3), lost=st.booleans())
    def edit_during_save(self, data, v, lost):
        tab = data.draw(st.sampled_from(self._live()))
        t = self.m.tabs[tab]
        if not t.due(0):
            return
        req = self.m.tabs[tab].begin_save()
        self.m.tabs[tab].edit({"qty": v}, now=0)
        answer = self.m.deliver(req)
        self.m.tabs[tab].finish_save(req, LOST if lost else answer)

    @precondition(lambda self: self._live())
    @rule(
        data=st.data(),
        how=st.sampled_from(["rebase_local", "rebase_stored", "copy", "discard", "reload"]),
    )
    def resolve(self, data, how):
        tab = data.draw(st.sampled_from(self._live()))
        t = self.m.tabs[tab]
        if t.state is not State.CONFLICT:
            return
        if how.startswith("rebase"):
            self.m.tabs[tab].rebase(prefer_local if how == "rebase_local" else prefer_stored)
        elif how == "copy":
            req = t.begin_copy()
            self.m.tabs[tab].finish_copy(req, self.m.deliver(req))
        elif how == "discard":
            self.m.tabs[tab].discard()
        else:
            req = t.begin_read("replace")
            self.m.tabs[tab].finish_read(req, self.m.deliver(req))

    @precondition(lambda self: self._live())
    @rule(data=st.data(), adopt=st.booleans())
    def sibling(self, data, adopt):
        tab = data.draw(st.sampled_from(self._live()))
        t = self.m.tabs[tab]
        if not t.siblings or t.state is State.CLOSED or (adopt and t.state is not State.CLEAN):
            return
        writer = data.draw(st.sampled_from([d["writerId"] for d in t.siblings]))
        if adopt:
            self.m.tabs[tab].adopt(writer)
        else:
            self.m.tabs[tab].discard_sibling(writer)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), swap=st.booleans())
    def reload(self, data, swap):
        tab = data.draw(st.sampled_from(self._live()))
        t = self.m.tabs[tab]
        if t.state is not State.CLEAN:
            return
        r1 = t.begin_read()
        a1 = self.m.deliver(r1)
        r2 = t.begin_read()
        a2 = self.m.deliver(r2)
        for r, a in [(r2, a2), (r1, a1)] if swap else [(r1, a1), (r2, a2)]:
            self.m.tabs[tab].finish_read(r, a)

    @rule(v=st.integers(0, 3))
    def ai_write(self, v):
        self.m.server_write("r1", {"qty": v})

    @rule(failing=st.booleans())
    def drafts_fail(self, failing):
        self.m.set_drafts_failing(failing)

    @precondition(lambda self: self._live())
    @rule(data=st.data(), online=st.booleans())
    def close(self, data, online):
        tab = data.draw(st.sampled_from(self._live()))
        if self.m.tabs[tab].state in (State.SAVING, State.COPYING):
            return
        try:
            with network(self.m.tabs[tab], self.m.deliver if online else (lambda r: LOST)):
                self.m.tabs[tab].close()
        except UnsavedWork:
            pass

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def crash(self, data):
        self.m.crash_tab(data.draw(st.sampled_from(self._live())))

    @invariant()
    def invariants_hold(self):
        assert check_invariants(self.m.world(), self.m.ledger(), expected=self.m.world()) == []


TestModelWalk = ModelWalk.TestCase
TestModelWalk.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
