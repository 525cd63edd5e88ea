"""The real parts of a document-session run, and the two sides a script runs on.

:class:`Plant` is started once per run (``Env.stand_in``): the real document server, its
database connections through their own Toxiproxy link; one link and one HTTP transport per tab
slot, so one tab can go offline or lose an answer while the others carry on; a wire for
clients that are not sessions, straight to the server; and a directory for the draft files.
Every exchange any wire makes is recorded, in order, for the replay.

A script (see :mod:`knownstate.chaos.replay`) is a function of a side. :class:`RealSide` gives
it the real sessions (:class:`knownstate.impl.documents.session.Session`) and wires;
:class:`ModelSide` gives it the model's sessions — the same machine,
:class:`knownstate.model.document_session.SessionCore` — whose network is the recording.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Callable

import httpx
import psycopg

from knownstate.impl.documents import store as store_impl
from knownstate.impl.documents.server import DocumentServer
from knownstate.impl.documents.session import HttpTransport, Session
from knownstate.impl.documents.store import DocumentStore
from knownstate.model.document import DocumentModel, SessionCore

from ..replay import Recorder

if TYPE_CHECKING:
    from .document_session import DocumentSessionCheck

DOC = "r1"
SCHEMA = {"attributes": {"title": "text", "qty": "number", "done": "bool"}}
INITIAL = {"title": "first", "qty": 0}
SLOTS = {"a1": "alice", "a2": "alice", "b1": "bob"}  # tab slot -> user; every tab edits DOC
CLIENT = "client"  # the wire of requests no session makes (see document_requests)
DEBOUNCE = 1.0


class Observer(DocumentStore):
    """The reference store on the check's own kept-open, unfaulted connection: seeds each
    example, plays the server-side writer, and reads the rows for the projection."""

    def __init__(self, ws):
        self.ws = ws
        self.q = store_impl.Q

    def _connect(self):
        return contextlib.nullcontext(self.ws.admin())

    def close(self) -> None:
        pass  # the connection is the check's own


class Wire:
    """A client's transport: real HTTP, every exchange recorded."""

    def __init__(self, recorder: Recorder, name: str, http: HttpTransport):
        self.recorder, self.name, self.http = recorder, name, http

    def send(self, request):
        answer = self.http.send(request)
        self.recorder.record(self.name, request, answer)
        return answer


class Plant:
    link_prefix = "document-session"  # Toxiproxy links are named after it (one set per kind)

    def __init__(self, env, ws):
        self.env, self.ws = env, ws
        self.server_app = f"ks-{env.run_id}-document-server"  # the run's cleanup finds it
        self.recorder = Recorder()

    def start(self) -> "Plant":
        env = self.env
        self.db_link = env.api.link(f"{self.link_prefix}-server-pg", env.db.host, env.db.port)
        dsn = self.ws.conninfo(host=self.db_link.host, port=self.db_link.port)
        self.server_dsn = psycopg.conninfo.make_conninfo(dsn, application_name=self.server_app)
        # a connection per request: a fault meets each request the same way on every replay
        self.server = DocumentServer(self.server_dsn, connect_timeout=2, pool_size=None).start()
        self.links = {
            slot: env.api.link(f"{self.link_prefix}-{slot}", "127.0.0.1", self.server.port)
            for slot in SLOTS
        }
        self.http = {
            slot: HttpTransport(f"http://127.0.0.1:{link.port}", timeout=5)
            for slot, link in self.links.items()
        }
        self.http[CLIENT] = HttpTransport(self.server.url, timeout=5)
        self.raw = httpx.Client(
            base_url=self.server.url, timeout=5, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.wires = {name: Wire(self.recorder, name, h) for name, h in self.http.items()}
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


class CheckedModel(DocumentModel):
    """The model of the whole world, and which of its tabs' transitions and counters the check
    already counted (a tab that closed and reopened, or died, keeps counting)."""

    def __init__(self):
        super().__init__(debounce=DEBOUNCE, retry_delay=0.0)
        self.counted: dict[str, int] = {}  # tab -> transitions already counted
        self.retired_transitions: list[tuple[str, str, str]] = []
        self.retired_counters: dict[str, int] = {}

    def _retire(self, tab: str) -> None:
        t = self.tabs.get(tab)
        if t is None:
            return
        self.retired_transitions += t.transitions[self.counted.pop(tab, 0) :]
        for k, n in t.counters.items():
            self.retired_counters[k] = self.retired_counters.get(k, 0) + n

    def open_tab(self, tab, user, doc_id, kind, writer_id, now=0.0):
        if tab in self.tabs and self.tabs[tab].state.value == "closed":
            self._retire(tab)
        return super().open_tab(tab, user, doc_id, kind, writer_id, now)

    def crash_tab(self, tab: str) -> None:
        self._retire(tab)
        super().crash_tab(tab)

    def drain(self) -> list[tuple[str, str, str]]:
        """Transitions not counted yet (and marks them counted)."""
        out, self.retired_transitions = self.retired_transitions, []
        for name, t in self.tabs.items():
            out += t.transitions[self.counted.get(name, 0) :]
            self.counted[name] = len(t.transitions)
        return out

    def totals(self) -> dict[str, int]:
        out = dict(self.retired_counters)
        for t in self.tabs.values():
            for k, n in t.counters.items():
                out[k] = out.get(k, 0) + n
        return out


class ModelSide:
    """The model: its sessions are the same machine as the real ones; their network is the
    recording (``deliver``), their clock the check's."""

    def __init__(self, check: "DocumentSessionCheck", m: CheckedModel, deliver: Callable):
        self.check, self.m, self.deliver = check, m, deliver

    def tab(self, slot: str) -> SessionCore:
        t = self.m.tabs[slot]
        # plain functions, not bound methods: a deep copy of the model shares them
        t.send, t.clock = self.deliver, self.check.time
        return t

    def send(self, slot: str, req):
        return self.deliver(req)

    def open(self, slot: str, user: str, writer: str) -> SessionCore:
        self.m.open_tab(slot, user, DOC, "record", writer, now=self.check.clock)
        return self.tab(slot)

    def crash(self, slot: str) -> None:
        self.m.crash_tab(slot)

    def offline(self, slot: str):
        return contextlib.nullcontext("")  # the recording says what the network did

    def server_write(self, patch):
        return self.m.server_write(DOC, patch)


class RealSide:
    """The real parts: sessions over HTTP through their links, the draft files, the database."""

    def __init__(self, check: "DocumentSessionCheck"):
        self.check = check

    def tab(self, slot: str) -> Session:
        return self.check.sessions[slot]

    def send(self, slot: str, req):
        return self.check.plant.wires[slot].send(req)

    def open(self, slot: str, user: str, writer: str) -> Session:
        c = self.check
        s = c.session_class(
            DOC,
            user=user,
            kind="record",
            drafts=c.drafts,
            transport=c.plant.wires[slot],
            writer_id=writer,
            debounce=DEBOUNCE,
            retry_delay=0.0,
            clock=c.time,
        )
        c.sessions[slot] = s
        return s

    def crash(self, slot: str) -> None:
        del self.check.sessions[slot]

    def offline(self, slot: str):
        """The tab's link is down inside the block (its requests never reach the server)."""
        return self.check._net(slot, "offline")

    def server_write(self, patch):
        return self.check.observer.server_write(DOC, patch)
