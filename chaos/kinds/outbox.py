"""The outbox's model-versus-implementation check.

Rules are the worker loop's own steps — claim a batch, send one delivery to the sink, record
its outcome (fenced), extend a lease — plus the reaper, a producer's enqueue, a claim racing
another worker's open claim (SKIP LOCKED), a worker stalling past its lease, and the faults of
:class:`~knownstate.chaos.check.KindCheck`. The sink is part of the observation: the model
predicts what it recorded, so a duplicate is seen, counted, and allowed (at-least-once).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from knownstate.impl import errors
from knownstate.impl import outbox as impl
from knownstate.impl.errors import ExternalCallFailed
from knownstate.model import outbox as model
from knownstate.model.contract import LostRace, RetryView, Won, Write

from ..check import QUANTUM, Candidate, FaultPolicy, KindCheck, Action, fmt, needs
from ..sink import NotificationSink


@dataclass
class Held:
    """A claim a worker holds in memory, and the sink's answer once it sent."""

    claim: model.Claim
    result: str | None = None


SINK_ANSWERS = {200: impl.OK, 503: impl.RETRYABLE, 422: impl.PERMANENT}
RECLAIMED = "lease expired"  # what the reaper writes as last_error: a reclaim is due at once


class OutboxCheck(KindCheck):
    kind = "outbox"
    contract = model.CONTRACT
    schema = impl.SCHEMA
    n_workers = 3  # w0, w1 run the worker loop; w2 is a reaper process (its own connection)
    REAPER = 2
    # max_attempts 2 keeps "dead" within reach of a short program; the reference default is 3.
    config = model.Config(
        lease=5 * QUANTUM, backoff_base=QUANTUM, backoff_cap=60 * QUANTUM, max_attempts=2
    )
    policy = FaultPolicy(gap=1, heal_after=6, stall=config.lease + QUANTUM, reply_lost=True)
    lock_wait_breaks = "claim"
    store_class = impl.OutboxStore
    queries: dict[str, str] | None = None  # the mutant catalogue replaces some
    required_events = (  # a reclaim, and the fence it arms, need a lease to lapse
        "lost race",
        needs("fence rejection", "time-shift"),
        needs("reclaim", "time-shift"),
        "backoff",
        "skip locked",
        "worker died before commit",
        "connection lost",
        "indeterminate commit",
        "indeterminate resolved: committed",
        "indeterminate resolved: not committed",
        "duplicate delivery",
        "sink reply lost",
        *(
            f"fence refusal: {op} ({why})"
            for op in ("complete", "fail", "extend_lease")
            for why in ("re-claimed", "no longer claimed")
        ),
        needs("concurrent block", "concurrency"),
        needs("lock wait in a block", "concurrency"),
        "batch of mixed attempts",
    )

    # -- hooks ----------------------------------------------------------------------------
    def reset_example(self) -> None:
        self.sink = self.env.stand_in("sink", NotificationSink)
        self.sink.reset()
        self.store = self.store_class(self.config, self.queries)
        self.held: list[dict[int, Held]] = [{} for _ in self.workers]
        for w in self.workers[:2]:  # the reaper process never calls the sink
            w.sink_link = self.env.api.link(f"outbox-{w.name}-sink", self.sink.host, self.sink.port)
            w.links = [w.link, w.sink_link]
        self._duplicates = 0
        self._reclaimed: set[int] = set()

    def new_model(self) -> model.OutboxModel:
        return model.OutboxModel(self.config)

    def observe_model(self, m: model.OutboxModel):
        return m.state(), tuple(sorted(m.received.items()))

    def observe_impl(self):
        conn = self.ws.admin()
        rows = impl.project(conn, self.to_model_time)
        self._reclaimed = {
            r[0]
            for r in conn.execute(
                "SELECT id FROM outbox_delivery WHERE last_error = %s", (RECLAIMED,)
            ).fetchall()
        }
        return rows, tuple(sorted(self.sink.received().items()))

    def views(self, observation):
        """The contract's views, with where each delivery stands against the retry policy and
        what its lease has left by the database clock (a claim grants the whole lease)."""
        rows, received = observation
        out = model.views(rows, dict(received))
        now = self.model.now
        for d in rows:
            waiting = d.status == model.P and d.attempts > 0
            owed = 0 if d.id in self._reclaimed else self.config.backoff(d.attempts)
            owned = d.status == model.R and d.lease_until is not None
            out[str(d.id)] = replace(
                out[str(d.id)],
                retry=RetryView(
                    d.attempts,
                    self.config.max_attempts,
                    waiting,
                    due_in=max(0, d.next_attempt_at - now),
                    owed=owed if waiting else 0,
                ),
                lease_left=d.lease_until - now if owned else None,
                lease_granted=self.config.lease if owned else None,
            )
        return out

    def observed(self, m: model.OutboxModel) -> None:
        dups = sum(n - 1 for n in m.received.values())
        self.event("duplicate delivery", max(0, dups - self._duplicates))
        self._duplicates = dups

    def clock_matters(self) -> bool:
        """Time can change something: a backoff to wait out, or a lease nobody alive holds to
        lapse. (A stall covers leases that a living worker holds.)"""
        held = {i for _, i in self._holding()}
        return any(
            (d.status == model.R and d.id not in held)
            or (d.status == model.P and d.next_attempt_at > self.model.now)
            for d in self.model.deliveries.values()
        )

    def forget(self, worker) -> None:
        self.held[worker.index].clear()

    def lost(self, worker, error) -> None:
        """A worker whose operation failed on a fault starts over: it holds nothing."""
        self.forget(worker)

    # -- concurrent blocks ---------------------------------------------------------------------
    def offers(self, w: int) -> list[Action]:
        """What worker ``w`` can start together with the others: an enqueue of the next event id
        (two producers with one id: the second waits on the first's insert, then is refused), a
        claim, the fenced write of a delivery it sent, a lease extension while it sends; the
        reaper process reaps (so a stale owner's write can meet both a reclaim and a new claim
        of its row)."""
        if w == self.REAPER:
            return [self._reap()]
        out = [self._enqueue(self.model.next_id())] if self._waiting() < 3 else []
        out += [self._claim(w, b) for b in (1, 2, 3)]
        for i, h in sorted(self.held[w].items()):
            # sent: the loop records it next (a heartbeat only runs while sending)
            out.append(self._record(w, i) if h.result is not None else self._extend(w, i))
        return out

    # -- the operations, each written once: the rules and the blocks draw from these ------------
    def _enqueue(self, i: int) -> Action:
        """A producer's event ``i`` (a retried one: the id taken is refused)."""
        return Action(
            "enqueue",
            f"enqueue(id={i})",
            lambda m: m.enqueue(i),
            lambda c: self.store.enqueue(c, i),
            runs=frozenset({("new", i)}),
        )

    def _claim(self, w: int, batch: int) -> Action:
        """A claim of up to ``batch`` due deliveries; among others SKIP LOCKED may skip rows
        another claim holds. Its runs: the due rows, and the lapsed ones it takes once reclaimed."""
        now, rows = self.model.now, self.model.deliveries.values()
        due = frozenset(d.id for d in rows if d.status == model.P and d.next_attempt_at <= now)
        lapsed = frozenset(d.id for d in rows if d.status == model.R and d.lease_until <= now)
        reach = frozenset(sorted(due | lapsed)[:batch]) & lapsed

        def after(got) -> None:
            for c in got.value if isinstance(got, Won) else ():
                self.held[w][c.id] = Held(c)

        return Action(
            "claim",
            f"claim(batch={batch})",
            lambda m: m.claim(batch),
            lambda c: self.store.claim(c, batch),
            after=after,
            on_error=lambda: self.forget(self.workers[w]),
            guarantee="claim",
            among_others=lambda m, got: m.claim_skipping(
                batch, tuple(c.id for c in got.value) if isinstance(got, Won) else ()
            ),
            runs=due | reach,
            once_freed=reach,
        )

    def _record(self, w: int, i: int) -> Action:
        """The fenced write after the send: complete, or fail (retry with backoff / dead /
        failed)."""
        h = self.held[w][i]
        c, result = h.claim, h.result

        def after(got) -> None:
            self.held[w].pop(i, None)
            if isinstance(got, LostRace):
                self.event("fence rejection")
            elif got == Won(model.P):
                self.event("backoff")

        if result == impl.OK:
            label, model_op = f"complete({i}, attempt={c.attempt})", (lambda m: m.complete(c))
            impl_op = lambda conn: self.store.complete(conn, c)  # noqa: E731
        else:
            permanent = result == impl.PERMANENT
            label = f"fail({i}, attempt={c.attempt}, permanent={permanent})"
            model_op = lambda m: m.fail(c, permanent)  # noqa: E731
            impl_op = lambda conn: self.store.fail(conn, c, permanent, result)  # noqa: E731
        return Action(
            "record",
            label,
            model_op,
            impl_op,
            after=after,
            on_error=lambda: self.forget(self.workers[w]),
            fence=lambda: self._fence(c),
            runs=frozenset({i}),
        )

    def _extend(self, w: int, i: int) -> Action:
        c = self.held[w][i].claim

        def after(got) -> None:
            if isinstance(got, LostRace):
                self.event("fence rejection")
                self.held[w].pop(i, None)

        return Action(
            "extend_lease",
            f"extend_lease({i}, attempt={c.attempt})",
            lambda m: m.extend_lease(c),
            lambda conn: self.store.extend_lease(conn, c),
            after=after,
            on_error=lambda: self.forget(self.workers[w]),
            fence=lambda: self._fence(c),
            runs=frozenset({i}),
        )

    def _reap(self) -> Action:
        now, rows = self.model.now, self.model.deliveries.values()
        lapsed = frozenset(d.id for d in rows if d.status == model.R and d.lease_until <= now)

        def after(got) -> None:
            if isinstance(got, Won) and got.value:
                self.event("reclaim", len(got.value))

        return Action(
            "reclaim_stale",
            "reclaim_stale()",
            lambda m: m.reclaim_stale(),
            lambda c: self.store.reclaim_stale(c),
            after=after,
            guarantee="lease",
            runs=lapsed,
        )

    # -- the fault policy's questions -------------------------------------------------------------
    def turns(self, w: int) -> list[str]:
        """A worker's next step of its loop: record what it sent, send what it holds, or claim."""
        held = self.held[w].values()
        if any(h.result is not None for h in held):
            return ["record"]
        if held:
            return ["send"]
        due = any(
            d.status == model.P and d.next_attempt_at <= self.model.now
            for d in self.model.deliveries.values()
        )
        return ["claim"] if due else []

    def turn(self, w: int, data) -> None:
        step = self.turns(w)[0]
        if step == "record":
            i = data.draw(st.sampled_from(self._mine(w, sent=True)), label="delivery")
            self.do(w, self._record(w, i))
        elif step == "send":
            d = data.draw(st.sampled_from(self._mine(w, sent=False)), label="delivery")
            self._send(w, d, data.draw(st.sampled_from([200, 503, 422]), label="sink answers"))
        else:
            self.do(w, self._claim(w, 3))

    def leases(self) -> list[int]:
        """Workers holding a live lease; those that sent a delivery and have not recorded it yet
        when there are any: a stall between the send and the record is where a stale owner's
        terminal write meets the reaper and a new owner."""
        live = {
            d.id
            for d in self.model.deliveries.values()
            if d.status == model.R and d.lease_until > self.model.now
        }
        sent = sorted({w for w, i in self._holding(sent=True) if i in live})
        return sent or sorted({w for w, i in self._holding() if i in live})

    def next_write(self, w: int, data) -> frozenset:
        """The write a worker's loop makes next is the record of a delivery it sent: one that
        sent nothing yet sends a delivery it holds first. The runs: those it sent."""
        if not self._mine(w, sent=True) and self._mine(w, sent=False):
            d = data.draw(st.sampled_from(self._mine(w, sent=False)), label="delivery")
            self._send(w, d, data.draw(st.sampled_from([200, 503, 422]), label="sink answers"))
        return frozenset(self._mine(w, sent=True))

    def meanwhile(self, w: int, data) -> None:
        """While ``w`` is frozen the reaper runs, or not, and the other worker claims again, or
        not: a stale owner resumes on a row still pending, re-claimed, or never reclaimed."""
        other = 1 - w
        if data.draw(st.booleans(), label="reaper runs"):
            self.do(other, self._reap())
            if data.draw(st.booleans(), label="the other worker claims"):
                self.do(other, self._claim(other, 3))

    # -- helpers ----------------------------------------------------------------------------
    def _holding(self, sent: bool | None = None) -> list[tuple[int, int]]:
        return [
            (w, i)
            for w, held in enumerate(self.held)
            for i, h in sorted(held.items())
            if sent is None or (h.result is not None) == sent
        ]

    def _mine(self, w: int, sent: bool) -> list[int]:
        return [i for x, i in self._holding(sent) if x == w]

    def _fence(self, c: model.Claim) -> tuple[int, int, bool]:
        """A write by the holder of claim ``c``: does it still own the row (attempt unchanged)?"""
        d = self.model.deliveries.get(c.id)
        return c.id, c.attempt, d is not None and d.status == model.R and d.attempts == c.attempt

    def _pick(self, data, sent: bool | None = None) -> tuple[int, int]:
        return data.draw(st.sampled_from(self._holding(sent)), label="worker, delivery")

    # -- operations -------------------------------------------------------------------------
    @initialize(n=st.integers(1, 4))
    def enqueue_some(self, n: int) -> None:
        """Every example starts with a few deliveries waiting, so work flows from the first step."""
        for _ in range(n):
            self.do(0, self._enqueue(self.model.next_id()))

    def _waiting(self) -> int:
        return sum(d.status == model.P for d in self.model.deliveries.values())

    @precondition(lambda self: self._waiting() < 3)
    @rule(w=st.integers(0, 1))
    def enqueue(self, w: int) -> None:
        self.do(w, self._enqueue(self.model.next_id()))

    @rule(w=st.integers(0, 1), batch=st.integers(1, 3))
    def claim(self, w: int, batch: int) -> None:
        self.do(w, self._claim(w, batch))

    @precondition(lambda self: self._holding(sent=False))
    @rule(data=st.data(), answer=st.sampled_from([200, 503, 422]))
    def send(self, data, answer: int) -> None:
        """The external effect: POST to the sink through this worker's own link. At-least-once."""
        self._send(*self._pick(data, sent=False), answer)

    def _send(self, w: int, delivery: int, answer: int) -> None:
        h = self.held[w][delivery]
        worker = self.workers[w]
        self.start_step()
        trial = self.model.copy()
        trial.sink_received(h.claim.id)
        self.sink.plan(answer)
        label = f"send(w{w}, {h.claim.id}, attempt={h.claim.attempt}) sink answers {answer}"
        try:
            with self.external_call(worker):
                h.result = impl.send_to_sink(
                    f"http://127.0.0.1:{worker.sink_link.port}", h.claim, timeout=5
                )
        except ExternalCallFailed:
            # No answer: the sink may or may not have recorded it. The worker treats it as
            # retryable.
            h.result = impl.RETRYABLE
            self.log(f"{label} -> no answer; it may have arrived")
            self.event("sink reply lost")
            self.maybe(Candidate(self.model, external=False), Candidate(trial, external=True))
        else:
            self.log(f"{label} -> {h.result}")
            if h.result != SINK_ANSWERS[answer]:
                self.fail(f"{label}: the worker read the answer as {h.result}")
            self.model = trial
            self.candidates = [Candidate(trial)]
        finally:
            self.sink.reset_plan()

    @precondition(lambda self: self._holding(sent=True))
    @rule(data=st.data())
    def record(self, data) -> None:
        """The fenced write after the send: complete, or fail (retry with backoff / dead /
        failed)."""
        w, i = self._pick(data, sent=True)
        self.do(w, self._record(w, i))

    def _batch_holders(self) -> list[int]:
        """Workers holding two sent deliveries or more: a batch to record."""
        sent = [w for w, _ in self._holding(sent=True)]
        return sorted({w for w in sent if sent.count(w) > 1})

    @precondition(lambda self: self._batch_holders())
    @rule(data=st.data())
    def record_batch(self, data) -> None:
        """The batched fenced write: a worker records every delivery it has sent (two or more)
        in one statement, each row fenced on its own claimed attempt; a stale row loses alone."""
        self._record_batch(data, data.draw(st.sampled_from(self._batch_holders()), label="worker"))

    def _mixed_due(self) -> list[int]:
        """Idle workers, when a claim of three would take deliveries at different attempts (a
        retry and a first try): where a batch's rows carry different fence tokens."""
        due = [
            d
            for _, d in sorted(self.model.deliveries.items())
            if d.status == model.P and d.next_attempt_at <= self.model.now
        ][:3]
        if len({d.attempts for d in due}) < 2:
            return []
        return [w for w in (0, 1) if not self.held[w]]

    @precondition(lambda self: self._mixed_due())
    @rule(data=st.data())
    def mixed_batch(self, data) -> None:
        """A worker's loop over a batch whose rows were claimed at different attempts: claim,
        send each, record them in one statement. Each row must be fenced on its own attempt;
        reached on purpose, since it takes a retry due beside a first try."""
        w = data.draw(st.sampled_from(self._mixed_due()), label="worker")
        self.do(w, self._claim(w, 3))
        for d in self._mine(w, sent=False):
            self._send(w, d, data.draw(st.sampled_from([200, 503, 422]), label="sink answers"))
        if len(self._mine(w, sent=True)) > 1:
            self._record_batch(data, w)

    def _record_batch(self, data, w: int) -> None:
        sent = [i for v, i in self._holding(sent=True) if v == w]
        ids = data.draw(st.permutations(sent), label="deliveries")  # all it sent, in any order
        worker, held = self.workers[w], [self.held[w].pop(i) for i in ids]
        reports = [model.Report(h.claim, h.result) for h in held]
        if len({r.claim.attempt for r in reports}) > 1:
            self.event("batch of mixed attempts")
        label = (
            f"record_batch(w{w}, "
            + ", ".join(f"{r.claim.id}@{r.claim.attempt} {r.result}" for r in reports)
            + ")"
        )
        owners = [self._fence(r.claim) for r in reports]

        def impl_op(conn):
            got = self.store.record_batch(conn, reports, [h.result for h in held])
            if isinstance(got, Won):  # each row is a fenced write of its own
                for (run, token, owner), row in zip(owners, got.value):
                    if isinstance(row, (Won, LostRace)):
                        self.writes.append(Write(str(run), token, isinstance(row, Won), owner))
            return got

        got = self.apply(
            worker,
            label,
            lambda m: m.record_batch(reports),
            impl_op,
            on_error=lambda: self.forget(worker),
        )
        for row in got.value if isinstance(got, Won) else ():
            if isinstance(row, LostRace):
                self.event("fence rejection")
            elif row == Won(model.P):
                self.event("backoff")

    @precondition(lambda self: self._holding())
    @rule(data=st.data())
    def extend_lease(self, data) -> None:
        w, i = self._pick(data)
        self.do(w, self._extend(w, i))

    @rule(w=st.integers(0, 1))
    def reclaim_stale(self, w: int) -> None:
        self.do(w, self._reap())

    @precondition(lambda self: all(w.clean() for w in self.workers))
    @rule(ba=st.integers(1, 2), bb=st.integers(1, 2))
    def claim_race(self, ba: int, bb: int) -> None:
        """w0's claim holds its row locks (not yet committed) while w1 claims: SKIP LOCKED must let
        w1 take the next due rows at once, and never the same ones."""
        wa, wb = self.workers[:2]
        self.begin_step()
        trial = self.model.copy()
        exp_a = trial.claim(ba)
        label = f"claim_race: w0 claim(batch={ba}) open"
        try:
            conn_a = wa.connection()
            got_a = Won(tuple(c for c, _ in self.store.begin_claim(conn_a, ba)))
        except errors.ConnectionLost:
            self.log(f"{label} -> ConnectionLost")
            wa.abandon()
            return
        self.log(f"{label} -> {fmt(got_a)}")
        if got_a != exp_a:
            wa.abandon()
            self.fail(
                f"{label}: implementation answered {fmt(got_a)}, the model expects {fmt(exp_a)}",
                otherwise="claim",
            )
        self.model = trial
        self.candidates = [Candidate(trial)]
        got_b = self.apply(
            wb,
            f"claim_race: w1 claim(batch={bb}) while w0's claim is open",
            lambda m: m.claim(bb),
            lambda c: self.store.claim(c, bb),
            on_error=lambda: self.forget(wb),
            guarantee="claim",
        )
        try:
            errors.commit(conn_a, "outbox.claim")
        except errors.CommitIndeterminate as e:
            wa.abandon()
            self.fail(f"claim_race: w0's COMMIT failed on a clean link: {e.detail}")
        self.log("claim_race: w0 commits")
        for c in got_a.value:
            self.held[0][c.id] = Held(c)
        if isinstance(got_b, Won):
            for c in got_b.value:
                self.held[1][c.id] = Held(c)
            if got_a.value and got_b.value:
                self.event("skip locked")


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

# The read-then-write races only a concurrent block reaches (``knownstate.chaos.race_mutants``).
from .. import race_mutants  # noqa: E402

MUTANTS += race_mutants.MUTANTS["outbox"]
