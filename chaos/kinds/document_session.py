"""The versioned document session's model-versus-implementation check.

What runs
---------

Real client sessions (:class:`~knownstate.impl.documents.session.Session`), tabs of two users
(alice in slots ``a1`` and ``a2``, bob in ``b1``), talk HTTP to the real
:class:`~knownstate.impl.documents.server.DocumentServer` over real PostgreSQL. Each slot's
requests go through its own Toxiproxy link, and so do the server's database connections, so a
single tab can go offline or lose an answer while the others carry on. The per-writer drafts are
the real file-backed :class:`~knownstate.impl.documents.drafts.DraftStore`. The pure
:class:`~knownstate.model.document.DocumentModel` is driven with the very same operations.

Rules are the user's and the world's actions: open (a fresh writer, or the same writer again,
which restores its draft), load, edit, the debounce tick (which saves when due), an edit made
while a save is in flight, discard, discard-and-reload, reload, reads that race (out of order,
against a local edit, against a save), conflict resolution by rebase, copy or discard, adopting
or discarding a sibling draft, close, a tab killed mid-save, the server-side writer, and the
draft store failing and recovering. Faults are rules too: a request made offline or whose answer
is lost (per step), toxics with concrete values and links taken down (on a tab's link or on the
server's database link), and a database crash.

How model and implementation are compared
-----------------------------------------

Each rule is one script run twice: against the real parts, and against the model. Every HTTP
exchange the real sessions make is recorded (request and answer); the model replays the script
with a ``deliver`` that requires the model to send the same requests in the same order and
the server to give the same answers. A request whose answer never arrived may or may not have
been applied by the server: the model then keeps both possible worlds and the next observation
decides (the check logs which). After every step the real world — rows, draft files, sessions —
is projected and must equal the model's, and the seven invariants of the model
(:func:`knownstate.model.document.check_invariants`) are evaluated on the *real* world, plus two
the check states itself (:data:`CHECK_INVARIANTS`: a retry is answered from its receipt, an
applied read never goes back to an older version). When the implementation disagrees with the
model the invariants are evaluated first, so a failure names the invariant it broke when it broke
one; otherwise it shows the difference.

What this check overrides of :class:`~knownstate.chaos.check.KindCheck`
-----------------------------------------------------------------------

The session is not a durable run kind: ``contract`` is None, :meth:`table` is the session's
:data:`~knownstate.model.document.TABLE` (vacuity counts its every row), and ``model_agrees`` is
replaced (judge before reporting, count the transitions of every tab, including tabs that died).
There are no workers: the generic link faults act on the tabs' links and the server's database
link (``_link``, ``faulted_links``), with a few operations of calm between two faults and a heal
after ``FAULT_STEPS`` operations; a database crash is drawn only while a tab waits to retry a
save; the database clock plays no role (``clock_matters``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import psycopg
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

import httpx

from knownstate.impl.documents import store as store_impl
from knownstate.impl.documents.drafts import DraftStore
from knownstate.impl.documents.reading import BadRequest, RequestReader
from knownstate.impl.documents.server import DocumentServer
from knownstate.impl.documents.session import HttpTransport, Session
from knownstate.impl.documents.store import DocumentStore
from knownstate.model.contract import IllegalTransition, Rejected, Won
from knownstate.model.document import (
    TABLE,
    CloseResult,
    CopyRequest,
    INVARIANTS as SESSION_INVARIANTS,
    Created,
    DocumentModel,
    DraftView,
    Dropped,
    KindError,
    NoAnswer,
    RecordKind,
    SheetKind,
    ReadRequest,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    State,
    UnsavedWork,
    VersionConflict,
    Violation,
    TabModel,
    World,
    check_invariants,
    prefer_local,
    prefer_stored,
    save_fingerprint,
)

from ..check import KindCheck, _record_mismatch, toxics
from ..toxi import Toxic
from .document_requests import HOSTILE, REQUEST_INVARIANTS, Hostile, judge

DOC = "r1"
SCHEMA = {"attributes": {"title": "text", "qty": "number", "done": "bool"}}
INITIAL = {"title": "first", "qty": 0}
SLOTS = {"a1": "alice", "a2": "alice", "b1": "bob"}  # tab slot -> user; every tab edits DOC
DEBOUNCE = 1.0
NETS = ("ok",) * 6 + ("offline", "answer lost")                      # for a step that reads
NETS_WRITE = ("ok",) * 3 + ("offline", "answer lost", "answer lost")  # for a step that may write
NETS_COPY = ("ok", "offline", "answer lost")                          # for keeping a copy
RECEIPT_SQL = ("SELECT fingerprint, version FROM document_history WHERE document_id = %s "
               "AND author = %s AND writer_id = %s AND save_seq = %s")
CLIENT = "client"  # the wire of requests no session makes (see document_requests)
FAULT_STEPS = 4  # a link fault heals by itself after this many operations (faults stay sparse, work flows)
SERVER_APP = "ks-document-server"

CHECK_INVARIANTS = {
    "retry-answered-from-receipt":
        "A save whose identity (user, writerId, saveSeq) already saved is answered from that "
        "save's receipt: the same request with its original success, never a conflict against "
        "itself; other content with save_seq_taken.",
    "receipt-is-the-users-own":
        "Only the user's own receipt answers a save: another user's save under the same writerId "
        "neither answers nor replaces it.",
    "no-stale-read-applied": "A read a tab applies never takes its copy back to a version older than its base.",
    **REQUEST_INVARIANTS,
}
"""Judged on the real world besides the model's seven invariants (``SESSION_INVARIANTS``): the HTTP
contract's idempotent retry, and the stale-read guard. Each is what a mutant of the catalogue breaks."""


# ---------------------------------------------------------------------------------------
# Outcomes, canonical forms, and one-line descriptions for the trace.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raised:
    """An operation refused with an exception (the model must refuse it the same way)."""

    error: str


DOMAIN_ERRORS = (UnsavedWork, IllegalTransition, KindError, KeyError)


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except DOMAIN_ERRORS as e:
        return Raised(type(e).__name__)


def _encode(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return [type(o).__name__, *(getattr(o, f.name) for f in dataclasses.fields(o))]
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    raise TypeError(f"cannot compare a {type(o).__name__}")


def canon(x: Any) -> str:
    """A strict canonical form (JSON): ``true`` is not ``1``, ``1`` is not ``1.0``, and dict order
    does not count."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"), default=_encode)


def show(x: Any) -> str:
    """An outcome in a few words: no driver error text, no ports (a seed replays the same trace)."""
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


class Diverged(Exception):
    """The model cannot follow what the implementation did."""


class Redundant(Exception):
    """A 'the lost request landed' world that equals the 'it did not' one: not kept twice."""


# ---------------------------------------------------------------------------------------
# The model side: DocumentModel plus what the check counts on it.
# ---------------------------------------------------------------------------------------


class CheckedModel(DocumentModel):
    """The model of the whole world, and the bookkeeping the check keeps with each possible world:
    which transitions and counters were already counted, and how many lost answers landed."""

    def __init__(self):
        super().__init__(debounce=DEBOUNCE, retry_delay=0.0)
        self.counted: dict[str, int] = {}          # tab -> transitions already counted
        self.retired_transitions: list[tuple[str, str, str]] = []
        self.retired_counters: Counter = Counter()
        self.lost_landed = 0
        self.lost_not_landed = 0
        self.fates: list[str] = []  # what became of each lost request in the last step, in this world

    def _retire(self, tab: str) -> None:
        t = self.tabs.get(tab)
        if t is None:
            return
        self.retired_transitions += t.transitions[self.counted.pop(tab, 0):]
        self.retired_counters.update(t.counters)

    def open_tab(self, tab, user, doc_id, kind, writer_id):
        if tab in self.tabs and self.tabs[tab].state is State.CLOSED:
            self._retire(tab)
        return super().open_tab(tab, user, doc_id, kind, writer_id)

    def crash_tab(self, tab: str) -> None:
        self._retire(tab)
        super().crash_tab(tab)

    def drain(self) -> list[tuple[str, str, str]]:
        """Transitions not counted yet (and marks them counted)."""
        out, self.retired_transitions = self.retired_transitions, []
        for name, t in self.tabs.items():
            out += t.transitions[self.counted.get(name, 0):]
            self.counted[name] = len(t.transitions)
        return out

    def totals(self) -> Counter:
        c = Counter(self.retired_counters)
        for t in self.tabs.values():
            c.update(t.counters)
        c["lost responses"] = self.lost_landed
        c["lost requests"] = self.lost_not_landed
        return c


class ModelTab:
    """A model tab with the session's method names (the model's ledger-keeping methods take the tab)."""

    def __init__(self, m: CheckedModel, tab: str, deliver):
        self.m, self.tab, self.deliver = m, tab, deliver

    @property
    def state(self) -> State:
        return self.m.tabs[self.tab].state

    def edit(self, patch, now=None):
        return self.m.edit(self.tab, patch, now)

    def begin_read(self, purpose="refresh"):
        return self.m.begin_read(self.tab, purpose)

    def finish_read(self, req, answer):
        return self.m.finish_read(self.tab, req, answer)

    def begin_save(self, now=None):
        return self.m.begin_save(self.tab, now)

    def finish_save(self, req, answer):
        return self.m.finish_save(self.tab, req, answer)

    def tick(self, now=None):
        return self.m.tick(self.tab, now, self.deliver)

    def begin_copy(self):
        return self.m.begin_copy(self.tab)

    def finish_copy(self, req, answer):
        return self.m.finish_copy(self.tab, req, answer)

    def rebase(self, resolve):
        return self.m.rebase(self.tab, resolve)

    def discard(self):
        return self.m.discard(self.tab)

    def adopt(self, writer_id):
        return self.m.adopt(self.tab, writer_id)

    def discard_sibling(self, writer_id):
        return self.m.discard_sibling(self.tab, writer_id)

    def close(self):
        return self.m.close(self.tab, self.deliver)


class ModelSide:
    def __init__(self, check: "DocumentSessionCheck", m: CheckedModel, deliver):
        self.check, self.m, self.deliver = check, m, deliver

    def tab(self, slot: str) -> ModelTab:
        return ModelTab(self.m, slot, self.deliver)

    def send(self, slot: str, req):
        return self.deliver(req)

    def open(self, slot: str, user: str, writer: str) -> ModelTab:
        self.m.open_tab(slot, user, DOC, "record", writer)
        self.m.tabs[slot].now = self.check.clock
        return self.tab(slot)

    def crash(self, slot: str) -> None:
        self.m.crash_tab(slot)

    def server_write(self, patch):
        return self.m.server_write(DOC, patch)


class RealSide:
    def __init__(self, check: "DocumentSessionCheck"):
        self.check = check

    def tab(self, slot: str) -> Session:
        return self.check.sessions[slot]

    def send(self, slot: str, req):
        return self.check.wires[slot].send(req)

    def open(self, slot: str, user: str, writer: str) -> Session:
        c = self.check
        s = c.session_class(DOC, user=user, kind="record", drafts=c.drafts, transport=c.wires[slot], writer_id=writer,
                            debounce=DEBOUNCE, retry_delay=0.0, clock=lambda: c.clock)
        c.sessions[slot] = s
        return s

    def crash(self, slot: str) -> None:
        del self.check.sessions[slot]

    def server_write(self, patch):
        return self.check.observer.server_write(DOC, patch)


# ---------------------------------------------------------------------------------------
# The real parts of a run: the server, its links, the tabs' links, the draft directory.
# ---------------------------------------------------------------------------------------


class _Observer(DocumentStore):
    """The reference store on the check's own kept-open, unfaulted connection: seeds each example,
    plays the server-side writer, and reads the rows for the projection."""

    def __init__(self, env, dbname: str):
        self.env, self.dbname = env, dbname
        self.q = store_impl.Q

    def _connect(self):
        return contextlib.nullcontext(self.env.admin(self.dbname))

    def close(self) -> None:
        pass  # the connection is the check's own


class Wire:
    """A tab's transport: real HTTP through the tab's own Toxiproxy link, every exchange recorded."""

    def __init__(self, plant: "Plant", slot: str, http: HttpTransport):
        self.plant, self.slot, self.http = plant, slot, http

    def send(self, request):
        answer = self.http.send(request)
        self.plant.exchanges.append((request, answer))
        self.plant.slots.append(self.slot)
        return answer


class Plant:
    """Started once per run (``Env.stand_in``): the document server, whose database connections go
    through their own link, one link and transport per tab slot, and the draft directory."""

    def __init__(self, env, dbname: str):
        self.env, self.dbname = env, dbname
        self.exchanges: list[tuple[Any, Any]] = []  # (request, answer) in the order they happened
        self.slots: list[str] = []                   # the tab slot that made each exchange

    def start(self) -> "Plant":
        env = self.env
        self.db_link = env.api.link("document-session-server-pg", env.db.host, env.db.port)
        self.server_dsn = psycopg.conninfo.make_conninfo(
            env.db.dsn(self.dbname, host=self.db_link.host, port=self.db_link.port), application_name=SERVER_APP)
        # a connection per request: a fault meets each request the same way on every replay
        self.server = DocumentServer(self.server_dsn, connect_timeout=2, pool_size=None).start()
        self.links = {slot: env.api.link(f"document-session-{slot}", "127.0.0.1", self.server.port) for slot in SLOTS}
        self.http = {slot: HttpTransport(f"http://127.0.0.1:{link.port}", timeout=5)
                     for slot, link in self.links.items()}
        # a client that is not a session (another user's, a buggy one), straight to the server
        self.http[CLIENT] = HttpTransport(self.server.url, timeout=5)
        self.raw = httpx.Client(base_url=self.server.url, timeout=5,
                                limits=httpx.Limits(max_keepalive_connections=0))
        self.wires = {slot: Wire(self, slot, h) for slot, h in self.http.items()}
        # on tmpfs when there is one: the store fsyncs every write, and the check writes many
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.draft_dir = tempfile.mkdtemp(prefix="knownstate-drafts-", dir=shm)
        return self

    def stop(self) -> None:
        for h in [*getattr(self, "http", {}).values(), getattr(self, "raw", None)]:
            with contextlib.suppress(Exception):
                h.close()
        if getattr(self, "server", None) is not None:
            self.server.stop()
        if getattr(self, "draft_dir", None):
            shutil.rmtree(self.draft_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# What the check compares: the world as the invariants read it, plus each tab's inner state.
# ---------------------------------------------------------------------------------------


def tab_inner(t) -> dict:
    """The parts of a session (real or model: the field names are shared) the world view omits."""
    conflict = t.conflict
    return {"siblings": [d["writerId"] for d in t.siblings], "base_content": t.base_content,
            "conflict": None if conflict is None else (conflict.version, conflict.content),
            "unconfirmed": t.unconfirmed, "unconfirmed_copy": t.unconfirmed_copy, "next_seq": t.next_seq,
            "draft_generation": t.draft_generation, "saved_generation": t.saved_generation,
            "due_at": t.due_at, "read_seq": t.read_seq, "applied_read_seq": t.applied_read_seq,
            "pending_deletes": sorted(t.pending_deletes if isinstance(t, TabModel) else t._pending_deletes)}


@dataclass(eq=False)
class Seen:
    world: World
    drafts: dict[str, dict]
    inner: dict[str, dict]

    def __post_init__(self):
        self.key = (canon(dict(self.world.docs)), canon(self.drafts),
                    canon({k: dataclasses.replace(v, transitions=()) for k, v in self.world.tabs.items()}),
                    canon({k: v.transitions for k, v in self.world.tabs.items()}), canon(self.inner))

    def __eq__(self, other) -> bool:
        return isinstance(other, Seen) and self.key == other.key

    __hash__ = None


def describe_difference(model: Seen, real: Seen) -> str:
    lines = []

    def compare(what: str, a: dict, b: dict) -> None:
        for k in sorted(set(a) | set(b)):
            x, y = a.get(k), b.get(k)
            if canon(x) != canon(y):
                lines.append(f"  {what} {k}:\n    model:          {_short(x)}\n    implementation: {_short(y)}")

    compare("document", dict(model.world.docs), dict(real.world.docs))
    compare("draft", model.drafts, real.drafts)
    compare("tab", dict(model.world.tabs), dict(real.world.tabs))
    compare("tab (inside)", model.inner, real.inner)
    return "\n".join(lines) or "  (no difference found in the projection)"


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 400 else text[:397] + "..."


# ---------------------------------------------------------------------------------------
# The check.
# ---------------------------------------------------------------------------------------


class DocumentSessionCheck(KindCheck):
    kind = "document-session"
    contract = None
    schema = store_impl.schema_sql()
    tables = ("documents", "document_acl", "document_history")
    n_workers = 0
    # The mutant catalogue replaces these (never the reference's behaviour).
    session_class: type[Session] = Session
    store_class: type[DocumentStore] = DocumentStore
    reader_class: type[RequestReader] = RequestReader
    drafts_class: type[DraftStore] = DraftStore
    queries: dict[str, str] | None = None
    required_events = (
        "conflict", "rebase", "copy", "sibling draft adopted", "sibling draft discarded", "stale read dropped",
        "idempotent retry answered", "draft-store failure", "draft-store recovery", "lost response",
    )
    EVENTS = {  # counter of the model -> event name
        "conflicts": "conflict", "rebases": "rebase", "copies": "copy", "siblings_adopted": "sibling draft adopted",
        "siblings_discarded": "sibling draft discarded", "stale_reads_dropped": "stale read dropped",
        "idempotent_replays": "idempotent retry answered", "draft_failures": "draft-store failure",
        "draft_recoveries": "draft-store recovery", "lost responses": "lost response",
        "lost requests": "lost request", "drafts_restored": "own draft restored", "discarded": "discard",
        "save_failures": "save failed", "copy_failures": "copy failed",
        "seqs_taken": "save seq taken",
    }

    @classmethod
    def table(cls):
        return TABLE

    # -- hooks ------------------------------------------------------------------------------
    def reset_example(self) -> None:
        plant = self.env.stand_in("document-session", lambda: Plant(self.env, self.dbname))
        self.plant = plant
        store = self.store_class(plant.server_dsn, connect_timeout=2, pool_size=None,
                                 queries=self.queries)
        plant.server.use(store=store, reader=self.reader_class())
        self.observer = _Observer(self.env, self.dbname)
        self.observer.seed(DOC, "record", SCHEMA, INITIAL, "alice", {"bob": True})
        self.links = plant.links
        self.wires = plant.wires
        shutil.rmtree(plant.draft_dir, ignore_errors=True)
        self.drafts = self.drafts_class(plant.draft_dir)
        self.sessions: dict[str, Session] = {}
        self.writer_n = {slot: 0 for slot in SLOTS}
        self.clock = 0.0
        self.edits = 0
        self.sent: list[SaveRequest] = []
        self.answered: list[tuple[Any, Any]] = []
        self.divergence: str | None = None
        self.seen_totals: Counter = Counter()
        self.drafts_failing = False
        self.fault_age = 0
        self.hostile_n = 0
        plant.exchanges.clear()

    def new_model(self) -> CheckedModel:
        m = CheckedModel()
        m.seed(DOC, "record", SCHEMA, INITIAL, "alice", {"bob": True})
        return m

    def observe_model(self, m: CheckedModel) -> Seen:
        w = m.world()
        return Seen(w, {k: r for k, r in m.drafts.slots.items()}, {k: tab_inner(t) for k, t in m.tabs.items()})

    def observe_impl(self) -> Seen:
        if self.plant.db_link.toxics or not self.plant.db_link.enabled:
            # a statement the server sent before its connection was cut may still be running
            self.env.settle(self.dbname, SERVER_APP)
        docs = self.observer.documents()
        drafts = {k: self.drafts.read(k) for k in self.drafts.keys()}
        drafts = {k: r for k, r in drafts.items() if r is not None}
        views = {k: DraftView.from_record(k, r) for k, r in drafts.items()}
        world = World(docs, views, {slot: s.view(slot) for slot, s in self.sessions.items()})
        return Seen(world, drafts, {slot: tab_inner(s) for slot, s in self.sessions.items()})

    def clock_matters(self) -> bool:
        return False  # session time is a number the check passes; the database clock plays no role

    # -- generic fault rules act on the tabs' links and the server's database link -------------
    def _all_links(self):
        return [*self.links.values(), self.plant.db_link]

    def faulted_links(self):
        return [l for l in self._all_links() if l.toxics or not l.enabled]

    def _link(self, w: int):
        links = self._all_links()
        return links[w % len(links)]

    def _age_faults(self) -> None:
        if not self.faulted_links():
            self.fault_age = 0
            return
        self.fault_age += 1
        if self.fault_age >= FAULT_STEPS:
            for link in self.faulted_links():
                self._toxi(link.clear)
                self.log(f"heal {link.name} (after {FAULT_STEPS} operations)")
            self.fault_age = 0

    # The base's link faults, with one more condition: a few operations of calm between two faults.
    @precondition(lambda self: self._may_fault_link() and self.calm())
    @rule(w=st.integers(0, 7), toxic=toxics())
    def fault_toxic(self, w: int, toxic: Toxic) -> None:
        KindCheck.fault_toxic(self, w, toxic)

    @precondition(lambda self: self._may_fault_link() and self.calm())
    @rule(w=st.integers(0, 7))
    def fault_link_down(self, w: int) -> None:
        KindCheck.fault_link_down(self, w)

    def fault(self, kind: str, line: str) -> None:
        self.last_fault_step = self.stats.steps
        super().fault(kind, line)

    def calm(self) -> bool:
        return self.stats.steps - getattr(self, "last_fault_step", -99) >= 2

    @precondition(lambda self: self.env.can_crash and not self.crashed and self._slots(State.OFFLINE))
    @rule()
    def fault_db_crash(self) -> None:
        """A database crash and restart while a tab waits to retry a save: the receipt that answers
        the retry must have survived. (The base's rule, drawn only when it can matter.)"""
        KindCheck.fault_db_crash(self)

    # -- the step ------------------------------------------------------------------------------
    def _run(self, label: str, script: Callable[[Any], Any], net: tuple[str, str] | None = None) -> Any:
        """Run ``script`` on the real parts, then on every possible model world; keep the worlds
        that agree with what the implementation did (answers, requests, outcome)."""
        self.stats.steps += 1
        plant = self.plant
        plant.exchanges.clear()
        plant.slots.clear()
        with self._net(*net) if net else contextlib.nullcontext("") as tag:
            real = outcome(lambda: script(RealSide(self)))
        exchanges = list(plant.exchanges)
        self.sent += [r for r, _ in exchanges if isinstance(r, SaveRequest)]
        self.answered += [(slot, r, a) for slot, (r, a) in zip(plant.slots, exchanges)]
        plant.exchanges.clear()
        plant.slots.clear()
        wire = "; ".join(f"{show_request(r)} -> {show(a)}" for r, a in exchanges)
        self.log(f"{label}{tag}{': ' + wire if wire else ''} => {show(real)}")
        self._age_faults()
        unknown = [i for i, (r, a) in enumerate(exchanges)
                   if isinstance(a, NoAnswer) and not isinstance(r, ReadRequest)]  # may have landed
        kept, problems = [], []
        for base in self.candidates:
            for fates in itertools.product((False, True), repeat=len(unknown)):
                m = copy.deepcopy(base)
                m.fates = []
                try:
                    got = self._replay(m, script, exchanges, dict(zip(unknown, fates)))
                except Redundant:
                    continue
                except Diverged as e:
                    problems.append(f"{label}: {e}")
                    continue
                if canon(got) != canon(real):
                    problems.append(f"{label}: the implementation's outcome is {show(real)} ({_short(real)}), "
                                    f"the model's is {show(got)} ({_short(got)})")
                    continue
                kept.append(m)
        if kept:
            self.candidates = kept
            return real
        # The model cannot follow. Keep the world in which the model's tabs got the answers the real
        # ones got (requests never sent reach nothing), so the invariants can judge the real world.
        self.divergence = problems[0]
        follow = copy.deepcopy(self.candidates[0])
        with contextlib.suppress(Exception):
            self._replay(follow, script, exchanges, {}, follow=True)
        self.candidates = [follow]
        return real

    def _replay(self, m: CheckedModel, script, exchanges, landed: dict[int, bool], follow: bool = False):
        pos = 0

        def deliver(req):
            nonlocal pos
            i, pos = pos, pos + 1
            if i >= len(exchanges):
                if follow:
                    return NoAnswer("never sent")
                raise Diverged(f"the model sends {show_request(req)}, which the implementation never sent")
            rreq, rans = exchanges[i]
            if canon(req) != canon(rreq):
                if follow:
                    return NoAnswer("diverged")
                raise Diverged(f"the implementation sent {show_request(rreq)} ({_short(rreq)}), "
                               f"the model sends {show_request(req)} ({_short(req)})")
            if isinstance(rans, NoAnswer):
                if follow or isinstance(req, ReadRequest):
                    return rans
                if landed.get(i):
                    exp = m.deliver(req)
                    if not isinstance(exp, Won) or getattr(exp.value, "replayed", False):
                        raise Redundant()
                    m.lost_landed += 1
                else:
                    m.lost_not_landed += 1
                m.fates.append(f"{show_request(req)} {'landed' if landed.get(i) else 'left nothing stored'}")
                return rans
            exp = m.deliver(req)
            if not follow and canon(exp) != canon(rans):
                raise Diverged(f"{show_request(req)}: the server answered {show(rans)} ({_short(rans)}), "
                               f"the model's server answers {show(exp)} ({_short(exp)})")
            return rans

        got = outcome(lambda: script(ModelSide(self, m, deliver)))
        if pos < len(exchanges) and not follow:
            raise Diverged(f"the implementation sent {show_request(exchanges[pos][0])}, which the model never sends")
        return got

    @contextlib.contextmanager
    def _net(self, slot: str, net: str):
        """A per-step network fate on one tab's link: offline (the link is down) or the answer lost
        (the server gets the request and answers; the answer never arrives)."""
        link = self.links[slot]
        if net == "ok" or link.toxics or not link.enabled:
            yield ""
            return
        if net == "offline":
            self._toxi(link.down)
            undo = link.up
        else:
            toxic = Toxic("limit_data", "downstream", {"bytes": 0})
            self._toxi(lambda: link.add(toxic))
            undo = lambda: link.remove(toxic)  # noqa: E731
        self.stats.faults[net] += 1
        try:
            yield f" [{net}]"
        finally:
            self._toxi(undo)

    # -- observation: narrow, count, judge ---------------------------------------------------------
    @invariant()
    def model_agrees(self) -> None:
        """The real world equals one possible model world, and the invariants hold on the real world.
        (Overrides the base: the invariants are judged before a disagreement is reported, so a
        failure names the invariant it broke.)"""
        if not hasattr(self, "candidates"):
            return
        real = self.observe_impl()
        matching = [m for m in self.candidates if self.observe_model(m) == real]
        if self.divergence is not None or not matching:
            m = self.candidates[0]
            why = self.divergence or ("the implementation disagrees with the model after this step:\n"
                                      + describe_difference(self.observe_model(m), real)
                                      + ("" if len(self.candidates) == 1 else
                                         f"\n  (none of the {len(self.candidates)} possible worlds matched)"))
            violations = self._violations(real, m)
            if violations:
                self._fail("invariant violated: " + "; ".join(map(str, violations))
                           + "\n(" + why + ")")
            self._fail(why)
        chosen = matching[0]
        if len(self.candidates) > 1 and all(x.fates == chosen.fates for x in matching):
            self.log(f"  (observed: {'; '.join(chosen.fates)})")
        self.candidates = [chosen]
        self.model = chosen
        for t in chosen.drain():
            self.stats.transitions[t] += 1
        totals = chosen.totals()
        for counter, event in self.EVENTS.items():
            self.event(event, totals[counter] - self.seen_totals[counter])
        self.seen_totals = totals
        violations = self._violations(real, chosen)
        if violations:
            self._fail("invariant violated: " + "; ".join(map(str, violations)))

    def _fail(self, message: str) -> None:
        """The one door every failure of this check goes through."""
        raise _record_mismatch(self, message)

    def _violations(self, real: Seen, m: CheckedModel) -> list[Violation]:
        out = check_invariants(real.world, m.ledger(), expected=m.world(), sent=self.sent)
        out += self._receipt_answers()
        out += self._read_went_back(real)
        self.sent, self.answered = [], []
        self.stats.invariants_checked += len(SESSION_INVARIANTS) + len(CHECK_INVARIANTS)
        return out

    def _read_went_back(self, real: Seen) -> list[Violation]:
        """A tab that applied a read in this step (and adopted nothing) ends it with a base no older
        than it had before, and no older than any copy of the document it was sent in the step."""
        out, before = [], getattr(self, "bases", {})
        self.bases = {slot: (t.writer_id, len(t.transitions), t.base_version) for slot, t in real.world.tabs.items()}
        for slot, t in real.world.tabs.items():
            prev = before.get(slot)
            if prev is None or prev[0] != t.writer_id or len(t.transitions) < prev[1]:
                continue
            events = {e for _, e, _ in t.transitions[prev[1]:]}
            if not events & {"reloaded", "discard_reloaded"} or "adopt" in events:
                continue
            seen = [a.value.version for s, r, a in self.answered
                    if s == slot and isinstance(r, ReadRequest) and r.purpose != "load"
                    and isinstance(a, Won) and isinstance(a.value, Snapshot)]
            newest = max([prev[2], *seen])
            if t.base_version < newest:
                out.append(Violation("no-stale-read-applied", f"tab {slot} applied a read of v{t.base_version} "
                                                              f"after it had v{newest}"))
        return out

    def _receipt_answers(self) -> list[Violation]:
        """The HTTP contract's receipts, judged on each save answered in this step against the
        history rows after it: a save identity (user, writerId, saveSeq) that saved is answered
        from its own receipt — the same request with that success, other content with
        save_seq_taken naming it — and no other user's receipt ever answers it."""
        out = []
        for _, req, answer in self.answered:
            if not isinstance(req, SaveRequest) or isinstance(answer, NoAnswer):
                continue
            rows = self.env.query(self.dbname, RECEIPT_SQL,
                                  (req.doc_id, req.user, req.writer_id, req.seq))
            save = f"{req.user}'s save {req.writer_id}#{req.seq}"
            won = isinstance(answer, Won) and isinstance(answer.value, Saved)
            saved = answer.value if won else None
            if rows and rows[0][0] == save_fingerprint(req.user, req.base_version, req.content):
                if saved is None or saved.version != rows[0][1]:
                    out.append(Violation("retry-answered-from-receipt",
                                         f"{save} landed as v{rows[0][1]}, and was answered "
                                         f"{show(answer)}"))
            elif rows:
                if not (isinstance(answer, SeqTaken) and answer.version == rows[0][1]):
                    out.append(Violation("retry-answered-from-receipt",
                                         f"{save} reuses an identity that saved v{rows[0][1]} "
                                         f"with other content, and was answered {show(answer)}"))
            elif isinstance(answer, SeqTaken) or (saved is not None and saved.replayed):
                out.append(Violation("receipt-is-the-users-own",
                                     f"{save} never saved, and was answered from a receipt: "
                                     f"{show(answer)}"))
        return out

    # -- helpers ---------------------------------------------------------------------------------------
    def _state(self, slot: str) -> State | None:
        s = self.sessions.get(slot)
        return None if s is None else s.state

    def _slots(self, *states: State) -> list[str]:
        return [slot for slot in SLOTS if self._state(slot) in states]

    def _free_slots(self) -> list[str]:
        return [slot for slot in SLOTS if self._state(slot) in (None, State.CLOSED)]

    def _patch(self, slot: str, attr: str) -> dict:
        """A new value nobody else writes (the count of edits so far makes it unique)."""
        self.edits += 1
        k = self.edits
        if attr == "clear":
            return {"qty": None}
        return {attr: {"title": f"{slot}.{k}", "qty": k, "done": k % 2 == 1}[attr]}

    def _pick(self, data, slots: list[str]) -> str:
        return data.draw(st.sampled_from(slots), label="tab")

    # -- opening and loading ---------------------------------------------------------------------------
    def _open(self, slot: str, fresh: bool, net: str = "ok") -> None:
        fresh = fresh or self.writer_n[slot] == 0
        if fresh:
            self.writer_n[slot] += 1
        writer = f"{slot}-{self.writer_n[slot]}"
        user = SLOTS[slot]

        def script(side):
            t = side.open(slot, user, writer)
            req = t.begin_read("load")
            return t.finish_read(req, side.send(slot, req))

        self._run(f"open {slot} ({user}, writer {writer}{'' if fresh else ', again'})", script, (slot, net))

    @precondition(lambda self: self._free_slots())
    @rule(data=st.data(), fresh=st.booleans(), net=st.sampled_from(NETS))
    def open(self, data, fresh: bool, net: str) -> None:
        """A tab (re)opens: the same writer again (its draft is restored) or a fresh one (the drafts
        of the user's other writers are offered as siblings)."""
        self._open(self._pick(data, self._free_slots()), fresh, net)

    @precondition(lambda self: self._slots(State.LOADING))
    @rule(data=st.data(), give_up=st.sampled_from([False, False, True]), net=st.sampled_from(NETS))
    def load(self, data, give_up: bool, net: str) -> None:
        """A tab whose first read failed tries again, or the user closes it while it is still loading."""
        slot = self._pick(data, self._slots(State.LOADING))
        if give_up:
            self._run(f"close {slot} while it is still loading", lambda side: side.tab(slot).close())
            return

        def script(side):
            t = side.tab(slot)
            req = t.begin_read("load")
            return t.finish_read(req, side.send(slot, req))

        self._run(f"load {slot}", script, (slot, net))

    # -- editing and saving ------------------------------------------------------------------------------
    EDITABLE = (State.CLEAN, State.DIRTY, State.OFFLINE, State.CONFLICT)
    PENDING = (State.DIRTY, State.OFFLINE)

    @precondition(lambda self: self._slots(*self.EDITABLE))
    @rule(data=st.data(), attr=st.sampled_from(["title", "qty", "done", "clear"]),
          then=st.sampled_from(["", "", "tick"]), net=st.sampled_from(NETS_WRITE))
    def edit(self, data, attr: str, then: str, net: str) -> None:
        """The user types (and, with ``then=tick``, waits: the debounce fires and the tab saves)."""
        slot = self._pick(data, self._slots(*self.EDITABLE))
        patch = self._patch(slot, attr)
        now = self.clock
        if then:
            self.clock += DEBOUNCE
        later = self.clock

        def script(side):
            t = side.tab(slot)
            out = t.edit(patch, now)
            return t.tick(later) if then else out

        self._run(f"edit {slot} {_fmt_patch(patch)}{', then wait ' + str(DEBOUNCE) + 's' if then else ''}", script,
                  (slot, net) if then else None)

    @precondition(lambda self: self._slots(*self.PENDING))
    @rule(data=st.data(), advance=st.sampled_from([1.0, 1.0, 0.5]), net=st.sampled_from(NETS_WRITE))
    def tick(self, data, advance: float, net: str) -> None:
        """Time passes; the tab saves when its debounce is due (or at once, to retry a failed save)."""
        slot = self._pick(data, self._slots(*self.PENDING))
        self.clock += advance
        now = self.clock
        self._run(f"tick {slot} +{advance}s", lambda side: side.tab(slot).tick(now), (slot, net))

    @precondition(lambda self: self._slots(*self.PENDING))
    @rule(data=st.data(), attr=st.sampled_from(["title", "qty", "done"]), net=st.sampled_from(NETS_WRITE))
    def edit_during_save(self, data, attr: str, net: str) -> None:
        """The user types while a save is in flight: the edit stays pending, whatever the answer."""
        slot = self._pick(data, self._slots(*self.PENDING))
        patch = self._patch(slot, attr)
        now = self.clock

        def script(side):
            t = side.tab(slot)
            req = t.begin_save(now)
            t.edit(patch, now)
            return t.finish_save(req, side.send(slot, req))

        self._run(f"save {slot}, and edit {_fmt_patch(patch)} while it is in flight", script, (slot, net))

    @precondition(lambda self: self._slots(*self.PENDING))
    @rule(data=st.data(), reload=st.booleans(), net=st.sampled_from(NETS))
    def discard(self, data, reload: bool, net: str) -> None:
        """The user throws the local edits away: ``discard()``, or ``discard_and_reload()``, which
        fetches first and replaces the local state only once the fetch succeeded."""
        slot = self._pick(data, self._slots(*self.PENDING))
        self._discard(slot, reload, net)

    def _discard(self, slot: str, reload: bool, net: str) -> None:
        if not reload:
            self._run(f"discard {slot}", lambda side: side.tab(slot).discard())
            return

        def script(side):
            t = side.tab(slot)
            req = t.begin_read("replace")
            return t.finish_read(req, side.send(slot, req))

        self._run(f"discard and reload {slot}", script, (slot, net))

    # -- reads ---------------------------------------------------------------------------------------------
    @precondition(lambda self: self._slots(*self.EDITABLE))
    @rule(data=st.data(), race=st.sampled_from(["none", "newer read first", "local edit", "save"]),
          replace=st.booleans())
    def read(self, data, race: str, replace: bool) -> None:
        """A read (reload when clean, discard-and-reload otherwise), possibly answered late: after a
        newer read was applied, after a local edit, or after a save moved the base. The guard drops
        a late answer."""
        if race in ("none", "newer read first") and not self._slots(State.CLEAN):
            race = "local edit"
        if race == "save" and not self._slots(*self.PENDING):
            race = "local edit"
        slots = {"none": self._slots(State.CLEAN), "newer read first": self._slots(State.CLEAN),
                 "save": self._slots(*self.PENDING)}.get(race, self._slots(*self.EDITABLE))
        slot = self._pick(data, slots)
        purpose = "refresh" if self._state(slot) is State.CLEAN and not (replace and race == "none") else "replace"
        patch = self._patch(slot, "title") if race == "local edit" else None
        server_patch = {"done": self.edits % 2 == 1}
        now = self.clock

        def script(side):
            t = side.tab(slot)
            late = t.begin_read(purpose)
            late_answer = side.send(slot, late)
            if race == "newer read first":
                side.server_write(server_patch)
                newer = t.begin_read("refresh")
                t.finish_read(newer, side.send(slot, newer))
            elif race == "local edit":
                t.edit(patch, now)
            elif race == "save":
                req = t.begin_save(now)
                t.finish_save(req, side.send(slot, req))
            return t.finish_read(late, late_answer)

        what = {"none": "", "newer read first": ", answered after a server-side write and a newer read",
                "local edit": f", answered after an edit {_fmt_patch(patch or {})}", "save": ", answered after a save"}
        self._run(f"{'reload' if purpose == 'refresh' else 'discard and reload'} {slot}{what[race]}", script)

    # -- conflicts -------------------------------------------------------------------------------------------
    @precondition(lambda self: self._slots(State.CONFLICT))
    @rule(data=st.data(), how=st.sampled_from(["discard", "rebase, a clash keeps the local value",
                                               "rebase, a clash keeps the stored value", "discard and reload",
                                               "rebase, a clash keeps the local value"]),
          net=st.sampled_from(NETS))
    def resolve(self, data, how: str, net: str) -> None:
        """The user resolves the conflict: rebase (records merge by attribute id), discard (take the
        stored copy), or discard and reload."""
        slot = self._pick(data, self._slots(State.CONFLICT))
        if how.startswith("discard"):
            self._discard(slot, how.endswith("reload"), net)
        else:
            resolve = prefer_local if how.endswith("local value") else prefer_stored
            self._run(f"resolve {slot}: {how}", lambda side: side.tab(slot).rebase(resolve))

    @precondition(lambda self: self._slots(State.CONFLICT))
    @rule(data=st.data(), net=st.sampled_from(NETS_COPY))
    def keep_copy(self, data, net: str) -> None:
        """The user resolves the conflict by keeping the local copy as a new document (every kind
        can); this document takes the stored copy."""
        slot = self._pick(data, self._slots(State.CONFLICT))

        def script(side):
            t = side.tab(slot)
            req = t.begin_copy()
            return t.finish_copy(req, side.send(slot, req))

        self._run(f"resolve {slot}: keep the local copy as a new document", script, (slot, net))

    # -- sibling drafts ------------------------------------------------------------------------------------------
    def _with_siblings(self) -> list[str]:
        return [slot for slot, s in self.sessions.items() if s.siblings and s.state is not State.CLOSED]

    @precondition(lambda self: self._with_siblings())
    @rule(data=st.data(), adopt=st.sampled_from([True, True, False]))
    def sibling(self, data, adopt: bool) -> None:
        """A draft another writer of the same user left is offered on load: adopt it (only a clean
        tab can) or discard it. Never applied silently."""
        clean = [slot for slot in self._with_siblings() if self._state(slot) is State.CLEAN]
        adopt = adopt and bool(clean)
        slot = self._pick(data, clean if adopt else self._with_siblings())
        s = self.sessions[slot]
        writer = data.draw(st.sampled_from([d["writerId"] for d in s.siblings]), label="sibling")
        if adopt:
            self._run(f"{slot} adopts the draft of writer {writer}", lambda side: side.tab(slot).adopt(writer))
        else:
            self._run(f"{slot} discards the draft of writer {writer}",
                      lambda side: side.tab(slot).discard_sibling(writer))

    # -- closing and dying -----------------------------------------------------------------------------------------
    CLOSABLE = (State.LOADING, State.CLEAN, State.DIRTY, State.OFFLINE, State.CONFLICT)

    @precondition(lambda self: self._slots(*self.CLOSABLE))
    @rule(data=st.data(), how=st.sampled_from(["close", "close", "close", "killed",
                                               "killed mid-save, before the request",
                                               "killed mid-save, after the request"]),
          net=st.sampled_from(NETS_WRITE))
    def close(self, data, how: str, net: str) -> None:
        """The tab is closed (it flushes; work the server did not take is parked in the writer's
        draft), or it dies — possibly mid-save: its memory is gone, the draft store stays."""
        slot = self._pick(data, self._slots(*self.CLOSABLE))
        if how == "close":
            self._run(f"close {slot}", lambda side: side.tab(slot).close(), (slot, net))
            return
        if self._state(slot) not in self.PENDING:
            how = "killed"
        now = self.clock

        def script(side):
            if how != "killed":
                t = side.tab(slot)
                req = t.begin_save(now)
                if how.endswith("after the request"):
                    side.send(slot, req)
            side.crash(slot)
            return None

        self._run(f"tab {slot} {how}", script, (slot, net) if how.endswith("after the request") else None)

    # Drawn twice as often as the other rules (Hypothesis draws a rule uniformly among the enabled
    # ones; a rule listed under two names counts twice): they keep work flowing towards saves,
    # conflicts and their resolutions, which the vacuity rule requires.
    edit_more = edit
    tick_more = tick
    resolve_more = resolve
    keep_copy_more = keep_copy

    # -- clients that are not sessions (see document_requests) ------------------------------
    def _server_calm(self) -> bool:
        link = self.plant.db_link
        return not link.toxics and link.enabled

    def _version(self) -> int:
        return self.candidates[0].server.docs[DOC].version

    @precondition(lambda self: self._server_calm())
    @rule(case=st.sampled_from(HOSTILE))
    def hostile_request(self, case: Hostile) -> None:
        """A client that is not a session sends a request the contract refuses (a lenient server
        would apply it: it carries the current base and a fresh save identity)."""
        self.stats.steps += 1
        self.hostile_n += 1
        writer = f"hostile-{self.hostile_n}"
        method, path, headers, body = case.request(DOC, self._version(), writer)
        before = self.observer.documents()
        response = self.plant.raw.request(method, path, headers=headers, content=body)
        after = self.observer.documents()
        try:
            error = response.json().get("error")
        except (ValueError, AttributeError):
            error = None
        self.log(f"a client sends {case.name} -> {response.status_code} {error}")
        violations = judge(case, response, before, after)
        self.stats.invariants_checked += len(REQUEST_INVARIANTS)
        if violations:
            self._fail("invariant violated: " + "; ".join(map(str, violations)))
        self.event("hostile request refused")

    def _unanswered(self) -> list[tuple[str, SaveRequest]]:
        return [(slot, s.unconfirmed) for slot, s in self.sessions.items()
                if SLOTS[slot] == "alice" and s.state is State.OFFLINE
                and s.unconfirmed is not None]

    @precondition(lambda self: self._server_calm() and self._unanswered())
    @rule(data=st.data())
    def impostor_save(self, data) -> None:
        """Another user's client saves under the writer id and seq of an alice tab's unanswered
        save: it is his own save, and must leave hers (and its receipt) alone."""
        slot, mine = data.draw(st.sampled_from(self._unanswered()), label="unanswered save")
        self.edits += 1
        bob = SaveRequest(DOC, "bob", mine.writer_id, mine.seq, self._version(),
                          {"title": f"bob.{self.edits}"}, 0)
        self._run(f"bob's client saves as writer {mine.writer_id}#{mine.seq} (the id of {slot}'s "
                  "unanswered save)", lambda side: side.send(CLIENT, bob))

    @precondition(lambda self: self._server_calm())
    @rule()
    def reused_save_seq(self) -> None:
        """A client saves, then sends other content under the same (writerId, saveSeq): a save
        identity names one save, so the second is refused, naming the first's receipt."""
        self.hostile_n += 1
        writer, base = f"reuser-{self.hostile_n}", self._version()
        first = SaveRequest(DOC, "alice", writer, 1, base, {"title": f"{writer}.a"}, 0)
        again = SaveRequest(DOC, "alice", writer, 1, base + 1, {"title": f"{writer}.b"}, 0)

        def script(side):
            side.send(CLIENT, first)
            return side.send(CLIENT, again)

        self._run(f"a client saves as {writer}#1, then sends other content as {writer}#1", script)

    # -- the rest of the world ----------------------------------------------------------------------------------
    @precondition(lambda self: self._slots(State.DIRTY, State.OFFLINE, State.CONFLICT))
    @rule(attr=st.sampled_from(["title", "qty", "done"]))
    def server_write(self, attr: str) -> None:
        """The server-side writer (the seed's "AI write") changes the document while a tab has
        unsaved work (the tab's next save is then based on a stale version)."""
        self.edits += 1
        k = self.edits
        patch = {attr: {"title": f"ai.{k}", "qty": 1000 + k, "done": k % 2 == 0}[attr]}
        self._run(f"server-side write {_fmt_patch(patch)}", lambda side: side.server_write(patch))

    @precondition(lambda self: self.drafts_failing or (self.calm() and self._slots(*self.EDITABLE)))
    @rule()
    def fault_drafts(self) -> None:
        """The draft store starts refusing writes and deletes (quota, full disk, private mode), or
        works again."""
        self.drafts_failing = self.drafts.fail_writes = not self.drafts_failing
        for m in self.candidates:
            m.set_drafts_failing(self.drafts_failing)
        if self.drafts_failing:
            self.fault("draft-store", "the draft store starts failing")
        else:
            self.log("the draft store works again")


def _fmt_patch(patch: dict) -> str:
    return ", ".join(f"{k}={'(cleared)' if v is None else repr(v)}" for k, v in patch.items())


# ---------------------------------------------------------------------------------------
# Mutants: realistic bugs, each caught by this check (see `knownstate mutants document-session`).
# Each is applied by subclassing the check with a replaced session, draft store or SQL; the
# reference implementation is never changed.
# ---------------------------------------------------------------------------------------

from ..mutants import Mutant, sql_edit, with_attrs  # noqa: E402

_Q = store_impl.Q


class _SuccessWipesPendingEdit(Session):
    """The save's answer handler takes the saved snapshot as the local copy: an edit typed while
    the save was in flight is wiped (the autosave bug of the seed)."""

    def finish_save(self, req, answer):
        if isinstance(answer, Won) and req == self.inflight:
            self.local = dict(req.content)
        return super().finish_save(req, answer)


class _DraftSlotWithoutWriter(DraftStore):
    """The draft key leaves out the writer id: every tab of a user shares one slot per document."""

    def key(self, kind, user, file_id, writer_id):
        return f"knownstate:{kind}-draft:{user}:{file_id}"


class _ReadGuard(Session):
    """The reference's stale-read guard with some of its checks left out (see the subclasses)."""

    check_order = True       # the read sequence, and "the base moved since the read started"
    check_generation = True  # "a local edit happened since the read started" (for a discard-and-reload)

    def finish_read(self, req, answer):
        if req.purpose == "load" or not (isinstance(answer, Won) and isinstance(answer.value, Snapshot)):
            return super().finish_read(req, answer)
        snap, reason = answer.value, None
        event = "reloaded" if req.purpose == "refresh" else "discard_reloaded"
        if self.check_order and req.read_seq <= self.applied_read_seq:
            reason = "out_of_order"
        elif req.generation != self.generation and (self.check_generation or req.purpose == "refresh"):
            reason = "raced_local_edit"
        elif self.inflight is not None or (self.check_order and req.base_version != self.base_version):
            reason = "raced_save"
        elif self.check_order and snap.version < self.base_version:
            reason = "older_than_base"
        elif (self.state.value, event) not in {(t.source, t.event) for t in TABLE.transitions}:
            reason = f"state_changed_to_{self.state.value}"
        if reason is not None:
            self._count("stale_reads_dropped")
            return Dropped(reason)
        self.applied_read_seq = max(self.applied_read_seq, req.read_seq)
        self.local, self.base_content, self.base_version = dict(snap.content), dict(snap.content), snap.version
        if req.purpose == "replace":
            self.unconfirmed = self.conflict = self.due_at = None
            self._delete_draft()
            self._count("discarded")
        self._go(event)
        return Won(self.state.value)


class _ReadGuardWithoutOrder(_ReadGuard):
    """The guard checks only the edit generation: a read answered late, after a newer one, is applied."""

    check_order = False


class _ReadGuardWithoutGeneration(_ReadGuard):
    """A discard-and-reload skips the generation check ("the user discards anyway"): its answer,
    arriving after the user typed again, wipes the new edit."""

    check_generation = False


class _ReloadClearsFirst(Session):
    """discard_and_reload() clears the local copy and its draft first, then fetches."""

    def begin_read(self, purpose="refresh"):
        req = super().begin_read(purpose)
        if purpose == "replace":
            self.local, self.unconfirmed = dict(self.base_content), None
            self._delete_draft()
        return req


class _AutoRebase(Session):
    """A conflict is resolved on the spot by merging, local values winning: no user involved."""

    def finish_save(self, req, answer):
        out = super().finish_save(req, answer)
        if isinstance(answer, VersionConflict) and self.k.can_merge:
            self.rebase(prefer_local)
        return out


class _CloseDropsPending(Session):
    """close() cancels the debounce timer: an edit not sent yet is dropped instead of flushed."""

    def close(self, max_failures: int = 2):
        if self.state is State.DIRTY:
            self.local, self.due_at = dict(self.base_content), None
            self._delete_draft()
            self._go("discard")
        return super().close(max_failures)


def _match_with_dollar(pattern, text):
    return pattern.match(text)  # "$" also matches before a trailing newline


class _DollarRecord(RecordKind):
    matches = staticmethod(_match_with_dollar)


class _DollarSheet(SheetKind):
    matches = staticmethod(_match_with_dollar)


class _DollarIdStore(DocumentStore):
    kinds = {"record": _DollarRecord(), "sheet": _DollarSheet()}


_RECEIPT_KEY = "AND h.writer_id = %(writer)s AND h.save_seq = %(seq)s\n) r"
_SEQ_GUARD = """
      AND NOT EXISTS (SELECT 1 FROM document_history h
                      WHERE h.document_id = d.id AND h.author = %(user)s
                        AND h.writer_id = %(writer)s AND h.save_seq = %(seq)s)"""
_UNIQUE_SAVE = """create unique index if not exists document_history_save
    on document_history (document_id, author, writer_id, save_seq) where writer_id is not null;"""


class _LastKeyWins(RequestReader):
    def object_from_pairs(self, pairs):
        return dict(pairs)


class _SniffedEncoding(RequestReader):
    def decode(self, raw):
        return raw.decode(json.detect_encoding(raw))


class _NumericETag(RequestReader):
    def tag_version(self, opaque, *, weak):
        return int(opaque) if opaque.isdigit() and int(opaque) > 0 else None


class _FirstHeaderWins(RequestReader):
    def header(self, headers, name):
        values = headers.getlist(name)
        return values[0] if values else None


class _AnyContentType(RequestReader):
    def content_type(self, headers):
        return None


class _NotJson422(RequestReader):
    def not_json(self, what):
        return BadRequest(422, "invalid_request", f"0: JSON decode error ({what})")


class _RedirectSlashes(RequestReader):
    redirect_slashes = True


MUTANTS = [
    Mutant("server-ignores-base-version", "document-session", "no-stale-save-accepted",
           "the save's UPDATE does not match the base version: a stale save overwrites",
           with_attrs(queries=sql_edit(_Q, "save", "AND d.version = %(expected)s\n      AND EXISTS", "AND EXISTS"))),
    Mutant("success-wipes-pending-edit", "document-session", "no-edit-lost-silently",
           "a successful save's answer replaces the local copy: an edit typed during the save is gone",
           with_attrs(session_class=_SuccessWipesPendingEdit)),
    Mutant("draft-key-without-writer", "document-session", "unsaved-work-in-one-place",
           "the draft slot is keyed by user and document only: tabs overwrite each other's drafts",
           with_attrs(drafts_class=_DraftSlotWithoutWriter)),
    Mutant("stale-read-applied", "document-session", "no-stale-read-applied",
           "the read guard has no read sequence: a read answered after a newer one is applied",
           with_attrs(session_class=_ReadGuardWithoutOrder)),
    Mutant("read-that-raced-an-edit-applied", "document-session", "no-edit-lost-silently",
           "a discard-and-reload ignores the edit generation: its late answer wipes an edit typed meanwhile",
           with_attrs(session_class=_ReadGuardWithoutGeneration)),
    Mutant("reload-clears-before-fetch", "document-session", "no-edit-lost-silently",
           "discard_and_reload() drops the local copy and draft before the fetch succeeded",
           with_attrs(session_class=_ReloadClearsFirst)),
    Mutant("automatic-rebase-on-conflict", "document-session", "no-last-write-wins",
           "a version conflict is merged and resaved at once, local values winning",
           with_attrs(session_class=_AutoRebase)),
    Mutant("close-drops-pending-edit", "document-session", "close-flushes-never-drops",
           "close() cancels the pending debounced save instead of flushing it",
           with_attrs(session_class=_CloseDropsPending)),
    Mutant("retry-conflicts-with-itself", "document-session", "retry-answered-from-receipt",
           "the server keeps no save receipts: a retry whose first answer was lost gets a 409",
           with_attrs(queries=sql_edit(_Q, "missed", _RECEIPT_KEY, "AND false\n) r"))),
    # The server findings of issue 10: each a bug the hardened server had, put back.
    Mutant("ids-matched-with-dollar", "document-session", "refused-request-changes-nothing",
           "attribute and cell ids are checked with re.match: 'A1\\n' passes as A1",
           with_attrs(store_class=_DollarIdStore)),
    Mutant("receipt-lookup-ignores-user", "document-session", "receipt-is-the-users-own",
           "the receipt of (writerId, saveSeq) is looked up without the user: another user's save "
           "under the same writer id answers",
           with_attrs(queries=sql_edit(_Q, "missed",
                                       "AND h.author = %(user)s\n      " + _RECEIPT_KEY,
                                       _RECEIPT_KEY.replace(") r", "    ORDER BY h.version DESC "
                                                                   "LIMIT 1\n) r")))),
    Mutant("reused-save-seq-applied", "document-session", "one-version-per-save",
           "a reused (writerId, saveSeq) with other content is applied as a new write",
           with_attrs(queries=sql_edit(_Q, "save", _SEQ_GUARD, ""),
                      schema=store_impl.schema_sql().replace(_UNIQUE_SAVE, ""))),
    Mutant("json-last-key-wins", "document-session", "refused-request-changes-nothing",
           "a key twice in a JSON object is read last-wins instead of refused",
           with_attrs(reader_class=_LastKeyWins)),
    Mutant("body-encoding-sniffed", "document-session", "refused-request-changes-nothing",
           "a body that is not UTF-8 is decoded as whatever it looks like (UTF-16, UTF-32)",
           with_attrs(reader_class=_SniffedEncoding)),
    Mutant("if-match-read-as-a-number", "document-session", "refused-request-changes-nothing",
           'If-Match: "0004" is read as version 4, not compared as an entity tag',
           with_attrs(reader_class=_NumericETag)),
    Mutant("first-header-wins", "document-session", "refused-request-changes-nothing",
           "a header sent twice is read as its first value instead of refused",
           with_attrs(reader_class=_FirstHeaderWins)),
    Mutant("content-type-not-checked", "document-session", "refusal-answered-clearly",
           "a body is read as JSON whatever its Content-Type says",
           with_attrs(reader_class=_AnyContentType)),
    Mutant("unparseable-body-is-422", "document-session", "refusal-answered-clearly",
           "a body that is not JSON is answered 422 with a validation error, not 400",
           with_attrs(reader_class=_NotJson422)),
    Mutant("trailing-slash-redirects", "document-session", "refusal-answered-clearly",
           "a request to /api/desk/files/ is redirected (307) instead of refused",
           with_attrs(reader_class=_RedirectSlashes)),
]
