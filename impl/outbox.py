"""The notification outbox on PostgreSQL: the reference implementation.

Each operation is one transaction on a connection the caller owns (not autocommit): the
statements run inside :func:`~knownstate.impl.errors.boundary`, the COMMIT goes through
:func:`~knownstate.impl.errors.commit`, and a conditional write that matches no row is a
:class:`LostRace` (rolled back), never an exception. Every lease stamp and comparison is
Postgres ``now()``.

Every operation is a single statement, so on a connection in autocommit it is the same
transaction in one round trip instead of three (BEGIN, the statement, COMMIT). The worker loop
runs that way. There a connection lost during the statement may have committed it, so it raises
:class:`~knownstate.impl.errors.CommitIndeterminate`, never ``ConnectionLost``.

The send to the sink is **at-least-once**: :class:`OutboxWorker` sends, then records the
outcomes with a fenced write (by default one statement for the whole batch, each row fenced on
its own: :meth:`OutboxStore.record_batch`); if its lease lapsed meanwhile and another worker
re-claimed the row, the notification goes out twice. That is the documented trade: a duplicate
notification is cheaper than a lost one. The sink can de-duplicate on the delivery id it
receives.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Callable, Sequence

import psycopg
from psycopg.types.json import Jsonb

from knownstate.model.contract import LostRace, Outcome, Rejected, Won
from knownstate.model.outbox import (
    DUPLICATE_ID,
    OK,
    PERMANENT,
    RETRYABLE,
    TWICE_IN_BATCH,
    Claim,
    Config,
    Delivery,
    Report,
)

from . import queries
from .errors import CommitIndeterminate, ConnectionLost, ExternalCallFailed, boundary, commit
from .loops import Connect, StoreLoop

SCHEMA = queries.schema("outbox_schema.sql")
QUERIES = queries.load("outbox.sql")
TABLES = ("outbox_delivery",)
EXTERNAL_EFFECT = "at-least-once"


class OutboxStore:
    """The outbox's operations. ``queries`` defaults to the reference SQL; the mutant catalogue
    passes a changed copy."""

    def __init__(self, config: Config = Config(), queries: dict[str, str] | None = None):
        self.config = config
        self.q = dict(queries or QUERIES)

    def _one_tx(self, conn: psycopg.Connection, op: str, sql: str, params: dict) -> list[tuple]:
        with _statement_commits(conn), boundary(f"outbox.{op}"):
            rows = conn.execute(sql, params).fetchall()
            if not rows:
                conn.rollback()
                return rows
        commit(conn, f"outbox.{op}")
        return rows

    def enqueue(
        self, conn: psycopg.Connection, id: int | None = None, payload: dict | None = None
    ) -> Outcome:
        """A new delivery. ``id`` is the producer's event id; without one the sequence picks it.
        An id already taken is ``Rejected`` and changes nothing."""
        params = {"id": id, "payload": Jsonb(payload or {})}
        rows = self._one_tx(
            conn, "enqueue", self.q["enqueue" if id is not None else "enqueue_generated"], params
        )
        return Won(rows[0][0]) if rows else Rejected(DUPLICATE_ID)

    def begin_claim(self, conn: psycopg.Connection, batch: int) -> list[tuple[Claim, dict]]:
        """The claim's statement, without COMMIT: the rows stay locked until the caller commits
        (on a connection not in autocommit; in autocommit the statement commits by itself)."""
        with boundary("outbox.claim"):
            rows = conn.execute(
                self.q["claim_due"], {"batch": batch, "lease": self.config.lease}
            ).fetchall()
        return sorted(((Claim(r[0], r[1]), r[2]) for r in rows), key=lambda c: c[0].id)

    def claim_batch(self, conn: psycopg.Connection, batch: int) -> list[tuple[Claim, dict]]:
        with _statement_commits(conn):
            claimed = self.begin_claim(conn, batch)
        commit(conn, "outbox.claim")
        return claimed

    def claim(self, conn: psycopg.Connection, batch: int) -> Outcome:
        return Won(tuple(c for c, _ in self.claim_batch(conn, batch)))

    def extend_lease(self, conn: psycopg.Connection, c: Claim) -> Outcome:
        rows = self._one_tx(
            conn,
            "extend_lease",
            self.q["extend_lease"],
            {"id": c.id, "attempt": c.attempt, "lease": self.config.lease},
        )
        return Won() if rows else LostRace("fenced")

    def complete(self, conn: psycopg.Connection, c: Claim) -> Outcome:
        rows = self._one_tx(
            conn, "complete", self.q["complete"], {"id": c.id, "attempt": c.attempt}
        )
        return Won(rows[0][0]) if rows else LostRace("fenced")

    def fail_params(self, c: Claim, permanent: bool, error: str) -> dict:
        cfg = self.config
        return {
            "id": c.id,
            "attempt": c.attempt,
            "permanent": permanent,
            "error": error,
            "max_attempts": cfg.max_attempts,
            "base": cfg.backoff_base,
            "cap": cfg.backoff_cap,
        }

    def fail(self, conn: psycopg.Connection, c: Claim, permanent: bool, error: str = "") -> Outcome:
        rows = self._one_tx(conn, "fail", self.q["fail"], self.fail_params(c, permanent, error))
        return Won(rows[0][0]) if rows else LostRace("fenced")

    def record_batch_params(self, reports: Sequence[Report], errors: Sequence[str | None]) -> dict:
        """The batch as parallel arrays, sorted by id (one lock order for every batch)."""
        order = sorted(range(len(reports)), key=lambda k: reports[k].claim.id)
        cfg = self.config
        return {
            "ids": [reports[k].claim.id for k in order],
            "attempts": [reports[k].claim.attempt for k in order],
            "results": [str(reports[k].result) for k in order],
            "errors": [None if reports[k].result == OK else (errors[k] or "") for k in order],
            "max_attempts": cfg.max_attempts,
            "base": cfg.backoff_base,
            "cap": cfg.backoff_cap,
        }

    def record_batch(
        self,
        conn: psycopg.Connection,
        reports: Sequence[Report],
        errors: Sequence[str | None] | None = None,
    ) -> Outcome:
        """The outcomes of a batch in one statement and one commit, each row fenced on its own
        claimed attempt. ``Won`` of the per-row outcomes in the order of ``reports``:
        ``Won(status)`` for a row recorded, ``LostRace("fenced")`` for a stale one (it never
        stops the others).
        ``errors`` (optional, parallel to ``reports``) is each failed row's ``last_error``.

        A batch of one row runs the one-row statement (``complete`` or ``fail``): the same single
        statement and commit, without the arrays, whose plan PostgreSQL would redo each time."""
        if len({r.claim.id for r in reports}) != len(reports):
            return Rejected(TWICE_IN_BATCH)
        if not reports:
            return Won(())
        if len(reports) == 1:
            (r,), error = reports, (errors or [None])[0]
            return Won(
                (
                    self.complete(conn, r.claim)
                    if r.result == OK
                    else self.fail(conn, r.claim, r.result == PERMANENT, error or ""),
                )
            )
        params = self.record_batch_params(reports, errors or [None] * len(reports))
        status = dict(self._one_tx(conn, "record_batch", self.q["record_batch"], params))
        return Won(
            tuple(
                Won(status[r.claim.id]) if r.claim.id in status else LostRace("fenced")
                for r in reports
            )
        )

    def reclaim_stale(self, conn: psycopg.Connection) -> Outcome:
        rows = self._one_tx(
            conn,
            "reclaim_stale",
            self.q["reclaim_stale"],
            {"max_attempts": self.config.max_attempts},
        )
        return Won(tuple(sorted(r[0] for r in rows)))


@contextmanager
def _statement_commits(conn: psycopg.Connection):
    """In autocommit the statement is its own transaction and its COMMIT rides with it: a
    connection lost during it is an indeterminate commit, not a transaction that never landed."""
    try:
        yield
    except ConnectionLost as e:
        if conn.autocommit:
            raise CommitIndeterminate(e.detail) from e
        raise


def project(conn: psycopg.Connection, to_model_time: Callable) -> tuple[Delivery, ...]:
    """The rows in the model's shape (:meth:`knownstate.model.outbox.OutboxModel.state`)."""
    rows = conn.execute(queries.load("outbox.sql")["project"]).fetchall()
    return tuple(
        Delivery(
            id=r[0],
            status=r[1],
            attempts=r[2],
            next_attempt_at=to_model_time(r[3]),
            lease_until=None if r[4] is None else to_model_time(r[4]),
        )
        for r in rows
    )


# ---------------------------------------------------------------------------------------
# The external send and the worker loop.
# ---------------------------------------------------------------------------------------


def send_to_sink(url: str, claim: Claim, payload: dict | None = None, timeout: float = 5.0) -> str:
    """POST one delivery to the notification sink. Returns ok / retryable (5xx) / permanent
    (4xx); raises ExternalCallFailed when no answer came (it may still have arrived)."""
    body = json.dumps(
        {"delivery_id": claim.id, "attempt": claim.attempt, "payload": payload or {}}
    ).encode()
    req = urllib.request.Request(
        f"{url}/deliveries",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": f"outbox-{claim.id}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return OK
    except urllib.error.HTTPError as e:
        e.read()
        return PERMANENT if 400 <= e.code < 500 else RETRYABLE
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ExternalCallFailed(f"sink at {url}: {e}") from None


class OutboxWorker(StoreLoop):
    """The reference worker loop: claim a batch, send each, record the outcomes (fenced).
    ``send(claim, payload)`` answers ok / retryable / permanent, or raises ExternalCallFailed
    (a retryable outcome); its knobs, ``batch`` and ``per_row``, are keywords, e.g.
    ``OutboxWorker(connect, store, send, stop, batch=20, idle=0.05)``. Its stats: ``claimed``
    rows, ``done`` (sent), ``failed`` (recorded for a retry or as failed), ``fenced``,
    ``errors`` (a turn that lost its connection; the next one reconnects).

    By default the outcomes of the whole batch are recorded once its last send returned, in one
    statement (:meth:`OutboxStore.record_batch`): two commits per batch, whatever its size. With
    ``per_row=True`` each outcome is recorded as soon as its send returned, in a transaction of
    its own (``complete`` / ``fail``): a commit per row, but a row's record never waits for the
    rest of the batch — choose it when sends are slow compared with the lease.

    Its connection runs in autocommit: the claim and each record are single statements, so
    each is still its own transaction, in one round trip instead of three."""

    autocommit = True
    batch, per_row = 10, False

    def __init__(
        self,
        connect: Connect,
        store: OutboxStore,
        send: Callable[[Claim, dict], str],
        stop: threading.Event | None = None,
        **knobs,
    ):
        super().__init__(connect, store, stop, **knobs)
        self.send = send

    def run_once(self) -> int:
        """One claim and its deliveries. Returns how many rows it claimed."""
        conn = self.conn()
        claimed = self.store.claim_batch(conn, self.batch)
        self.stats.claimed += len(claimed)
        reports, errors = [], []
        for claim, payload in claimed:
            try:
                result = self.send(claim, payload)
            except ExternalCallFailed as e:
                result, error = RETRYABLE, str(e)
            else:
                error = "" if result == OK else f"sink answered {result}"
            if not self.per_row:
                reports.append(Report(claim, result))
                errors.append(error)
            elif result == OK:
                self._count(result, self.store.complete(conn, claim))
            else:
                failed = self.store.fail(conn, claim, permanent=result == PERMANENT, error=error)
                self._count(result, failed)
        if reports:
            recorded = self.store.record_batch(conn, reports, errors)
            for report, outcome in zip(reports, recorded.value):
                self._count(report.result, outcome)
        return len(claimed)

    def _count(self, result: str, outcome: Outcome) -> None:
        if isinstance(outcome, LostRace):
            self.stats.fenced += 1
        elif result == OK:
            self.stats.done += 1
        else:
            self.stats.failed += 1
