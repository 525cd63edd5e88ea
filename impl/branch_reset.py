"""Branch reset on PostgreSQL: the reference implementation of ``knownstate.model.branch_reset``.

One :class:`BranchResetStore` per worker. A worker has its own database connection (passed to
each call, not autocommit), its own application clock (an injected callable: the lease is in
application time, the recorded deviation), and its own base URL of the operations API (in the
checks, its own Toxiproxy link to the stand-in). The operations and their outcomes are the
model's, one for one:

==========================  =====================  ==========================================
operation                   guard (SQL)            outcomes
==========================  =====================  ==========================================
``request(branch, key)``    unique key, one in     Won(run_id) new or existing;
                            flight per branch      Rejected(in flight | key reused)
``start(run_id)``           status = 'queued'      Won(op_id); LostRace; Rejected(no such run)
``poll(run_id)``            status = 'running',    Won(run status after); LostRace(run is …
                            lease by app clock     | lease lapsed); Rejected(no such run)
``cancel(run_id)``          status = 'running'     Won('canceled'); LostRace; Rejected
``reap()``                  status = 'running',    Won(sorted reaped ids)
                            lease lapsed
==========================  =====================  ==========================================

Create once, then poll. ``start`` claims the run (queued -> running, row locked), POSTs the
create with the run id as the API's idempotency key, records the operation id on the row, and
commits, all in one transaction. A worker that dies between the POST and the COMMIT leaves the
run queued. The operation exists. The next ``start`` POSTs the same key and gets the same
operation back, and the API counts no second creation. ``poll`` only ever GETs.

Errors: statements run inside :func:`knownstate.impl.errors.boundary` and COMMIT goes through
:func:`knownstate.impl.errors.commit`, so a dead connection is ``ConnectionLost`` or
``CommitIndeterminate``. An operations-API call that is not confirmed is ``ExternalCallFailed``.
In every error case the transaction is rolled back, and the run's row is unchanged.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta
from typing import Callable

import psycopg

from knownstate.model.branch_reset import (
    ERROR,
    IN_FLIGHT_REASON,
    KEY_REUSED,
    LEASE_LAPSED,
    LEASE_SECONDS,
    NO_SUCH_RUN,
    POLL_EVENT,
    TABLE,
    Event,
    ExternalStatus,
    Run,
    Status,
    not_in,
)
from knownstate.model.contract import LostRace, Outcome, Rejected, Won

from . import queries
from .errors import ExternalCallFailed, boundary, commit, rollback_quietly
from .loops import StoreLoop

QUERIES_FILE = "branch_reset.sql"
SCHEMA = queries.schema("branch_reset_schema.sql")
QUERIES = queries.load(QUERIES_FILE)
TABLES = ("branch_reset",)
"""Every table this kind writes, for TRUNCATE between examples."""


# ---------------------------------------------------------------------------
# The operations API client.
# ---------------------------------------------------------------------------


class OpsApiClient:
    """HTTP client of the operations API. Every failure to get a confirmed answer (refused,
    reset, timed out, non-2xx, malformed) is ExternalCallFailed."""

    def __init__(self, base_url: str, timeout: float = 2.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        # never an env proxy
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def create(self, run_id: str, branch: str, idempotency_key: str) -> tuple[str, ExternalStatus]:
        """POST /operations: the operation (new, or the one this key already created)."""
        body = self._call(
            "POST",
            "/operations",
            {"run_id": run_id, "branch": branch, "idempotency_key": idempotency_key},
        )
        return self._op(body)

    def status(self, op_id: str) -> ExternalStatus:
        """GET /operations/{id}: the operation's status now."""
        return self._op(self._call("GET", f"/operations/{urllib.parse.quote(op_id, safe='')}"))[1]

    def _op(self, body: object) -> tuple[str, ExternalStatus]:
        try:
            return str(body["id"]), ExternalStatus(body["status"])
        except (TypeError, KeyError, ValueError):
            raise ExternalCallFailed(
                f"operations API: malformed answer {str(body)[:120]!r}"
            ) from None

    def _call(self, method: str, path: str, payload: dict | None = None) -> object:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        where = f"operations API {method} {path}"
        try:
            with self._opener.open(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ExternalCallFailed(f"{where}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            raise ExternalCallFailed(f"{where}: {type(reason).__name__}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise ExternalCallFailed(f"{where}: malformed answer {raw[:120]!r}") from None


# ---------------------------------------------------------------------------
# The store.
# ---------------------------------------------------------------------------


class BranchResetStore:
    """One worker's side of branch reset. ``app_clock`` returns this worker's application time
    (an aware datetime); ``ops_url`` is this worker's base URL of the operations API.
    ``queries`` defaults to the reference SQL; the mutant catalogue replaces some."""

    def __init__(
        self,
        worker: str,
        ops_url: str,
        app_clock: Callable[[], datetime],
        *,
        lease_seconds: int = LEASE_SECONDS,
        http_timeout: float = 2.0,
        queries: dict[str, str] | None = None,
    ):
        self.worker = worker
        self.app_clock = app_clock
        self.lease = timedelta(seconds=lease_seconds)
        self.api = OpsApiClient(ops_url, timeout=http_timeout)
        self.q = dict(queries or QUERIES)

    def _miss(self, conn: psycopg.Connection, run_id: str) -> Outcome:
        """A guarded write matched no row: name what the guard found instead."""
        row = conn.execute(self.q["run_status"], {"run_id": run_id}).fetchone()
        return Rejected(NO_SUCH_RUN) if row is None else LostRace(not_in(row[0]))

    def request(self, conn: psycopg.Connection, branch: str, idempotency_key: str) -> Outcome:
        where = "branch-reset.request"
        try:
            with boundary(where):
                row = conn.execute(
                    self.q["request"], {"branch": branch, "idempotency_key": idempotency_key}
                ).fetchone()
                if row is None:
                    found = conn.execute(
                        self.q["find_by_key"], {"idempotency_key": idempotency_key}
                    ).fetchone()
                    conn.rollback()
                    if found is None:
                        return Rejected(IN_FLIGHT_REASON)
                    return Won(found[0]) if found[1] == branch else Rejected(KEY_REUSED)
            commit(conn, where)
            return Won(row[0])
        except BaseException:
            rollback_quietly(conn)
            raise

    def start(self, conn: psycopg.Connection, run_id: str) -> Outcome:
        where = "branch-reset.start"
        try:
            with boundary(where):
                lease_until = self.app_clock() + self.lease
                row = conn.execute(
                    self.q["claim"],
                    {"run_id": run_id, "worker": self.worker, "lease_until": lease_until},
                ).fetchone()
                if row is None:
                    outcome = self._miss(conn, run_id)
                    conn.rollback()
                    return outcome
                op_id, op_status = self.api.create(run_id, row[0], idempotency_key=run_id)
                recorded = conn.execute(
                    self.q["record_operation"],
                    {"run_id": run_id, "op_id": op_id, "op_status": op_status.value},
                ).fetchone()
                if recorded is None:  # cannot happen while the claim's row lock holds
                    outcome = self._miss(conn, run_id)
                    conn.rollback()
                    return outcome
            commit(conn, where)
            return Won(op_id)
        except BaseException:
            rollback_quietly(conn)
            raise

    def poll(self, conn: psycopg.Connection, run_id: str) -> Outcome:
        where = "branch-reset.poll"
        try:
            with boundary(where):
                app_now = self.app_clock()
                row = conn.execute(self.q["poll_target"], {"run_id": run_id}).fetchone()
                if row is None:
                    conn.rollback()
                    return Rejected(NO_SUCH_RUN)
                status, lease_until, op_id = row
                if status != Status.RUNNING:
                    conn.rollback()
                    return LostRace(not_in(status))
                if lease_until <= app_now:
                    conn.rollback()
                    return LostRace(LEASE_LAPSED)
                conn.rollback()  # hold nothing open while the API answers
                observed = self.api.status(op_id)
                event = POLL_EVENT[observed]
                target = Status(TABLE.next(Status.RUNNING.value, event.value))
                params = {
                    "run_id": run_id,
                    "op_id": op_id,
                    "app_now": app_now,
                    "status": target.value,
                    "observed": observed.value,
                    "error": ERROR.get(event),
                    "lease_until": app_now + self.lease if target is Status.RUNNING else None,
                }
                moved = conn.execute(self.q["record_poll"], params).fetchone()
                if moved is None:
                    outcome = self._miss(conn, run_id)
                    if outcome == LostRace(not_in(Status.RUNNING)):
                        outcome = LostRace(LEASE_LAPSED)  # still running: the lease guard refused
                    conn.rollback()
                    return outcome
            commit(conn, where)
            return Won(moved[0])
        except BaseException:
            rollback_quietly(conn)
            raise

    def cancel(self, conn: psycopg.Connection, run_id: str) -> Outcome:
        where = "branch-reset.cancel"
        try:
            with boundary(where):
                row = conn.execute(self.q["cancel"], {"run_id": run_id}).fetchone()
                if row is None:
                    outcome = self._miss(conn, run_id)
                    conn.rollback()
                    return outcome
            commit(conn, where)
            return Won(Status.CANCELED.value)
        except BaseException:
            rollback_quietly(conn)
            raise

    def reap(self, conn: psycopg.Connection) -> Outcome:
        where = "branch-reset.reap"
        try:
            with boundary(where):
                rows = conn.execute(
                    self.q["reap"], {"app_now": self.app_clock(), "error": ERROR[Event.REAP]}
                ).fetchall()
            commit(conn, where)
            return Won(tuple(sorted(r[0] for r in rows)))
        except BaseException:
            rollback_quietly(conn)
            raise


def project(conn: psycopg.Connection, to_model_time: Callable[[datetime], int]) -> dict[str, Run]:
    """Every row in the model's state shape (``BranchResetModel.rows()``). ``to_model_time``
    turns a stored timestamp into model seconds."""
    try:
        with boundary("branch-reset.project"):
            rows = conn.execute(queries.load(QUERIES_FILE)["project"]).fetchall()
        conn.rollback()
    except BaseException:
        rollback_quietly(conn)
        raise
    out: dict[str, Run] = {}
    for run_id, branch, key, status, claimed_by, op_id, op_statuses, lease_until, error in rows:
        out[run_id] = Run(
            run_id=run_id,
            branch=branch,
            idempotency_key=key,
            status=Status(status),
            claimed_by=claimed_by,
            external_op_id=op_id,
            op_statuses=tuple(op_statuses),
            lease_until=None if lease_until is None else to_model_time(lease_until),
            error=error,
        )
    return out


# ---------------------------------------------------------------------------------------
# The loop that runs it, as deployed (the soak runs it as processes).
# ---------------------------------------------------------------------------------------


class ResetPoller(StoreLoop):
    """The branch-reset worker, deployed: starts queued runs (claim + create the external
    operation once) and polls the running runs it started; it never polls another worker's run,
    so a dead owner's lease lapses and the reaper ends its run."""

    queries = QUERIES
    idle, batch = 0.3, 3

    def _call(self, op: Callable[[], Outcome]) -> Outcome | None:
        try:
            return op()
        except ExternalCallFailed:  # the store rolled back; the run is as it was
            self.stats.errors += 1
            return None

    def run_once(self) -> int:
        started = 0
        for (run_id,) in self.find("resets_queued", n=self.batch):
            out = self._call(lambda run_id=run_id: self.store.start(self.conn(), run_id))
            if isinstance(out, Won):
                self.stats.claimed += 1
                started += 1
            elif out is not None:
                self.stats.fenced += 1
        for (run_id,) in self.find("resets_mine", worker=self.store.worker):
            out = self._call(lambda run_id=run_id: self.store.poll(self.conn(), run_id))
            if isinstance(out, Won):
                self.stats.done += 1
            elif out is not None:
                self.stats.fenced += 1
        return started
