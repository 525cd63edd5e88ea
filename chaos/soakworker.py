"""One OS process of a soak: a reference worker loop, a reaper, or a producer, with its own log.

Theory of operation
-------------------

``python -m knownstate.chaos.soakworker SPEC`` (SPEC: a JSON object the harness writes) runs one
*role* of one run kind until SIGTERM: the kind's reference loop (``worker``; for the outbox
:class:`~knownstate.impl.outbox.OutboxWorker`, else :mod:`knownstate.impl.loops`), its reaper
(``reaper``; for the approved plan the ``reader``, whose reads heal stale runs), or a
``producer`` that enqueues, proposes and approves, or requests work at a rate drawn from the
seed. Every connection goes through this process's own Toxiproxy link (``dsn``), and so does
every call to the stand-in (``url``). With ``mutant`` the store is the mutant's: the check class
of the kind with the mutant applied says which ``store_class`` and ``queries`` (the kinds are
not edited, and neither is the loop).

The operation log. Every public store operation is wrapped (a subclass of the store class, so
the loop and the store run unchanged) and logged as two JSON lines in this process's own file:
``begin`` (operation, the runs it names with the fence token it carries, arguments) and ``end``
(won / lost / rejected with the value or reason, or the error: indeterminate, connection lost,
aborted, external call failed). A process killed mid-operation leaves a ``begin`` without an
``end``. While an operation runs, every statement it sends starts with a comment naming it,
``/* ks:w1.2:17 */`` (worker w1, incarnation 2, operation 17); the harness's audit trigger reads
it back with ``current_query()``, so each committed row change is tied to the operation that
made it, and the judge can compare the token the operation carried with what the row said.
Every HTTP request sent during an operation carries its reference in a header, which the
stand-ins record, so an external effect is tied to its operation too (even one that arrives
after its sender gave up waiting). The outbox's send is logged like a store operation, and so
is the branch reset's application clock reading.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import inspect
import json
import os
import random
import signal
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

import psycopg

from knownstate.impl import errors
from knownstate.model.contract import LostRace, Rejected, Won

# ---------------------------------------------------------------------------------------
# The operation log and the tagged connection.
# ---------------------------------------------------------------------------------------

OUTCOME_OF_ERROR = (
    (errors.CommitIndeterminate, "indeterminate"),
    (errors.ConnectionLost, "conn-lost"),
    (errors.TransactionAborted, "aborted"),
    (errors.ExternalCallFailed, "ext-failed"),
)


class OpLog:
    """This process's log: one JSON object per line, written through at once (a SIGKILL loses
    nothing already written)."""

    def __init__(self, path: str, name: str, inc: int):
        self.name, self.inc = name, inc
        self._f = open(path, "a", buffering=1)
        self._serial = 0
        self.depth = 0  # > 0 while an operation runs: nested store calls are part of it
        self.current: str | None = None  # the reference of the operation running now
        self.app_now: datetime | None = None

    def write(self, ev: str, **fields) -> None:
        self._f.write(
            json.dumps(
                {"t": round(time.time(), 4), "ev": ev, **fields}, separators=(",", ":"), default=str
            )
            + "\n"
        )

    def ref(self, serial: int) -> str:
        return f"{self.name}.{self.inc}:{serial}"

    def begin(self, name: str, runs: dict[str, Any], args: dict[str, Any]) -> int:
        self._serial += 1
        self.app_now = None
        self.write("begin", op=self._serial, name=name, runs=runs, args=args)
        return self._serial

    def end(self, serial: int, out: str, value: Any = None, **fields) -> None:
        if self.app_now is not None:
            fields["app_now"] = self.app_now.timestamp()
        self.write("end", op=serial, out=out, value=value, **fields)

    def app_clock(self) -> datetime:
        """The application clock a branch-reset store reads; the last reading is logged."""
        self.app_now = datetime.now(timezone.utc)
        return self.app_now


OP_HEADER = "X-Knownstate-Op"


@contextlib.contextmanager
def tagging_http(log: OpLog):
    """While open, every HTTP request this process sends during an operation carries the
    operation's reference in :data:`OP_HEADER` (the stand-ins record it). The request line is
    where ``http.client`` starts every request, whoever builds it (``urllib``, a store's own
    client)."""
    original = http.client.HTTPConnection.putrequest

    def putrequest(self, method, url, *args, **kwargs):
        original(self, method, url, *args, **kwargs)
        if log.current:
            self.putheader(OP_HEADER, log.current)

    http.client.HTTPConnection.putrequest = putrequest
    try:
        yield
    finally:
        http.client.HTTPConnection.putrequest = original


class TaggedConnection(psycopg.Connection):
    """A psycopg connection whose statements start with ``/* ks:<tag> */`` while ``tag`` is set."""

    tag = ""

    def execute(self, query, params=None, **kwargs):
        if self.tag and isinstance(query, str):
            query = f"/* ks:{self.tag} */ {query}"
        return super().execute(query, params, **kwargs)


def _plain(value: Any) -> Any:
    """A logged value: claims as [id, attempt], receipts and reports by their fields."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "attempt") and hasattr(value, "id"):
        return [value.id, value.attempt]
    if hasattr(value, "step_index") and hasattr(value, "ok"):
        return {"step": value.step_index, "ok": value.ok}
    if hasattr(value, "status") and hasattr(value, "receipts"):
        return {"status": str(value.status), "receipts": len(value.receipts)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value if not isinstance(v, dict)]
    return str(value)


def _claims(value: Any) -> dict[str, int]:
    """Every outbox claim inside a value, as {run: attempt}: also each report's of a batch
    (the rows a batched record writes, each under its own claimed attempt)."""
    if hasattr(value, "attempt") and hasattr(value, "id"):
        return {str(value.id): value.attempt}
    if hasattr(value, "claim") and hasattr(value, "result"):
        return _claims(value.claim)
    out: dict[str, int] = {}
    if isinstance(value, (tuple, list)):
        for v in value:
            out.update(_claims(v))
    return out


def _fields(bound: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The runs an operation names, each with the fence token it carries, and its other
    arguments."""
    runs: dict[str, Any] = {}
    args: dict[str, Any] = {}
    for key, value in bound.items():
        if key in ("self", "conn"):
            continue
        claims = _claims(value)
        if claims:
            runs.update(claims)
        elif key in ("proposal_id", "run_id", "id") and value is not None:
            runs[str(value)] = bound.get("token")
        elif key == "steps":
            args["steps"] = len(list(value))
        elif key != "token" and isinstance(value, (str, int, float, bool)):
            args[key] = value
    return runs, args


def _outcome(out: Any) -> tuple[str, Any]:
    if isinstance(out, Won):
        return "won", _plain(out.value)
    if isinstance(out, LostRace):
        return "lost", out.reason
    if isinstance(out, Rejected):
        return "rejected", out.reason
    return "won", _plain(out)


def recording(store_class: type, log: OpLog) -> type:
    """A subclass of ``store_class`` that logs every public operation (a method whose first
    argument is ``conn``) and tags its statements; nested operations belong to the outer one."""

    def wrap(name: str, method: Callable) -> Callable:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def operation(self, conn, *args, **kwargs):
            if log.depth:
                return method(self, conn, *args, **kwargs)
            runs, logged = _fields(signature.bind(self, conn, *args, **kwargs).arguments)
            serial = log.begin(name, runs, logged)
            log.depth += 1
            conn.tag = log.current = log.ref(serial)
            try:
                out = method(self, conn, *args, **kwargs)
            except BaseException as e:
                kind = next((k for cls, k in OUTCOME_OF_ERROR if isinstance(e, cls)), "error")
                log.end(serial, kind, detail=str(e)[:200])
                raise
            finally:
                log.depth -= 1
                conn.tag, log.current = "", None
            verdict, value = _outcome(out)
            claimed = _claims(out.value if isinstance(out, Won) else out)
            log.end(serial, verdict, value, **({"runs": claimed} if claimed else {}))
            return out

        return operation

    members = {}
    for name, method in inspect.getmembers(store_class, inspect.isfunction):
        params = list(inspect.signature(method).parameters)
        if not name.startswith("_") and params[1:2] == ["conn"]:
            members[name] = wrap(name, method)
    return type(f"Recording{store_class.__name__}", (store_class,), members)


# ---------------------------------------------------------------------------------------
# The store of the run kind: the reference, or a mutant's.
# ---------------------------------------------------------------------------------------


def store_parts(kind: str, mutant: str | None) -> tuple[type, dict | None]:
    """(store class, queries) of the reference, or of the mutant applied to the kind's check."""
    if mutant is None:
        from knownstate.impl import approved_plan, branch_reset, outbox

        return {
            "outbox": outbox.OutboxStore,
            "approved-plan": approved_plan.ApprovedPlanStore,
            "branch-reset": branch_reset.BranchResetStore,
        }[kind], None
    from . import kinds

    (found,) = [m for m in kinds.mutants(kind) if m.name == mutant]
    check = found.machine(kinds.check(kind))
    return check.store_class, getattr(check, "queries", None)


def make_store(spec: dict, log: OpLog):
    kind, p = spec["kind"], spec["params"]
    cls, queries = store_parts(kind, spec.get("mutant"))
    cls = recording(cls, log)
    if kind == "outbox":
        from knownstate.model.outbox import Config

        config = Config(
            lease=p["lease"],
            backoff_base=p["backoff_base"],
            backoff_cap=p["backoff_cap"],
            max_attempts=p["max_attempts"],
        )
        return cls(config, queries)
    if kind == "approved-plan":
        return cls(p["heartbeat_s"], queries)
    return cls(
        spec["name"],
        spec.get("url") or "",
        log.app_clock,
        lease_seconds=p["lease"],
        http_timeout=p["http_timeout"],
        queries=queries,
    )


# ---------------------------------------------------------------------------------------
# Producers: the load. They log through the same recording store.
# ---------------------------------------------------------------------------------------

PLAN_STEPS = (
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "credit", "account": "b", "amount": 3},
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "debit", "account": "a", "amount": 4},
    {"op": "debit", "account": "b", "amount": 9},
    {"op": "fail"},
)
PLAN_WEIGHTS = (6, 6, 6, 3, 1, 1)


class Producer:
    """Creates work at ``rate`` per second (exponential gaps drawn from the seed)."""

    def __init__(
        self, spec: dict, store, connect: Callable[[], psycopg.Connection], stop: threading.Event
    ):
        self.spec, self.store, self.connect, self.stop = spec, store, connect, stop
        self.rng = random.Random(f"{spec['seed']}:{spec['name']}:{spec['inc']}")
        self.kind, self.p = spec["kind"], spec["params"]
        self._conn: psycopg.Connection | None = None
        self.serial = 0
        self.pending: list[int] = []  # approved-plan: proposals left pending, to expire later
        self.last: dict[str, tuple[str, str]] = {}  # branch-reset: branch -> (key, run id)
        self.retry_id: int | None = None  # outbox: an enqueue whose COMMIT was indeterminate

    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            with errors.boundary("connect"):
                self._conn = self.connect()
        return self._conn

    def run(self) -> None:
        while not self.stop.wait(self.rng.expovariate(self.p["rate"])):
            try:
                getattr(self, self.kind.replace("-", "_"))()
            except errors.KnownstateError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
        if self._conn is not None:
            self._conn.close()

    def outbox(self) -> None:
        if self.retry_id is None:
            self.serial += 1
            self.retry_id = self.spec["inc"] * 1_000_000 + self.serial
        delivery, self.retry_id = self.retry_id, None
        try:
            self.store.enqueue(self.conn(), delivery, {"to": f"user{delivery}"})
        except (errors.CommitIndeterminate, errors.ConnectionLost):
            self.retry_id = delivery  # enqueue it again: a duplicate id is refused, never doubled
            raise
        except errors.TransactionAborted:
            pass  # the earlier, indeterminate enqueue of this id had landed

    def approved_plan(self) -> None:
        roll = self.rng.random()
        if self.pending and roll < 0.05:
            self.store.expire(self.conn(), self.pending.pop(0))
            return
        n = self.rng.randint(2, 5)
        steps = self.rng.choices(PLAN_STEPS, PLAN_WEIGHTS, k=n)
        out = self.store.propose(self.conn(), steps)
        if not isinstance(out, Won):
            return
        if roll < 0.10:
            self.pending.append(out.value)
        elif roll < 0.15:
            self.store.reject(self.conn(), out.value)
        else:
            self.store.approve(self.conn(), out.value)

    def branch_reset(self) -> None:
        branch = f"b{self.rng.randrange(self.p['branches'])}"
        roll = self.rng.random()
        if branch in self.last and roll < 0.05:
            self.store.cancel(self.conn(), self.last[branch][1])
            return
        if branch in self.last and roll < 0.15:
            key = self.last[branch][0]  # the same request again: answered with the same run
        else:
            self.serial += 1
            key = f"{branch}:{self.spec['name']}.{self.spec['inc']}:{self.serial}"
        out = self.store.request(self.conn(), branch, key)
        if isinstance(out, Won):
            self.last[branch] = (key, out.value)


# ---------------------------------------------------------------------------------------
# The process.
# ---------------------------------------------------------------------------------------


class OutboxLoop:
    """The outbox's reference loop, :class:`~knownstate.impl.outbox.OutboxWorker`, unchanged, with
    a send that logs. ``send_to_sink`` lets a reply cut mid-body escape as ``http.client``'s own
    error; the send given to the loop turns it into ExternalCallFailed, like every other lost
    reply."""

    def __init__(self, spec: dict, store, connect, stop: threading.Event, log: OpLog):
        from knownstate.impl.outbox import OutboxWorker

        self.spec, self.stop, self.log = spec, stop, log
        self.worker = OutboxWorker(connect, store, self.send, batch=spec["params"]["batch"])
        self.stats = self.worker.stats

    def send(self, claim, payload) -> str:
        from knownstate.impl.outbox import send_to_sink

        serial = self.log.begin("send", {str(claim.id): claim.attempt}, {})
        self.log.current = self.log.ref(serial)
        try:
            result = send_to_sink(
                self.spec["url"], claim, payload, timeout=self.spec["params"]["http_timeout"]
            )
        except (errors.ExternalCallFailed, http.client.HTTPException) as e:
            self.log.end(serial, "ext-failed", detail=str(e)[:200])
            raise errors.ExternalCallFailed(f"sink: {e}") from None
        finally:
            self.log.current = None
        self.log.end(serial, result)
        return result

    def run(self) -> None:
        idle = self.spec["params"]["idle"]
        self.worker.run(self.stop, lambda: self.stop.wait(idle))


def build_loop(spec: dict, store, connect, stop: threading.Event, log: OpLog):
    """The loop this process runs, by kind and role."""
    from knownstate.impl import loops

    kind, role, p = spec["kind"], spec["role"], spec["params"]
    if role == "producer":
        return Producer(spec, store, connect, stop)
    if kind == "outbox":
        if role == "reaper":
            return loops.Periodic(
                connect, store.reclaim_stale, stop, idle=p["reap_every"], autocommit=True
            )
        return OutboxLoop(spec, store, connect, stop, log)
    if kind == "approved-plan":
        if role == "reaper":
            return loops.PlanReader(connect, store, stop, idle=p["read_every"])
        return loops.PlanExecutor(connect, store, stop, idle=p["idle"], pace=p["pace"])
    if role == "reaper":
        return loops.Periodic(connect, store.reap, stop, idle=p["reap_every"])
    return loops.ResetPoller(connect, store, stop, idle=p["poll_every"])


def run(spec: dict) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log = OpLog(spec["log"], spec["name"], spec["inc"])
    log.write("start", pid=os.getpid(), role=spec["role"])
    app = f"ks-soak-{spec['name']}.{spec['inc']}"

    def connect() -> psycopg.Connection:
        serial = log.begin("connect", {}, {})
        try:
            with errors.boundary("connect"):
                conn = TaggedConnection.connect(
                    spec["dsn"], application_name=app, connect_timeout=3, prepare_threshold=None
                )
        except errors.KnownstateError as e:
            log.end(serial, "conn-lost", detail=str(e)[:200])
            raise
        log.end(serial, "won")
        return conn

    loop = build_loop(spec, make_store(spec, log), connect, stop, log)
    log.write("ready")
    with tagging_http(log):
        loop.run()
    stats = getattr(loop, "stats", None)
    log.write("exit", stats=vars(stats) if stats is not None else {})


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
