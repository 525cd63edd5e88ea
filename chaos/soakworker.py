"""One OS process of a soak: a worker loop, a reaper, or a producer, with its own log.

Theory of operation
-------------------

``python -m knownstate.chaos.soakworker SPEC`` (SPEC: a JSON object the harness writes) runs one
*role* of one run kind until SIGTERM: the kind's worker loop (``worker``), its reaper
(``reaper``; for the approved plan the reader, whose reads heal stale runs), or a ``producer``
that creates work at a rate drawn from the seed. What each role runs is the kind's soak binding
(:mod:`knownstate.chaos.soakkinds`: its check module's ``SOAK``; a described kind's
is built from its description and adapter). Every connection goes through this process's own
Toxiproxy link (``dsn``), and so does every call to the stand-in (``url``). With ``mutant`` the
store is the mutant's: the check class of the kind with the mutant applied says which
``store_class`` and ``queries`` (the kinds are not edited, and neither is the loop).

The operation log. Every public operation of the store (or the adapter) is wrapped (a subclass,
so the loop and the store run unchanged) and logged as two JSON lines in this process's own
file: ``begin`` (operation, the runs it names with the fence token it carries, arguments) and
``end`` (won / lost / rejected with the value or reason, or the error: indeterminate,
connection lost, aborted, external call failed). A process killed mid-operation leaves a
``begin`` without an ``end``. While an operation runs, every statement it sends starts with a
comment naming it, ``/* ks:w1.2:17 */`` (worker w1, incarnation 2, operation 17); the harness's
audit trigger reads it back with ``current_query()``, so each committed row change is tied to
the operation that made it, and the judge can compare the token the operation carried with
what the row said. Every HTTP request sent during an operation carries its reference in a
header (or, from a client of its own, in its URL), which the stand-ins record, so an external
effect is tied to its operation too (even one that arrives after its sender gave up waiting).
A worker's external call is logged like a store operation, and so is the branch reset's
application clock reading.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import inspect
import json
import os
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


def _tagged(query, tag: str):
    if not tag:
        return query
    if isinstance(query, str):
        return f"/* ks:{tag} */ {query}"
    if isinstance(query, bytes):
        return f"/* ks:{tag} */ ".encode() + query
    return psycopg.sql.Composed([psycopg.sql.SQL(f"/* ks:{tag} */ "), query])


class TaggedCursor(psycopg.Cursor):
    def execute(self, query, params=None, **kwargs):
        return super().execute(_tagged(query, self.connection.tag), params, **kwargs)


class AsyncTaggedCursor(psycopg.AsyncCursor):
    async def execute(self, query, params=None, **kwargs):
        return await super().execute(_tagged(query, self.connection.tag), params, **kwargs)


class TaggedConnection(psycopg.Connection):
    """A psycopg connection whose statements start with ``/* ks:<tag> */`` while ``tag`` is
    set: every statement, whichever cursor sends it."""

    tag = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursor_factory = TaggedCursor


class AsyncTaggedConnection(psycopg.AsyncConnection):
    """The same, for asyncio."""

    tag = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursor_factory = AsyncTaggedCursor


def _plain(value: Any) -> Any:
    """A logged value: claims as [id, attempt], receipts and reports by their fields."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "attempt") and hasattr(value, "id"):
        return [value.id, value.attempt]
    if hasattr(value, "attempt") and hasattr(value, "key"):
        return [value.key, value.attempt]
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
    if hasattr(value, "attempt") and hasattr(value, "key"):  # an adapter's Claimed
        return {str(value.key): value.attempt}
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
        elif key in ("proposal_id", "run_id", "id", "key") and value is not None:
            runs[str(value)] = bound.get("token")
        elif key == "steps":
            args["steps"] = len(list(value))
        elif key != "token" and isinstance(value, (str, int, float, bool)):
            args[key] = value
    return runs, args


def _outcome(name: str, out: Any, lost: Callable[[str, Any], bool] | None) -> tuple[str, Any]:
    if isinstance(out, Won):
        return "won", _plain(out.value)
    if isinstance(out, LostRace):
        return "lost", out.reason
    if isinstance(out, Rejected):
        return "rejected", out.reason
    if lost is not None and lost(name, out):
        return "lost", _plain(out)
    return "won", _plain(out)


def _error(name: str, e: BaseException, lost: Callable[[str, BaseException], bool] | None) -> str:
    kind = next((k for cls, k in OUTCOME_OF_ERROR if isinstance(e, cls)), None)
    if kind is not None:
        return kind
    if lost is not None and lost(name, e):
        return "lost"
    pg = e if isinstance(e, psycopg.Error) else _cause(e)
    if pg is not None:
        return "conn-lost" if errors.is_connection_error(pg) else "aborted"
    return "error"


def _cause(e: BaseException) -> psycopg.Error | None:
    """The driver's error behind a library's own."""
    from .adapter import unwrap

    return unwrap(e)


def recording(store_class: type, log: OpLog, lost=None, lost_error=None) -> type:
    """A subclass of ``store_class`` that logs every public operation (a method whose first
    argument is ``conn``, plain or ``async``) and tags its statements; nested operations belong
    to the outer one. ``lost(name, value)``/``lost_error(name, error)``: whether what operation
    ``name`` returned or raised is a lost race (an adapter's
    :class:`~knownstate.chaos.adapter.LostRaceSignals`)."""

    def begin(name: str, signature, self, conn, args, kwargs):
        runs, logged = _fields(signature.bind(self, conn, *args, **kwargs).arguments)
        serial = log.begin(name, runs, logged)
        log.depth += 1
        conn.tag = log.current = log.ref(serial)
        return serial

    def finish(serial: int, conn) -> None:
        log.depth -= 1
        conn.tag, log.current = "", None

    def ended(name: str, serial: int, out: Any) -> None:
        verdict, value = _outcome(name, out, lost)
        claimed = _claims(out.value if isinstance(out, Won) else out)
        log.end(serial, verdict, value, **({"runs": claimed} if claimed else {}))

    def wrap(name: str, method: Callable) -> Callable:
        signature = inspect.signature(method)
        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def operation_async(self, conn, *args, **kwargs):
                if log.depth:
                    return await method(self, conn, *args, **kwargs)
                serial = begin(name, signature, self, conn, args, kwargs)
                try:
                    out = await method(self, conn, *args, **kwargs)
                except BaseException as e:
                    log.end(serial, _error(name, e, lost_error), detail=str(e)[:200])
                    raise
                finally:
                    finish(serial, conn)
                ended(name, serial, out)
                return out

            return operation_async

        @functools.wraps(method)
        def operation(self, conn, *args, **kwargs):
            if log.depth:
                return method(self, conn, *args, **kwargs)
            serial = begin(name, signature, self, conn, args, kwargs)
            try:
                out = method(self, conn, *args, **kwargs)
            except BaseException as e:
                log.end(serial, _error(name, e, lost_error), detail=str(e)[:200])
                raise
            finally:
                finish(serial, conn)
            ended(name, serial, out)
            return out

        return operation

    members = {}
    for name, method in inspect.getmembers(store_class, inspect.isfunction):
        params = list(inspect.signature(method).parameters)
        if not name.startswith("_") and params[1:2] == ["conn"]:
            members[name] = wrap(name, method)
    return type(f"Recording{store_class.__name__}", (store_class,), members)


# ---------------------------------------------------------------------------------------
# The process.
# ---------------------------------------------------------------------------------------


def check_of(spec: dict) -> tuple[str, type]:
    """The kind's name and check class (with the mutant applied), found as ``verify`` finds
    it: by name, or by ``package.module:Thing`` (``kind_ref``)."""
    from . import kinds

    ref = spec.get("kind_ref") or spec["kind"]
    name = kinds.load(ref) if ":" in ref else ref
    check = kinds.check(name)
    mutant = spec.get("mutant")
    if mutant:
        (found,) = [m for m in kinds.mutants(name) if m.name == mutant]
        check = found.machine(check)
    return name, check


def opened(log: OpLog | None, open_connection: Callable[[], Any]) -> Any:
    """A connection ``open_connection()`` opened, logged as a ``connect`` operation; a failure
    is a lost connection (:class:`~knownstate.impl.errors.ConnectionLost`)."""
    serial = log.begin("connect", {}, {}) if log is not None else None
    try:
        with errors.boundary("connect"):
            conn = open_connection()
    except errors.KnownstateError as e:
        if serial is not None:
            log.end(serial, "conn-lost", detail=str(e)[:200])
        raise
    if serial is not None:
        log.end(serial, "won")
    return conn


def run(spec: dict) -> None:
    from . import kinds
    from .soakkinds import Producer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log = OpLog(spec["log"], spec["name"], spec["inc"])
    log.write("start", pid=os.getpid(), role=spec["role"])
    name, check = check_of(spec)
    kind = kinds.soak(name)

    def connect() -> psycopg.Connection:
        return opened(
            log,
            lambda: TaggedConnection.connect(
                spec["dsn"], application_name=spec["app"], connect_timeout=3, prepare_threshold=None
            ),
        )

    store = kind.store(spec, log, check)
    if spec["role"] == "producer":
        loop = Producer(kind, spec, store, connect, stop)
    else:
        loop = kind.loop(spec, store, connect, stop, log)
    log.write("ready")
    with tagging_http(log):
        loop.run()
    stats = getattr(loop, "stats", None)
    log.write("exit", stats=vars(stats) if stats is not None else {})


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
