"""The client session: real sessions, a real server on real PostgreSQL, real HTTP through a
real Toxiproxy link. Time is a number the test moves; nothing sleeps."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from knownstate.chaos.toxi import Toxic
from knownstate.impl.documents import (
    DocumentServer,
    DocumentStore,
    DraftStore,
    HttpTransport,
    Session,
    schema_sql,
)
from knownstate.model.contract import IllegalTransition, Rejected, Won
from knownstate.model.document import (
    Created,
    Dropped,
    DocumentModel,
    MergeUnsupported,
    NoAnswer,
    Saved,
    SeqTaken,
    SessionCore,
    State,
    UnsavedWork,
    VersionConflict,
    World,
    check_invariants,
    draft_key,
    prefer_local,
    prefer_stored,
)

REC_SCHEMA = {"attributes": {"title": "text", "qty": "number", "done": "bool"}}
SHEET_SCHEMA = {"rows": 20, "cols": 4}
_links = itertools.count()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Env:
    def __init__(self, store: DocumentStore, server: DocumentServer, link, drafts: DraftStore):
        self.store, self.server, self.link, self.drafts = store, server, link, drafts
        self.clock = Clock()
        self.transports: list[HttpTransport] = []

    def session(
        self, doc="rec1", user="alice", kind="record", writer=None, open_it=True, **kw
    ) -> Session:
        t = HttpTransport(f"http://127.0.0.1:{self.link.port}", timeout=3)
        self.transports.append(t)
        s = Session(
            doc,
            user=user,
            kind=kind,
            drafts=self.drafts,
            transport=t,
            writer_id=writer,
            debounce=1.0,
            clock=self.clock,
            **kw,
        )
        if open_it:
            assert s.open() == Won(s.state.value) and s.state in (State.CLEAN, State.DIRTY)
        return s

    def doc(self, doc="rec1"):
        return self.store.documents()[doc]

    def close(self):
        for t in self.transports:
            t.close()


@pytest.fixture
def env(knownstate_db, toxiproxy, tmp_path):
    dsn = knownstate_db(schema_sql())
    store = DocumentStore(dsn, pool_size=None)
    store.seed("rec1", "record", REC_SCHEMA, {"title": "a", "qty": 1}, "alice", {"bob": True})
    store.seed("sheet1", "sheet", SHEET_SCHEMA, {"A1": 1}, "alice", {"bob": True})
    with store, DocumentServer(dsn) as server:
        link = toxiproxy.link(
            f"documents-http-{server.port}-{next(_links)}", "127.0.0.1", server.port
        )
        e = Env(store, server, link, DraftStore(tmp_path / "drafts"))
        yield e
        e.close()


def lose_responses(link):
    """The server gets the request and answers; the answer never reaches the client."""
    toxic = Toxic("limit_data", "downstream", {"bytes": 0})
    link.add(toxic)
    return toxic


# -- one machine ---------------------------------------------------------------------------------


def test_the_session_is_the_models_machine_with_real_ports(env):
    """h11's rule: everything that affects the session's state lives in the model's machine; the
    real session only plugs in ports (HTTP, a clock, the draft files) and adds no transition."""
    assert issubclass(Session, SessionCore)
    assert {n for n in vars(Session) if not n.startswith("__")} == {"aclose"}
    s = env.session()
    assert s.send == s.transport.send and s.clock is env.clock and s.drafts is env.drafts
    for method in ("key", "write", "delete", "read", "siblings"):  # the draft-store port
        assert callable(getattr(env.drafts, method))


# -- the save queue --------------------------------------------------------------------------------


def test_edits_debounce_into_one_save(env):
    s = env.session()
    s.edit({"title": "b"}, now=0.0)
    s.edit({"qty": 2}, now=0.5)
    assert s.tick(1.0) is None and s.state is State.DIRTY  # not due: the last edit was at 0.5
    assert s.tick(1.5) == Won(Saved(2))
    assert s.state is State.CLEAN and env.doc().content == {"title": "b", "qty": 2}
    assert env.doc().version == 2 and s.counters["saves"] == 1
    assert env.drafts.read(s.key) is None


def test_edit_during_in_flight_save_stays_pending(env):
    s = env.session()
    s.edit({"title": "first"}, now=0)
    req = s.begin_save(now=1)
    # the draft is written before the request
    assert env.drafts.read(s.key)["inflight"]["seq"] == req.seq
    s.edit({"qty": 7}, now=1.2)  # typed while the save is in flight
    answer = s.transport.send(req)
    assert s.finish_save(req, answer) == Won(Saved(2))
    # a success never clears it
    assert s.state is State.DIRTY and s.local == {"title": "first", "qty": 7}
    assert env.drafts.read(s.key)["content"] == {"title": "first", "qty": 7}
    assert env.doc().content == {"title": "first", "qty": 1}
    assert s.tick(2.2) == Won(Saved(3))
    assert s.state is State.CLEAN and env.doc().content == {"title": "first", "qty": 7}


def test_saves_are_serialised(env):
    s = env.session()
    s.edit({"title": "x"}, now=0)
    req = s.begin_save(now=1)
    s.edit({"title": "y"}, now=1)
    assert s.tick(5) is None  # one in flight: no second request
    with pytest.raises(IllegalTransition):
        s.begin_save()
    assert s.state is State.SAVING
    s.finish_save(req, s.transport.send(req))


# -- the network fails -----------------------------------------------------------------------------


def test_lost_response_is_retried_and_answered_with_the_original_success(env):
    s = env.session()
    s.edit({"title": "mine"}, now=0)
    toxic = lose_responses(env.link)
    answer = s.tick(1)
    assert isinstance(answer, NoAnswer) and answer.reason.startswith("lost")
    assert s.state is State.OFFLINE and s.local == {"title": "mine", "qty": 1}
    assert env.doc().version == 2 and env.doc().content == {"title": "mine", "qty": 1}  # it landed
    assert env.store.applied(s.unconfirmed) == 2
    assert env.drafts.read(s.key)["content"] == {"title": "mine", "qty": 1}
    env.store.server_write("rec1", {"done": True})  # and the world moved on
    env.link.remove(toxic)
    assert s.tick(1) == Won(Saved(2, replayed=True))  # not a conflict against itself
    assert s.state is State.CLEAN and s.counters["idempotent_replays"] == 1
    assert env.doc().version == 3 and [h.version for h in env.doc().history] == [1, 2, 3]
    assert env.drafts.read(s.key) is None


def test_offline_keeps_the_edit_and_retries(env):
    s = env.session()
    s.edit({"title": "offline work"}, now=0)
    env.link.down()
    answer = s.tick(1)
    assert isinstance(answer, NoAnswer) and answer.reason.startswith("unreachable")
    assert s.state is State.OFFLINE and s.counters["save_failures"] == 1
    assert env.doc().version == 1 and env.store.applied(s.unconfirmed) is None
    assert env.drafts.read(s.key)["content"]["title"] == "offline work"
    assert isinstance(s.tick(2), NoAnswer)  # retried, still offline
    env.link.up()
    assert s.tick(3) == Won(Saved(2))
    assert s.state is State.CLEAN and env.doc().content["title"] == "offline work"


def test_discard_and_reload_while_offline_keeps_local_state(env):
    s = env.session()
    s.edit({"title": "only copy"}, now=0)
    env.link.down()
    assert isinstance(s.discard_and_reload(), NoAnswer)
    assert s.state is State.DIRTY and s.local["title"] == "only copy"
    assert env.drafts.read(s.key)["content"]["title"] == "only copy"
    env.link.up()
    env.store.server_write("rec1", {"qty": 5})
    assert s.discard_and_reload() == Won("clean")
    assert s.local == {"title": "a", "qty": 5} and s.base_version == 2
    assert env.drafts.read(s.key) is None and s.counters["discarded"] == 1


# -- conflicts -------------------------------------------------------------------------------------


def test_conflict_is_a_state_not_an_automatic_rebase(env):
    s = env.session()
    s.edit({"qty": 3}, now=0)
    env.store.server_write("rec1", {"title": "from the ai"})  # the server-side writer
    answer = s.tick(1)
    assert isinstance(answer, VersionConflict) and answer.version == 2
    assert s.state is State.CONFLICT and s.conflict.content == {"title": "from the ai", "qty": 1}
    exchanges = s.transport.exchanges
    for now in (2, 10, 100):
        assert s.tick(now) is None  # no automatic resave
    assert s.transport.exchanges == exchanges
    assert env.doc().content == {"title": "from the ai", "qty": 1} and env.doc().version == 2
    s.edit({"done": True}, now=100)  # editing in conflict is allowed
    assert s.state is State.CONFLICT
    assert s.rebase(prefer_local) == Won(s.generation)
    assert s.state is State.DIRTY and s.base_version == 2
    assert s.tick(100) == Won(Saved(3))
    assert env.doc().content == {"title": "from the ai", "qty": 3, "done": True}
    assert s.counters["conflicts"] == 1 and s.counters["rebases"] == 1


def test_rebase_clash_is_decided_by_the_resolver(env):
    s = env.session()
    s.edit({"title": "mine"}, now=0)
    env.store.server_write("rec1", {"title": "theirs"})
    s.tick(1)
    s.rebase(prefer_stored)
    assert s.local == {"title": "theirs", "qty": 1}
    s.tick(1)
    assert env.doc().content == {"title": "theirs", "qty": 1}


def test_sheet_conflict_keeps_the_local_copy_as_a_new_document(env):
    s = env.session("sheet1", kind="sheet")
    s.edit({"B1": "=A1+1"}, now=0)
    env.store.server_write("sheet1", {"A1": 2})
    assert isinstance(s.tick(1), VersionConflict)
    with pytest.raises(MergeUnsupported):
        s.rebase(prefer_local)
    assert s.state is State.CONFLICT
    out = s.keep_local_as_copy()
    assert isinstance(out, Won) and isinstance(out.value, Created)
    copy = env.store.documents()[out.value.id]
    assert copy.kind == "sheet" and copy.content == {"A1": 1, "B1": "=A1+1"}
    assert s.state is State.CLEAN and s.local == {"A1": 2} and s.base_version == 2
    assert env.doc("sheet1").content == {"A1": 2}
    assert env.drafts.read(s.key) is None and s.counters["copies"] == 1


def test_copy_whose_answer_was_lost_is_not_duplicated(env):
    s = env.session("sheet1", kind="sheet")
    s.edit({"B1": 1}, now=0)
    env.store.server_write("sheet1", {"A1": 2})
    s.tick(1)
    toxic = lose_responses(env.link)
    assert isinstance(s.keep_local_as_copy(), NoAnswer)
    assert s.state is State.CONFLICT and len(env.store.documents()) == 3
    assert env.store.applied(s.unconfirmed_copy) == 1
    env.link.remove(toxic)
    out = s.keep_local_as_copy()
    assert out.value.replayed and len(env.store.documents()) == 3


def test_discard_in_conflict_takes_the_stored_copy(env):
    s = env.session()
    s.edit({"title": "mine"}, now=0)
    env.store.server_write("rec1", {"qty": 9})
    s.tick(1)
    s.discard()
    assert s.state is State.CLEAN and s.local == {"title": "a", "qty": 9} and s.base_version == 2
    assert env.drafts.read(s.key) is None


# -- drafts ----------------------------------------------------------------------------------------


def test_sibling_drafts_are_offered_never_applied(env):
    a = env.session(writer="tab-a")
    a.edit({"title": "tab a's work"}, now=0)
    a.begin_save(now=1)  # the tab dies mid-save: the request never went out
    del a
    b = env.session(writer="tab-b")
    assert b.state is State.CLEAN and b.local == {"title": "a", "qty": 1}  # not applied
    assert [d["writerId"] for d in b.siblings] == ["tab-a"]
    assert env.drafts.read(b.key) is None
    assert b.adopt("tab-a") == Won("tab-a")
    assert b.state is State.DIRTY and b.local["title"] == "tab a's work"
    assert env.drafts.read(draft_key("record", "alice", "rec1", "tab-a")) is None
    assert env.drafts.read(b.key)["content"]["title"] == "tab a's work"
    assert b.tick(1) == Won(Saved(2)) and env.doc().content["title"] == "tab a's work"
    c = env.session(writer="tab-c")
    assert c.siblings == []


def test_sibling_draft_can_be_discarded(env):
    a = env.session(writer="tab-a")
    a.edit({"title": "abandoned"}, now=0)
    b = env.session(writer="tab-b")
    assert b.discard_sibling("tab-a") == Won("tab-a")
    assert env.drafts.read(a.key) is None and b.counters["siblings_discarded"] == 1
    assert env.doc().content["title"] == "a"


def test_two_writers_never_share_a_slot(env):
    a, b = env.session(writer="tab-a"), env.session(writer="tab-b")
    a.edit({"title": "A"}, now=0)
    b.edit({"qty": 2}, now=0)
    assert env.drafts.read(a.key)["content"]["title"] == "A"
    assert env.drafts.read(b.key)["content"]["qty"] == 2
    assert len(env.drafts.keys()) == 2


def test_reopened_writer_restores_its_draft_and_retries_its_lost_save(env):
    a = env.session(writer="tab-a")
    a.edit({"title": "before the crash"}, now=0)
    toxic = lose_responses(env.link)
    assert isinstance(a.tick(1), NoAnswer)  # applied, answer lost ...
    del a  # ... and the tab is gone
    env.link.remove(toxic)
    again = env.session(writer="tab-a")
    assert again.state is State.DIRTY and again.counters["drafts_restored"] == 1
    assert again.tick(1) == Won(Saved(2, replayed=True))
    assert again.state is State.CLEAN and env.doc().version == 2


def test_writer_reopened_without_its_draft_never_reuses_a_save_identity(env):
    a = env.session(writer="tab-a")
    a.edit({"title": "first life"}, now=0)
    assert a.tick(1) == Won(Saved(2)) and a.close().flushed
    again = env.session(writer="tab-a")  # no draft: it counts from 1 again
    again.edit({"title": "second life"}, now=2)
    taken = again.tick(3)
    assert isinstance(taken, SeqTaken) and (taken.seq, taken.version, taken.last_seq) == (1, 2, 1)
    assert again.state is State.DIRTY and env.doc().version == 2  # refused, not applied
    assert again.tick(3) == Won(Saved(3)) and env.doc().content["title"] == "second life"
    history = [(h.writer_id, h.save_seq) for h in env.doc().history if h.writer_id]
    assert history == [("tab-a", 1), ("tab-a", 2)]


def test_failing_draft_store_is_visible_and_recovers(env):
    s = env.session()
    env.drafts.fail_writes = True
    s.edit({"title": "x"}, now=0)
    assert s.draft_status == "failing" and "failing" in s.draft_error
    assert s.counters["draft_failures"] == 1
    assert env.drafts.read(s.key) is None
    s.edit({"title": "y"}, now=0.1)  # still failing: retried, no latch
    assert env.drafts.refused == 2
    env.drafts.fail_writes = False
    s.edit({"qty": 4}, now=0.2)  # the next write goes through
    assert s.draft_status == "ok" and s.counters["draft_recoveries"] == 1
    assert env.drafts.read(s.key)["content"] == {"title": "y", "qty": 4}


def test_close_refuses_to_drop_when_neither_server_nor_drafts_take_the_edit(env):
    s = env.session()
    env.drafts.fail_writes = True
    s.edit({"title": "precious"}, now=0)
    env.link.down()
    with pytest.raises(UnsavedWork):
        s.close()
    assert s.state is State.OFFLINE and s.local["title"] == "precious"
    env.drafts.fail_writes = False
    res = s.close()
    assert res.parked_in_draft and s.state is State.CLOSED
    assert env.drafts.read(s.key)["content"]["title"] == "precious"


# -- closing ---------------------------------------------------------------------------------------


def test_close_flushes(env):
    s = env.session()
    s.edit({"title": "typed just before closing"}, now=0)
    res = s.close()  # no tick: the debounce is not due
    assert res.flushed and s.state is State.CLOSED
    assert env.doc().content["title"] == "typed just before closing"
    assert env.drafts.read(s.key) is None
    with pytest.raises(IllegalTransition):
        s.edit({"title": "after close"})


def test_close_can_be_awaited(env):
    s = env.session()
    s.edit({"qty": 11}, now=0)
    res = asyncio.run(s.aclose())
    assert res.flushed and env.doc().content["qty"] == 11


def test_close_offline_parks_the_work_in_the_draft(env):
    s = env.session(writer="tab-a")
    s.edit({"title": "parked"}, now=0)
    env.link.down()
    res = s.close()
    assert res == res.__class__(flushed=False, parked_in_draft=True) and s.state is State.CLOSED
    env.link.up()
    again = env.session(writer="tab-a")
    assert again.local["title"] == "parked"
    again.close()
    assert env.doc().content["title"] == "parked" and env.drafts.keys() == []


def test_session_belongs_to_the_document_not_the_panel(env):
    from knownstate.impl.documents import Workspace

    t = HttpTransport(f"http://127.0.0.1:{env.link.port}", timeout=3)
    env.transports.append(t)
    ws = Workspace("alice", env.drafts, t, clock=env.clock)
    left, right = ws.open_panel("rec1", "record"), ws.open_panel("rec1", "record")
    assert left is right  # one session per document
    left.edit({"title": "typed in the left panel"}, now=0)
    ws.close_panel("rec1")  # closing a panel flushes ...
    assert env.doc().content["title"] == "typed in the left panel"
    assert right.state is State.CLEAN  # ... and the session lives on
    right.edit({"qty": 2}, now=0)
    assert ws.close_document("rec1").flushed and right.state is State.CLOSED
    assert env.doc().content == {"title": "typed in the left panel", "qty": 2}


# -- stale reads -----------------------------------------------------------------------------------


def test_out_of_order_read_is_dropped(env):
    s = env.session()
    old = s.begin_read()
    old_answer = s.transport.send(old)  # the old state of the document
    env.store.server_write("rec1", {"title": "newer"})
    new = s.begin_read()
    assert s.finish_read(new, s.transport.send(new)) == Won("clean")
    assert s.local["title"] == "newer" and s.base_version == 2
    assert s.finish_read(old, old_answer) == Dropped("out_of_order")
    assert s.local["title"] == "newer" and s.base_version == 2
    assert s.counters["stale_reads_dropped"] == 1


def test_read_that_raced_a_local_edit_is_dropped(env):
    s = env.session()
    read = s.begin_read()
    answer = s.transport.send(read)
    s.edit({"title": "typed meanwhile"}, now=0)
    assert s.finish_read(read, answer) == Dropped("raced_local_edit")
    assert s.local["title"] == "typed meanwhile" and s.state is State.DIRTY


def test_reload_applies_a_newer_version_when_clean(env):
    s = env.session()
    env.store.server_write("rec1", {"qty": 2})
    assert s.reload() == Won("clean") and s.local == {"title": "a", "qty": 2}
    s.edit({"qty": 3}, now=0)
    with pytest.raises(IllegalTransition):
        s.reload()  # a refresh never overwrites local edits


def test_stranger_session_cannot_load(env):
    s = env.session(user="dave", open_it=False)
    assert s.open() == Rejected("not_found") and s.state is State.LOADING


# -- the model and the real session agree ----------------------------------------------------------


def test_real_session_matches_the_model_and_keeps_the_invariants(env):
    """A scripted run through the real parts (with a lost answer and a server-side write) and
    through the model: same answers, same states, and the invariants hold on the projection."""
    model = DocumentModel(debounce=1.0)
    model.seed("rec1", "record", REC_SCHEMA, {"title": "a", "qty": 1}, "alice", {"bob": True})
    model.seed("sheet1", "sheet", SHEET_SCHEMA, {"A1": 1}, "alice", {"bob": True})
    real = {
        "a": env.session(writer="wa", open_it=False),
        "b": env.session(user="bob", writer="wb", open_it=False),
    }
    for tab, s in real.items():
        model.open_tab(tab, s.user, "rec1", "record", s.writer_id)
    sent = []

    def step(tab, op, *args, fate="ok"):
        s, m = real[tab], model.tabs[tab]
        if op == "load":
            req, mreq = s.begin_read("load"), m.begin_read("load")
            out = s.finish_read(req, s.transport.send(req))
            mout = m.finish_read(mreq, model.deliver(mreq))
        elif op == "edit":
            out, mout = s.edit(*args), m.edit(*args)
        elif op == "save":
            req, mreq = s.begin_save(), m.begin_save()
            assert req == mreq
            sent.append(req)
            toxic = lose_responses(env.link) if fate == "lost" else None
            answer = s.transport.send(req)
            if toxic:
                env.link.remove(toxic)
            mans = model.deliver(mreq)
            out = s.finish_save(req, answer)
            mout = m.finish_save(mreq, NoAnswer(answer.reason) if fate == "lost" else mans)
        elif op == "rebase":
            out, mout = s.rebase(*args), m.rebase(*args)
        elif op == "close":
            out, mout = s.close(), m.close()
        assert type(out) is type(mout) and (isinstance(out, NoAnswer) or out == mout), (
            op,
            out,
            mout,
        )
        assert s.view(tab) == m.view(tab)
        projected = World(
            env.store.documents(), env.drafts.views(), {t: x.view(t) for t, x in real.items()}
        )
        assert {k: (d.version, d.content) for k, d in projected.docs.items()} == {
            k: (d.version, d.content) for k, d in model.world().docs.items()
        }
        assert check_invariants(projected, model.ledger(), expected=model.world(), sent=sent) == []

    step("a", "load")
    step("b", "load")
    step("a", "edit", {"title": "A"}, 0)
    step("a", "save", fate="lost")
    step("b", "edit", {"qty": 2}, 0)
    step("b", "save")  # conflict: a's lost save did land
    step("a", "save")  # the retry: the original success
    step("b", "rebase", prefer_local)
    step("b", "save")
    env.store.server_write("rec1", {"done": True})
    model.server_write("rec1", {"done": True})
    step("a", "edit", {"title": "A2"}, 5)
    step("a", "close")  # a's base is stale: conflict, parked in its draft
    step("b", "close")
    assert env.doc().content == {"title": "A", "qty": 2, "done": True}
    assert env.drafts.read(real["a"].key)["content"]["title"] == "A2"
    assert [t[1] for t in real["a"].transitions[-3:]] == ["save", "version_conflict", "close"]
