"""The soak of a described kind: its description and its adapter are all it needs.

A kind a user describes (:class:`~knownstate.model.describe.RunKind`) and binds
(:class:`~knownstate.chaos.adapter.Adapter`) gets the soak the built-in kinds get, with nothing
more written:

- its processes run the described queue's loop through the user's adapter: a worker claims a
  batch, and for each run makes the external call to the receiver stand-in (when the
  description has one; else the outcome is drawn from the seed), records the outcome
  (``complete``, or ``fail``, for now or for good) and beats its heartbeat as the description's
  lease says; the reaper calls ``reclaim_stale``; the producer ``enqueue``s (and, with an
  idempotency key, repeats a request now and then). The durations are the description's,
  scaled so the lease is a few seconds (:func:`soak_timing`); the adapter is configured with
  them (``self.timing``), as in a check;
- every table of the adapter's schema is audited, and each committed version of a row is read
  the way the adapter reads its runs: its ``read_query`` evaluated over that one version (every
  table of the schema replaced, for the query, by a common table expression holding the
  version, or nothing);
- the judge is the contract's (:mod:`knownstate.chaos.judge`), with the description's contract:
  its fence kind, owned and terminal statuses, transitions, retry policy, external effect. A
  worker's labels are the adapter's operations: ``claim``, ``extend_lease``, ``complete``,
  ``fail``, ``reclaim_stale``, ``enqueue``, ``send``.

A described kind's adapter must read its runs with ``read_query`` (a ``read`` of its own
cannot be evaluated over one version of a row) and use psycopg (a driver of its own cannot have
its statements tagged with the operation that sent them).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import threading
import time
from collections import Counter
from dataclasses import asdict
from urllib.parse import quote

import psycopg
from psycopg import pq, sql

from knownstate.model import generic
from knownstate.model.generic import Timing

from . import effects
from .adapter import OK, PERMANENT, RETRY, as_row, no_answer_errors
from .history import Audit
from .judge import Judging, RunRow
from .soakkinds import Producer, SoakKind, queue_view, ts
from .soakworker import AsyncTaggedConnection, TaggedConnection, opened, recording

WRITES = frozenset({"enqueue", "extend_lease", "complete", "fail"})
LEASE = 4
"""Seconds a described kind's lease lasts in a soak; its other durations scale with it."""


def soak_timing(d) -> Timing:
    """The description's durations for a soak: scaled by one factor so the lease lasts
    :data:`LEASE` seconds (the shortest duration, without a lease), none under a second."""
    spans = [s for s in (d.lease and d.lease.seconds, d.retry and d.retry.base) if s]
    factor = (spans[0] / LEASE) if spans else 1.0

    def scaled(seconds):
        return None if not seconds else max(1, round(seconds / factor))

    lease, r = d.lease, d.retry
    return Timing(
        lease=scaled(lease.seconds) if lease else None,
        heartbeat=scaled(lease.heartbeat) if lease and lease.heartbeat else None,
        max_attempts=r.max_attempts if r else None,
        backoff_base=scaled(r.base) if r else None,
        backoff_cap=scaled(r.cap) if r and r.cap else None,
    )


def described(check: type) -> "DescribedSoak":
    """The soak binding of a check built by :func:`knownstate.chaos.generic.kind`."""
    from .generic import GenericCheck
    from .kinds import KindNotFound

    if not (isinstance(check, type) and issubclass(check, GenericCheck)):
        raise KindNotFound(
            f"kind {check.kind!r} has no soak: a soak runs the built-in kinds and kinds "
            "described with knownstate.chaos.generic.kind(description, adapter)"
        )
    adapter = check.adapter_class
    if adapter.mode() == "own":
        raise KindNotFound(
            f"kind {check.kind!r}: {adapter.__name__} brings a driver of its own; a soak tags "
            "each statement with the operation that sent it, which needs psycopg connections"
        )
    if not adapter.read_query:
        raise KindNotFound(
            f"kind {check.kind!r}: {adapter.__name__} reads its runs with read() of its own; a "
            "soak reads each committed row version with read_query: set read_query"
        )
    d = check.description
    if d.lease is not None and d.lease.per == "worker":
        raise KindNotFound(
            f"kind {check.kind!r}: its lease is per worker (Lease(per='worker')); a soak's judge "
            "times each run's lease by its own heartbeats, not its worker's: check it with "
            "knownstate verify, which models one"
        )
    if d.fence.kind == "claim":
        raise KindNotFound(
            f"kind {check.kind!r}: its fence is a claim id the rows do not show "
            "(Fence(kind='claim')); a soak's judge fences each row version by the token it "
            "reads: check it with knownstate verify, which models one"
        )
    if d.fence.operations:
        raise KindNotFound(
            f"kind {check.kind!r}: its writes have guards of their own (Fence(operations=...)); "
            "a soak's judge fences every write of a kind alike: check it with knownstate "
            "verify, which models each"
        )
    return DescribedSoak(check)


class DescribedSoak(SoakKind):
    """A soak binding built from a described kind's check class."""

    def __init__(self, check: type):
        from .soakparts import RecordingReceiver

        d = self.description = check.description
        self.check, self.name = check, d.name
        self.adapter = check.adapter_class
        timing = soak_timing(d)
        events = d.events()
        self.params = {
            "timing": asdict(timing),
            "batch": 3,
            "idle": 0.05,
            "reap_every": 0.5,
            "rate": 10.0,
            "http_timeout": 2.0,
        }
        self.lease = float(timing.lease or LEASE)
        self.nudge = (timing.lease or 0) + (timing.backoff_cap or timing.backoff_base or 0) + 1
        self.stand_in = RecordingReceiver if d.external != "none" else None
        self.refusals = (503, 503, 422) if generic.FAIL in events else (503,)
        self.writes_bound = 1  # the claim, then (heartbeats and) the outcome
        self.tables: tuple[str, ...] = ()

    def max_attempts(self) -> int | None:
        return self.params["timing"]["max_attempts"]

    # -- the judge ------------------------------------------------------------------------------
    def judging(self, config: dict) -> Judging:
        contract, d = self.check.contract, self.description
        done = next((t for _, e, t in d.transitions if e == generic.COMPLETE), None)

        def row(a: Audit, old: bool) -> RunRow | None:
            seen = a.was if old else a.seen
            return RunRow(**seen) if seen else None

        extras = []
        if d.external == "at-least-once":
            extras.append(effects.at_least_once)
        if d.external_key:
            extras.append(_one_key)
        return self._judging(
            contract,
            row=row,
            view=queue_view(contract),
            owner_writes=WRITES - {"enqueue"},
            heartbeats=frozenset({generic.EXTEND}),
            take_backs=frozenset({"reclaim_stale"}),
            creations=frozenset({"enqueue"}),
            done=done,
            extras=tuple(extras),
        )

    def prepare(self, env, ws) -> None:
        self.tables = ws.tables

    def versions(self, conn: psycopg.Connection, audits: list[Audit]) -> dict:
        """Each change's old and new row as the adapter's read_query reads it: the query run
        over that one version (each table of the schema shadowed by a common table expression
        holding the version, or nothing)."""
        shadows = sql.SQL(", ").join(
            sql.SQL(
                "{t} AS (SELECT r.* FROM jsonb_populate_record(NULL::{t}, v.row) r "
                "WHERE a.tbl = {name} AND v.row IS NOT NULL)"
            ).format(t=sql.Identifier(t), name=sql.Literal(t))
            for t in self.tables
        )
        query = sql.SQL(
            "SELECT a.id, v.side, to_jsonb(q) FROM soak_audit a "
            "CROSS JOIN LATERAL (VALUES ('old', a.old), ('new', a.new)) v(side, row) "
            "CROSS JOIN LATERAL (WITH {shadows} SELECT * FROM ({read}) q0) q "
            "WHERE a.id = ANY(%(ids)s)"
        ).format(shadows=shadows, read=sql.SQL(self.adapter.read_query))
        out = {}
        ids = [a.id for a in audits]
        for i in range(0, len(ids), 2000):
            for audit_id, side, r in conn.execute(query, {"ids": ids[i : i + 2000]}).fetchall():
                out[(audit_id, side)] = _run_row(r)
        return out

    def annotate(self, conn: psycopg.Connection, audits: list[Audit]) -> None:
        read = self.versions(conn, audits)
        for a in audits:
            new, old = read.get((a.id, "new")), read.get((a.id, "old"))
            a.seen = asdict(new) if new is not None else None
            a.was = asdict(old) if old is not None else None

    def current(self, conn: psycopg.Connection, keys=None) -> dict[str, RunRow]:
        query = sql.SQL("SELECT * FROM ({read}) q WHERE {where}").format(
            read=sql.SQL(self.adapter.read_query),
            where=sql.SQL("TRUE" if keys is None else "q.key::text = ANY(%(keys)s)"),
        )
        with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            rows = cur.execute(query, {"keys": list(keys or ())}).fetchall()
        return {r.key: r for r in map(_run_row, rows)}

    # -- the processes (in the worker process) -------------------------------------------------
    def store(self, spec: dict, log, check: type):
        adapter = check.adapter_class
        signals = adapter.lost_race

        def lost(name, value) -> bool:  # what a fenced or conditional write says when it missed
            return name in WRITES and signals.returned(value)

        cls = recording(adapter, log, lost, lambda name, e: signals.raised(e))
        store = cls(Timing(**spec["params"]["timing"]))
        if getattr(check, "adapter_queries", None) is not None:  # a mutant's edited SQL
            store.queries = dict(check.adapter_queries)
        return store

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        driver = Driver(spec, self.adapter.mode(), log)
        if spec["role"] == "reaper":
            return Reaper(driver, store, stop, spec["params"]["reap_every"])
        return Worker(self, spec, driver, store, stop, log)

    def produce(self, producer: Producer) -> None:
        state = producer.state
        if "driver" not in state:
            state["driver"] = Driver(producer.spec, self.adapter.mode(), None)
        driver, keys = state["driver"], state.setdefault("keys", [])
        if self.description.idempotency_key and keys and producer.rng.random() < 0.1:
            key = producer.rng.choice(keys[-20:])  # the same request again: the same run
        else:
            key = str(producer.key())
            keys.append(key)
        with contextlib.suppress(Exception):
            driver.call(producer.store.enqueue, key)


def _run_row(r) -> RunRow:
    row = as_row(r)
    lease = row.lease_until
    return RunRow(row.key, row.status, row.attempts, ts(lease) if lease is not None else None)


def _one_key(r) -> None:
    """Every external call for a run carries the same idempotency key (when the description
    says it does), so the other side can de-duplicate."""
    for run, sent in sorted(r.h.external.get("keys", {}).items()):
        if len(sent) > 1 or "" in sent:
            r.finding(
                "external-effect-semantics",
                f"run {run}: its external calls carried idempotency keys {sorted(sent)}; the "
                "same key on every call lets the other side de-duplicate",
                run,
            )


# ---------------------------------------------------------------------------------------
# The loops.
# ---------------------------------------------------------------------------------------


class Driver:
    """One connection of the adapter's kind (sync or async psycopg, tagged), opened lazily
    through the process's link and dropped after any error; coroutines run on its own loop."""

    def __init__(self, spec: dict, mode: str, log):
        self.spec, self.mode, self.log = spec, mode, log
        self.loop = asyncio.new_event_loop() if mode == "async" else None
        self._conn = None

    def run(self, value):
        return self.loop.run_until_complete(value) if inspect.isawaitable(value) else value

    def conn(self):
        c = self._conn
        if c is None or c.closed or c.broken:
            kw = dict(application_name=self.spec["app"], connect_timeout=3, prepare_threshold=None)
            dsn = self.spec["dsn"]
            if self.mode == "async":
                c = opened(self.log, lambda: self.run(AsyncTaggedConnection.connect(dsn, **kw)))
            else:
                c = opened(self.log, lambda: TaggedConnection.connect(dsn, **kw))
            self._conn = c
        return c

    def call(self, method, *args):
        """``method(conn, *args)``, run to its end; no transaction left open after it."""
        conn = self.conn()
        try:
            return self.run(method(conn, *args))
        except BaseException:
            self.drop()
            raise
        finally:
            if not conn.closed and conn.info.transaction_status != pq.TransactionStatus.IDLE:
                with contextlib.suppress(Exception):
                    self.run(conn.rollback())

    def drop(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            with contextlib.suppress(Exception):
                self.run(c.close())


class Reaper:
    """``reclaim_stale`` every ``every`` seconds."""

    def __init__(self, driver: Driver, adapter, stop: threading.Event, every: float):
        self.driver, self.adapter, self.stop, self.every = driver, adapter, stop, every

    def run(self) -> None:
        while not self.stop.wait(self.every):
            with contextlib.suppress(Exception):
                self.driver.call(self.adapter.reclaim_stale)
        self.driver.drop()


class Worker:
    """The described queue's worker loop: claim a batch; for each run, beat the heartbeat when
    it is due, make the external call, record the outcome. A run whose heartbeat or outcome was
    refused is no longer this worker's; an error drops the connection and the batch (its leases
    lapse and the reaper takes the runs back), as a process that dies would leave it."""

    def __init__(self, kind: DescribedSoak, spec: dict, driver, adapter, stop, log):
        self.kind, self.spec, self.driver, self.adapter = kind, spec, driver, adapter
        self.stop, self.log = stop, log
        self.p = spec["params"]
        self.timing = Timing(**self.p["timing"])
        self.rng = random.Random(f"{spec['seed']}:{spec['name']}:{spec['inc']}")
        self.events = kind.description.events()
        self.lost = adapter.lost_race
        self.stats = Counter()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                jobs = self.driver.call(self.adapter.claim, self.p["batch"])
            except Exception:
                jobs = None
            if not jobs or self.lost.returned(jobs):
                self.stop.wait(self.p["idle"])
                continue
            try:
                self.work(list(jobs))
            except Exception:
                self.stats["errors"] += 1
        self.driver.drop()

    def work(self, held: list) -> None:
        beat = time.monotonic()
        while held:
            if self.stop.is_set():
                return  # stopped mid-batch: the leases lapse, as a dying process leaves them
            beat = self.heartbeat(held, beat)
            if not held:
                return
            job = held.pop(0)
            answer = self.send(job) if self.kind.stand_in is not None else self.draw()
            if answer == OK:
                self.driver.call(self.adapter.complete, job)
            else:
                self.driver.call(self.adapter.fail, job, answer == PERMANENT)

    def heartbeat(self, held: list, beat: float) -> float:
        every = self.timing.heartbeat
        if not every or generic.EXTEND not in self.events or time.monotonic() - beat < every:
            return beat
        for job in list(held):
            if self.lost.returned(self.driver.call(self.adapter.extend_lease, job)):
                held.remove(job)  # no longer this worker's
        return time.monotonic()

    def draw(self) -> str:
        roll = self.rng.random()
        if roll < 0.05 and generic.FAIL in self.events:
            return PERMANENT
        if roll < 0.15 and self.kind.description.retry is not None:
            return RETRY
        return OK

    def send(self, job) -> str:
        """The external call, logged like an operation; its URL names the operation and the
        attempt (the receiver records them)."""
        serial = self.log.begin("send", {str(job.key): job.attempt}, {})
        ref = self.log.ref(serial)
        self.log.current = ref
        url = f"{self.spec['url']}/runs/{quote(str(job.key))}?ks-op={ref}&ks-token={job.attempt}"
        try:
            answer = self.driver.run(self.adapter.send(job, url))
        except no_answer_errors(type(self.adapter)) as e:
            self.log.end(serial, "ext-failed", detail=str(e)[:200])
            return RETRY  # no answer: it may have arrived; the run is tried again
        finally:
            self.log.current = None
        self.log.end(serial, answer)
        return answer
