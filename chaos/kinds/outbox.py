"""The outbox's model-versus-implementation check: the described queue's check of the outbox's
description (:mod:`knownstate.chaos.generic`), bound to the reference store, plus what only the
outbox has.

The outbox is a claim/lease/fence/retry queue, so everything the described queue's check does,
it does here: the worker loop's steps (claim a batch, send one delivery, record its outcome,
extend a lease), the reaper as a process of its own, a producer, a claim racing another worker's
open claim, concurrent blocks, a worker stalling past its lease, every fault. The model is the
described queue's, run from the description. Only the outbox's own part is written here: a
worker records its whole batch in one statement, each row fenced on its own claimed attempt
(``record_batch``), and a batch whose rows were claimed at different attempts (a retry due
beside a first try) is reached on purpose (``mixed_batch``), since a batch fenced on its first
row's attempt only shows there.
"""

from __future__ import annotations

import http.client
import threading
from functools import partial

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.impl import errors, loops
from knownstate.impl import outbox as impl
from knownstate.model import outbox as model
from knownstate.model.contract import LostRace, Rejected, Won, Write

from .. import effects, rows
from ..adapter import OK, PERMANENT, RETRY, Adapter, Claimed
from ..generic import kind, required_events
from ..history import Audit
from ..judge import Judging, RunRow
from ..soakkinds import Producer, SoakKind, queue_view, recording, ts

CHECKED = model.DESCRIPTION.model_copy(
    update={"retry": model.DESCRIPTION.retry.model_copy(update={"max_attempts": 2})}
)
"""The outbox as the check runs it: two attempts at most keep "dead" within reach of a short
program (the reference default is three)."""

ANSWERS = {impl.OK: OK, impl.RETRYABLE: RETRY, impl.PERMANENT: PERMANENT}


class OutboxAdapter(Adapter):
    """The reference outbox (:mod:`knownstate.impl.outbox`) bound as any queue is."""

    schema = impl.SCHEMA
    queries = impl.queries.load("outbox.sql")
    read_query = (
        "SELECT id::text AS key, status, attempts, next_attempt_at AS due, lease_until"
        " FROM outbox_delivery"
    )
    guards = {
        "fence": "AND attempts = %(attempt)s",
        "skip_locked": "SKIP LOCKED",
        "lease": "AND lease_until <= now()",
    }
    store_class: type[impl.OutboxStore] = impl.OutboxStore  # a mutant's replaces it

    def store(self) -> impl.OutboxStore:
        t = self.timing
        config = model.Config(t.lease, t.backoff_base, t.backoff_cap, t.max_attempts)
        return self.store_class(config, self.queries)

    def enqueue(self, conn, key):  # an id taken: another producer's event won the race
        return self.store().enqueue(conn, int(key)) != Rejected(model.DUPLICATE_ID)

    def claim(self, conn, batch):
        return [Claimed(str(c.id), c.attempt, c) for c, _ in self.store().claim_batch(conn, batch)]

    def extend_lease(self, conn, job):
        return self.store().extend_lease(conn, job.handle)

    def complete(self, conn, job):
        return self.store().complete(conn, job.handle)

    def fail(self, conn, job, permanent):
        return self.store().fail(conn, job.handle, permanent, "failed")

    def reclaim_stale(self, conn):
        return [str(i) for i in self.store().reclaim_stale(conn).value]

    def send(self, job, url):
        return ANSWERS[impl.send_to_sink(url, job.handle, timeout=5)]


class OutboxCheck(kind(CHECKED, OutboxAdapter)):
    """The described queue's check of the outbox, with its batched record."""

    store_class: type[impl.OutboxStore] = impl.OutboxStore  # the mutant catalogue replaces it
    required_events = required_events(CHECKED, OutboxAdapter.mode()) + ("batch of mixed attempts",)

    def reset_example(self) -> None:
        super().reset_example()
        self.adapter.store_class = self.store_class

    def _batch_holders(self) -> list[int]:
        """Workers holding two runs or more they called out for: a batch to record."""
        sent = [w for w, _ in self._holding(sent=True)]
        return sorted({w for w in sent if sent.count(w) > 1})

    @precondition(lambda self: self._batch_holders())
    @rule(data=st.data())
    def record_batch(self, data) -> None:
        """The batched fenced write: a worker records every delivery it has sent (two or more)
        in one statement, each row fenced on its own claimed attempt; a stale row loses alone."""
        self._record_batch(data, rows.row(data, self._batch_holders(), "worker"))

    def _mixed_due(self) -> list[int]:
        """Idle workers, when a claim of three would take deliveries at different attempts (a
        retry and a first try): where a batch's rows carry different fence tokens."""
        if len({r.attempts for r in self.model.due()[:3]}) < 2:
            return []
        return [w for w in (0, 1) if not self.held[w]]

    @precondition(lambda self: self._mixed_due())
    @rule(data=st.data())
    def mixed_batch(self, data) -> None:
        """A worker's loop over a batch whose rows were claimed at different attempts: claim,
        send each, record them in one statement. Each row must be fenced on its own attempt;
        reached on purpose, since it takes a retry due beside a first try."""
        w = rows.row(data, self._mixed_due(), "worker")
        self.do(w, self._claim(w, 3))
        for key in self._mine(w, sent=False):
            answer = data.draw(st.sampled_from(self._answers()), label="sink answers")
            self.do(w, self._send(w, key, answer))
        if len(self._mine(w, sent=True)) > 1:
            self._record_batch(data, w)

    def _record_batch(self, data, w: int) -> None:
        sent = self._mine(w, sent=True)
        keys = data.draw(st.permutations(sent), label="deliveries")  # all it sent, in any order
        worker, held = self.workers[w], [self.held[w].pop(k) for k in keys]
        results = [{OK: impl.OK, RETRY: impl.RETRYABLE}.get(h.result, impl.PERMANENT) for h in held]
        reports = [model.Report(h.claimed.handle, r) for h, r in zip(held, results)]
        if len({h.job.attempt for h in held}) > 1:
            self.event("batch of mixed attempts")
        shown = ", ".join(f"{h.job.key}@{h.job.attempt} {r}" for h, r in zip(held, results))
        owners = [(h.job.key, h.job.attempt, self.model.owns(h.job)) for h in held]

        def model_op(m):
            self.owing = frozenset(h.job.key for h, r in zip(held, results) if r != impl.OK)
            return Won(
                tuple(
                    m.complete(h.job) if r == impl.OK else m.fail(h.job, r == impl.PERMANENT)
                    for h, r in zip(held, results)
                )
            )

        def impl_op(conn):
            got = self.adapter.store().record_batch(conn, reports, results)
            if not isinstance(got, Won):
                return got
            rows = tuple(
                LostRace("fenced") if isinstance(r, LostRace) else Won() for r in got.value
            )
            for (run, token, owner), row in zip(owners, rows):  # each row a fenced write
                self.writes.append(Write(run, token, isinstance(row, Won), owner))
            return Won(rows)

        got = self.apply(
            worker,
            f"record_batch(w{w}, {shown})",
            model_op,
            impl_op,
            on_error=lambda: self.forget(worker),
        )
        for row in got.value if isinstance(got, Won) else ():
            if isinstance(row, LostRace):
                self.event("fence rejection")


# ---------------------------------------------------------------------------------------
# The soak binding: what a soak runs, and how its judge reads the rows.
# ---------------------------------------------------------------------------------------


class OutboxSoak(SoakKind):
    name = "outbox"
    params = {
        "lease": 3,
        "backoff_base": 1,
        "backoff_cap": 4,
        "max_attempts": 4,
        "batch": 10,
        "idle": 0.05,
        "http_timeout": 2.0,
        "reap_every": 0.5,
        "rate": 25.0,
    }
    refusals = (503, 503, 422)
    lease = 3.0
    nudge = 3 + 4 + 1
    writes_bound = 1
    run_tables = ("outbox_delivery",)

    description = model.DESCRIPTION

    def __init__(self) -> None:
        from ..soakparts import RecordingSink

        self.stand_in = RecordingSink

    def judging(self, config: dict) -> Judging:
        contract = OutboxCheck.contract

        def row(a: Audit, old: bool) -> RunRow | None:
            r = a.old if old else a.new
            if a.table != "outbox_delivery" or r is None:
                return None
            return RunRow(str(r["id"]), r["status"], r["attempts"], ts(r.get("lease_until")))

        return self._judging(
            contract,
            row=row,
            view=queue_view(contract),
            owner_writes=frozenset({"complete", "fail", "record_batch", "extend_lease"}),
            heartbeats=frozenset({"extend_lease"}),
            take_backs=frozenset({"reclaim_stale"}),
            creations=frozenset({"enqueue"}),
            done="sent",
            extras=(effects.at_least_once,),
        )

    def store(self, spec: dict, log, check: type):
        p = spec["params"]
        config = model.Config(p["lease"], p["backoff_base"], p["backoff_cap"], p["max_attempts"])
        return recording(check.store_class, log)(config, getattr(check, "queries", None))

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        """The reaper, or the outbox's reference loop unchanged, with a send that logs."""
        p = spec["params"]
        if spec["role"] == "reaper":
            return loops.Periodic(
                connect, store.reclaim_stale, stop, idle=p["reap_every"], autocommit=True
            )
        send = partial(_logged_send, spec, log)
        return impl.OutboxWorker(connect, store, send, stop, batch=p["batch"], idle=p["idle"])

    def produce(self, producer: Producer) -> None:
        state = producer.state
        delivery = state.pop("again", None) or producer.key()
        try:
            producer.store.enqueue(producer.conn(), delivery, {"to": f"user{delivery}"})
        except (errors.CommitIndeterminate, errors.ConnectionLost):
            state["again"] = delivery  # enqueue it again: a duplicate id is refused, never doubled
            raise
        except errors.TransactionAborted:
            pass  # the earlier, indeterminate enqueue of this id had landed


def _logged_send(spec: dict, log, claim, payload) -> str:
    """The soak's send: ``send_to_sink``, logged. It lets a reply cut mid-body escape as
    ``http.client``'s own error; here that is ExternalCallFailed, like every other lost reply."""
    serial = log.begin("send", {str(claim.id): claim.attempt}, {})
    log.current = log.ref(serial)
    try:
        result = impl.send_to_sink(
            spec["url"], claim, payload, timeout=spec["params"]["http_timeout"]
        )
    except (errors.ExternalCallFailed, http.client.HTTPException) as e:
        log.end(serial, "ext-failed", detail=str(e)[:200])
        raise errors.ExternalCallFailed(f"sink: {e}") from None
    finally:
        log.current = None
    log.end(serial, result)
    return result


CHECK = OutboxCheck
SOAK = OutboxSoak


# ---------------------------------------------------------------------------------------
# Mutants: realistic bugs, each caught by this check (see `knownstate mutants outbox`).
# ---------------------------------------------------------------------------------------

from datetime import datetime, timezone  # noqa: E402

from ..mutants import Mutant, sql_edit, with_attrs  # noqa: E402

_Q = impl.queries.load("outbox.sql")


def _edit(name: str, old: str, new: str):
    return with_attrs(queries=sql_edit(_Q, name, old, new))


class _AppClockReaper(impl.OutboxStore):
    """The reaper judges leases by the application's clock, not the database's."""

    def reclaim_stale(self, conn):
        q = sql_edit(self.q, "reclaim_stale", "lease_until <= now()", "lease_until <= %(app_now)s")[
            "reclaim_stale"
        ]
        rows = self._one_tx(
            conn,
            "reclaim_stale",
            q,
            {"max_attempts": self.config.max_attempts, "app_now": datetime.now(timezone.utc)},
        )
        return Won(tuple(sorted(r[0] for r in rows)))


class _AppClockLease(impl.OutboxStore):
    """The claim stamps the lease from the application's clock, not the database's."""

    def begin_claim(self, conn, batch):
        q = sql_edit(
            self.q, "claim_due", "lease_until = now() +", "lease_until = %(app_now)s::timestamptz +"
        )["claim_due"]
        with errors.boundary("outbox.claim"):
            rows = conn.execute(
                q,
                {"batch": batch, "lease": self.config.lease, "app_now": datetime.now(timezone.utc)},
            ).fetchall()
        return sorted(((model.Claim(r[0], r[1]), r[2]) for r in rows), key=lambda c: c[0].id)


MUTANTS = [
    Mutant(
        "unfenced-complete",
        "outbox",
        "lease-fence",
        "the terminal write does not match attempts = <claimed attempt>",
        _edit("complete", "AND attempts = %(attempt)s", ""),
    ),
    Mutant(
        "unconditional-complete",
        "outbox",
        "conditional-transition",
        "the terminal write is not conditional on status = 'processing'",
        _edit("complete", "AND status = 'processing' ", ""),
    ),
    Mutant(
        "unfenced-retry",
        "outbox",
        "lease-fence",
        "a failed send is recorded without the attempts fence",
        _edit(
            "fail",
            "AND status = 'processing' AND attempts = %(attempt)s",
            "AND status = 'processing'",
        ),
    ),
    Mutant(
        "claim-without-bump",
        "outbox",
        "lease-fence",
        "the claim does not bump attempts, so the fence token never changes",
        _edit("claim_due", "attempts = d.attempts + 1", "attempts = d.attempts"),
    ),
    Mutant(
        "claim-without-skip-locked",
        "outbox",
        "claim",
        "the claim waits on rows another worker is claiming (FOR UPDATE without SKIP LOCKED)",
        _edit("claim_due", "FOR UPDATE SKIP LOCKED", "FOR UPDATE"),
    ),
    Mutant(
        "reaper-app-clock",
        "outbox",
        "lease",
        "the reaper compares leases with the application clock (the database clock stamped them)",
        with_attrs(store_class=_AppClockReaper),
        needs=("db-clock",),
    ),
    Mutant(
        "lease-app-clock",
        "outbox",
        "lease",
        "the claim stamps its lease with the application clock "
        "(the reaper reads the database clock)",
        with_attrs(store_class=_AppClockLease),
        needs=("db-clock",),
    ),
    Mutant(
        "reaper-ignores-lease",
        "outbox",
        "lease",
        "the reaper takes back every processing row, live leases included",
        _edit("reclaim_stale", "AND lease_until <= now()", ""),
    ),
    Mutant(
        "reaper-touches-terminal",
        "outbox",
        "terminal-answers-from-receipts",
        "the reaper treats a missing lease as lapsed and does not check the status",
        _edit(
            "reclaim_stale",
            "WHERE status = 'processing' AND lease_until <= now()",
            "WHERE status <> 'pending' AND coalesce(lease_until, '-infinity') <= now()",
        ),
    ),
    Mutant(
        "no-backoff",
        "outbox",
        "retry-policy",
        "a retry is due at once instead of after an exponential backoff",
        _edit(
            "fail",
            "ELSE now() + make_interval(secs => least(%(cap)s, %(base)s * 2 ^ "
            "greatest(attempts - 1, 0)))",
            "ELSE now()",
        ),
    ),
    Mutant(
        "batch-fenced-on-first-row",
        "outbox",
        "lease-fence",
        "the batched completion matches every row against the first row's claimed attempt",
        _edit(
            "record_batch",
            "AND d.attempts = b.attempt",
            "AND d.attempts = (%(attempts)s::integer[])[1]",
        ),
    ),
    Mutant(
        "never-dead",
        "outbox",
        "retry-policy",
        "a failed send is retried forever: never dead at max attempts",
        _edit("fail", "WHEN attempts >= %(max_attempts)s THEN 'dead'", "WHEN false THEN 'dead'"),
    ),
]

# ---------------------------------------------------------------------------------------
# Race mutants: read-then-write bugs only a concurrent block reaches (:mod:`..races`).
# ---------------------------------------------------------------------------------------

from typing import Any  # noqa: E402

import psycopg  # noqa: E402

from ..races import Call, RaceMutant, Scenario, Variant  # noqa: E402
from ..races import QUANTUM as RACE_QUANTUM  # noqa: E402


class ClaimReadThenWrite(impl.OutboxStore):
    """The claim reads the due rows in one statement (no ``FOR UPDATE``) and writes each row by
    id in another, with ``attempts`` computed from what it read: a read-modify-write split
    across two statements without a row lock."""

    DUE = (
        "SELECT id, attempts, payload FROM outbox_delivery\n"
        "WHERE status = 'pending' AND next_attempt_at <= now() ORDER BY id LIMIT %(batch)s"
    )
    TAKE = (
        "UPDATE outbox_delivery SET status = 'processing', attempts = %(attempts)s,\n"
        "    lease_until = now() + make_interval(secs => %(lease)s)\n"
        "WHERE id = %(id)s RETURNING id, attempts, payload"
    )

    def begin_claim(self, conn: psycopg.Connection, batch: int) -> list:
        with errors.boundary("outbox.claim"):
            due = conn.execute(self.DUE, {"batch": batch}).fetchall()
            claimed = []
            for id_, attempts, _payload in due:
                row = conn.execute(
                    self.TAKE, {"id": id_, "attempts": attempts + 1, "lease": self.config.lease}
                ).fetchone()
                claimed.append((model.Claim(row[0], row[1]), row[2]))
        return sorted(claimed, key=lambda c: c[0].id)


class CompleteReadsAttemptFirst(impl.OutboxStore):
    """The completion reads the row's status and attempt in one statement, checks the claim in
    Python, then writes ``sent`` guarded on the status alone: the attempts fence is in the read,
    not in the write."""

    READ = "SELECT status, attempts FROM outbox_delivery WHERE id = %(id)s"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(self.q, "complete", "AND attempts = %(attempt)s", "")

    def complete(self, conn: psycopg.Connection, c: model.Claim) -> Any:
        with errors.boundary("outbox.complete"):
            row = conn.execute(self.READ, {"id": c.id}).fetchone()
            if row is None or row[0] != model.Status.PROCESSING or row[1] != c.attempt:
                conn.rollback()
                return LostRace("fenced")
        return super().complete(conn, c)


RACE_CONFIG = model.Config(
    lease=5 * RACE_QUANTUM, backoff_base=RACE_QUANTUM, backoff_cap=60 * RACE_QUANTUM, max_attempts=3
)
_CLAIMED = model.Claim(1, 1)


def _scenario(
    name: str, block: tuple[Call, ...], setup: tuple[Call, ...] = (), jump: int = 0
) -> Scenario:
    return Scenario(
        name,
        "outbox",
        impl.SCHEMA,
        impl.TABLES,
        new_model=lambda: model.OutboxModel(RACE_CONFIG),
        new_store=lambda cls, worker, _: cls(RACE_CONFIG),
        project=impl.project,
        project_model=lambda m: m.state(),
        block=block,
        setup=setup,
        jump=jump,
        reference_store=impl.OutboxStore,
        fingerprint=lambda m: (m.now, m.state(), m._next_id),
    )


_ENQUEUE = Call.alike("w0", "enqueue(1)", "enqueue", 1)


def _claim_one(worker: str) -> Call:
    return Call.alike(worker, "claim(batch=1)", "claim", 1)


RACES = (
    RaceMutant(
        "claim-read-then-write",
        "outbox",
        "claim",
        "the claim SELECTs due rows without a row lock, then UPDATEs each by id with attempts + 1 "
        "computed from the read: two workers both claim the row, with the same attempt",
        Variant("claim-read-then-write", ClaimReadThenWrite),
        _scenario(
            "outbox: two claims of one due row",
            setup=(_ENQUEUE,),
            block=(_claim_one("w0"), _claim_one("w1")),
        ),
        "one claim after the other: the second one's SELECT already sees the row processing and "
        "claims nothing. Only w1's SELECT between w0's SELECT and w0's COMMIT reads it pending.",
    ),
    RaceMutant(
        "complete-reads-attempt-first",
        "outbox",
        "lease-fence",
        "the completion reads status and attempt in one statement, then writes 'sent' guarded on "
        "status alone: a stale owner completes the row another worker claimed since",
        Variant("complete-reads-attempt-first", CompleteReadsAttemptFirst),
        _scenario(
            "outbox: a stale owner completes while the reaper and another worker move on",
            setup=(_ENQUEUE, _claim_one("w0")),
            jump=RACE_CONFIG.lease,
            block=(
                Call.alike("w0", "complete(1, attempt=1)", "complete", _CLAIMED),
                Call.alike("w1", "reclaim_stale()", "reclaim_stale"),
                _claim_one("w2"),
            ),
        ),
        "in any order of whole operations the read sees the attempt the write will meet: the "
        "reclaim and the new claim (attempt 2) must both commit between w0's read and its write.",
    ),
)

MUTANTS += [r.mutant() for r in RACES]

OutboxCheck.mutants = MUTANTS
