"""A check built from a description and an adapter: the gate for a queue of the user's own.

:func:`kind` takes a :class:`~knownstate.model.describe.RunKind` and an
:class:`~knownstate.chaos.adapter.Adapter` and returns a :class:`~.check.KindCheck` subclass:
the model is the generic queue of :mod:`knownstate.model.generic`, the faults and the judging
are the base's, and this module only says what a worker of such a queue does — its loop's
steps as rules (claim, the external call, the fenced write of its outcome, the heartbeat), the
reaper, a producer (and a repeated request, with an idempotency key), a claim racing another
worker's open claim — and answers the fault policy's questions.

The external call, when the description has one, goes to a real HTTP stand-in on loopback
(:class:`~.receiver.Receiver`) through the worker's own Toxiproxy link: ``POST /runs/<key>``.
It answers what the check planned (200, a retryable 503, a permanent 422), records every call
with its ``Idempotency-Key`` header, and so counts duplicates (allowed at-least-once) and
checks that every call for one run carries the same key (when the description says it does).

Mutants come from the adapter's SQL: for each guard it names (``Adapter.guards``), each query
containing it gets a mutant without it, which must be caught naming the invariant the guard
stands for. A user adds hand-written ones with ``kind(..., mutants=[...])``.

The parts live beside it: the external side in :mod:`.receiver`, the claim race rule in
:mod:`.claimrace`, the fault policy's questions in :mod:`.genericfaults`, calling the adapter
in :mod:`.adaptercall`, what a description and an adapter must give each other (the
adapter's problems, the derived mutants, the required events) in :mod:`.genericbuild`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Iterable, Literal

from hypothesis import strategies as st
from hypothesis.stateful import initialize

from knownstate.model import generic
from knownstate.model.contract import LostRace, Violation, Won
from knownstate.model.describe import RunKind
from knownstate.model.generic import Job, Observed, Timing

from .adapter import OK, PERMANENT, Adapter, Claimed, as_row
from .adapter import worker_class as adapter_worker
from .check import QUANTUM, Action, FaultPolicy, KindCheck
from .adaptercall import AdapterCalls, Counted
from .claimrace import ClaimRace
from .genericfaults import FaultAnswers
from .genericrules import FailsAgain, SkewsAppClock
from .genericbuild import (  # noqa: F401 (GUARDS, KindError: this module's public names too)
    GUARDS,
    KindError,
    adapter_problems,
    derived_mutants,
    heartbeat_op,
    reaping,
    required_events,
)
from .linearize import UNKNOWN
from .mutants import Mutant
from .receiver import ANSWERS, ExternalCall, Receiver


# ---------------------------------------------------------------------------------------
# The check.
# ---------------------------------------------------------------------------------------


@dataclass
class Held:
    """A claim a worker holds in memory: the model's job, the adapter's, and the external
    side's answer once it called."""

    job: Job
    claimed: Claimed
    result: str | None = None


def _order(key: str) -> tuple:
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


class GenericCheck(FaultAnswers, ClaimRace, ExternalCall, AdapterCalls, KindCheck):
    """The check of a described queue. Built by :func:`kind`; not subclassed by hand."""

    description: ClassVar[RunKind]
    adapter_class: ClassVar[type[Adapter]]
    timing: ClassVar[Timing]
    queries: ClassVar[dict[str, str] | None] = None  # a mutant's edited SQL
    mutants: ClassVar[list[Mutant]] = []
    n_workers = 2  # the loop's workers, w0 and w1; with a reaper, w2 is the reaper process
    REAPER = 2
    owners_only: ClassVar[bool | str] = False
    """A control: a worker writes only for the runs it still owns (a stale holder drops them
    unwritten), so whatever a weak fence lets through never happens. ``"under-lease"``: and
    only under a live lease (a worker that checks its lease before it writes), so nothing a
    write after the lease lapsed meets — a reaper at work on the run — happens either."""
    lock_wait_breaks = "claim"
    own_invariants: ClassVar[dict[str, str]] = {}
    sql_edits: ClassVar[dict[str, tuple[tuple[str, str], ...]]] = {}
    """A derived mutant of a library that keeps its SQL to itself: edits of the statements its
    workers send in an operation (and of its schema), e.g. the claim's ``SKIP LOCKED`` out."""
    current_token: ClassVar[bool] = False
    """The derived mutant ``stale-write-takes-current-token``: a holder writes with the handle
    of the run's newest claim, another worker's once the run was claimed again (the bug of a
    write that reads its fence token back from the row instead of carrying its own)."""

    # -- set-up -------------------------------------------------------------------------------
    def reset_example(self) -> None:
        self.adapter = self.adapter_class(self.timing, self.env.clock)
        if self.queries is not None:
            self.adapter.queries = dict(self.queries)
        self.held: list[dict[str, Held]] = [{} for _ in self.workers]
        self.owing: frozenset[str] = frozenset()
        self._unsure: tuple[str, int, frozenset] | None = None  # a stale write, answer lost
        self.handles: list[dict[str, Claimed]] = [{} for _ in self.workers]  # claimed, not held
        self._duplicates = 0
        for w in self.workers:
            w.binding, w.sql_edits = self.adapter, self.sql_edits
        self.receiver = None
        if self.description.external != "none":
            self.receiver = self.env.stand_in("receiver", Receiver)
            self.receiver.reset()
            for w in self.workers:
                w.ext_link = self.env.api.link(
                    f"{self.kind}-{w.name}-ext", self.receiver.host, self.receiver.port
                )
                w.links = [w.link, w.ext_link]

    def new_model(self) -> generic.GenericModel:
        return generic.GenericModel(self.description, self.timing)

    def observe_model(self, m: generic.GenericModel):
        received = sorted(m.received.items(), key=lambda kv: _order(kv[0]))
        return m.state(self.adapter_class.holders), tuple(received)

    def observe_impl(self):
        try:
            rows = [as_row(r) for r in self.adapter.read(self.ws.admin())]
        except (KeyError, TypeError) as e:
            self.fail(
                f"the adapter's read gave a row without {e}: return Row(...) or "
                "mappings with 'key' and 'status'",
                [],
            )
        m = self.candidates[0].model
        observed = tuple(sorted((self._observe(r, m) for r in rows), key=lambda o: _order(o.key)))
        received = self.receiver.received() if self.receiver else {}
        return observed, tuple(
            sorted(((str(k), n) for k, n in received.items()), key=lambda kv: _order(kv[0]))
        )

    def _observe(self, r, m) -> Observed:
        """A row as observed at the clocks of model ``m``: time left until its schedule by the
        database's, until its lease by the lease's."""
        d, model = self.description, self.model
        due = lease = None
        if d.retry is not None and r.status in model.waiting:
            due = 0 if r.due is None else max(0, self._time(r.due, "due") - m.now)
        if d.lease is not None and r.status in d.owned and r.lease_until is not None:
            lease = max(0, self._time(r.lease_until, "lease_until") - m.lease_now())
        holder = r.holder if self.adapter_class.holders and r.status in d.owned else None
        attempts = r.attempts if model.tracks_attempts() else None
        limit = r.max_attempts if model.limits_per_run() else None
        return Observed(r.key, r.status, attempts, due, lease, holder, limit)

    def _time(self, ts, column: str) -> int:
        if getattr(ts, "tzinfo", None) is None:
            self.fail(
                f"the adapter's read gave {column} = {ts!r}, not a timestamp with a "
                "time zone: use timestamptz columns",
                [],
            )
        return self.to_model_time(ts)

    def views(self, observation):
        rows, received = observation
        return generic.views(self.description, self.timing, rows, dict(received), self.owing)

    def difference_breaks(self, expected, real) -> tuple[str, ...]:
        return tuple(v.invariant for v in generic.cut_short(real[0], [expected[0]]))

    def kind_violations(self, real) -> list[Violation]:
        rows, _ = real
        out = []
        if self._unsure is not None:
            key, token, before = self._unsure
            landed = {r.status for r in rows if r.key == key}
            possible = {c.model.runs[key].status for c in self.candidates if key in c.model.runs}
            # landed where the fence should have refused it, or (a fence that lets it land:
            # id only) moved the run to what only the write would have made of it
            if landed and (not landed <= possible or landed & (possible - before)):
                out.append(
                    Violation(
                        "lease-fence",
                        f"run {key}: a write with stale token {token} "
                        f"landed (its answer was lost; the run is now "
                        f"{', '.join(sorted(landed))})",
                    )
                )
        out += generic.cut_short(rows, [c.model.state() for c in self.candidates])
        keys = [r.key for r in rows]
        for key in sorted({k for k in keys if keys.count(k) > 1}, key=_order):
            out.append(
                Violation(
                    "claim",
                    f"run {key}: {keys.count(key)} runs under one key (a "
                    "repeated request must get the existing run)",
                )
            )
        if self.receiver is not None and self.description.external_key:
            for run, sent in sorted(self.receiver.keys().items(), key=lambda kv: _order(kv[0])):
                if len(sent) > 1 or "" in sent:
                    out.append(
                        Violation(
                            "external-effect-semantics",
                            f"run {run}: its external "
                            f"calls carried idempotency keys {sorted(sent)}; the "
                            "same key on every call lets the other side de-duplicate",
                        )
                    )
        return out

    def observed(self, m: generic.GenericModel) -> None:
        self.owing, self._unsure = frozenset(), None
        for _, src, event, _ in m.transitions:
            if event == generic.RETRY and self.description.retry.backoff != "none":
                self.event("backoff")
            elif event in (generic.RECLAIM, generic.RECLAIM_DEAD):
                self.event("reclaim")
            elif event == generic.CLAIM and src == m.owned:
                self.event("reclaim")  # a claim that re-picked a lapsed run
        dups = sum(n - 1 for n in m.received.values())
        self.event("duplicate delivery", max(0, dups - self._duplicates))
        self._duplicates = dups

    def forget(self, worker) -> None:
        self.held[worker.index].clear()
        self.handles[worker.index].clear()

    # -- helpers --------------------------------------------------------------------------------
    def _holding(self, sent: bool | None = None) -> list[tuple[int, str]]:
        return [
            (w, k)
            for w, held in enumerate(self.held)
            for k in sorted(held, key=_order)
            if sent is None or (held[k].result is not None) == sent
            if not self.owners_only or self._surely_owns(held[k].job)
        ]

    def _surely_owns(self, job: Job) -> bool:
        """Whether ``job``'s holder owns its run in every state the world may be in (after a
        lost answer, another worker's claim may have taken it); in an ``"under-lease"``
        control, under a lease that has not lapsed."""
        leased = self.owners_only == "under-lease"
        return all(
            c.model.owns(job) and not (leased and c.model.lapsed(c.model.runs[job.key]))
            for c in self.candidates
        )

    def _mine(self, w: int, sent: bool | None) -> list[str]:
        return [k for x, k in self._holding(sent) if x == w]

    def _write(self, op: str):
        """impl_op of a fenced write: Won, or LostRace('fenced'). A library whose writes say
        nothing (``Fence(answers=False)``) answers UNKNOWN: the rows read back after the step
        judge whether it landed."""

        def impl(worker, *args):
            def run(conn):
                _, lost = self._call(worker, op, conn, *args)
                if not self.description.fence.answers:
                    return UNKNOWN
                return LostRace("fenced") if lost else Won()

            return run

        return impl

    def _fence(self, h: Held, write: str):
        """A write by an owner, judged by whether its holder still owned the run. A library
        whose writes say nothing (``Fence(answers=False)``) answers None either way, so the
        answer cannot show a refusal: a write the fence refuses, as the model predicts and the
        rows read back confirm, is no stale write accepted."""

        def judged() -> tuple[str, int | None, bool]:
            silent = not self.description.fence.answers
            refused = silent and not self.model.lands(h.job, write)
            return h.job.key, h.job.token, self.model.owns(h.job) or refused

        return judged

    def _tag(self, h: Held) -> str:
        """The holder's claim in a step's label: its attempt, or, when the library's count
        counts no claims or it keeps none, which claim of the run it holds."""
        retry = self.description.retry
        if not self.model.tracks_attempts() or (retry is not None and retry.counts != "claims"):
            return f"claim={h.job.token}"
        return f"attempt={h.job.attempt}"

    def _unanswered(self, worker, h: Held):
        """A fenced write whose answer was lost: the worker forgets what it held, and if the
        writer no longer owned the run, the observation that follows judges whether the write
        landed anyway (the fence's violation, with no answer to show it)."""

        def lost() -> None:
            self.forget(worker)
            if not self.model.owns(h.job):
                run = h.job.key  # its statuses as the write found them (none applied yet)
                before = frozenset(
                    c.model.runs[run].status for c in self.candidates if run in c.model.runs
                )
                self._unsure = (run, h.job.token, before)

        return lost

    def _handle(self, w: int, key: str) -> Claimed:
        """The handle worker ``w`` writes run ``key`` with: its own claim's (with
        ``current_token``, the newest claim's of any worker)."""
        if not self.current_token:
            return self.held[w][key].claimed
        holders = [held[key] for held in self.held if key in held]
        return max(holders, key=lambda h: h.job.token or 0).claimed

    def _stale(self, h: Held) -> bool:
        """Whether ``h``'s holder writes on a run another claim took since: what a fence is
        for. Counted per write, so a run goes on until each write met it often enough."""
        r = self.model.runs.get(h.job.key)
        return (
            r is not None
            and r.status == self.model.owned
            and h.job.token is not None
            and r.claims > h.job.token
        )

    def _waiting(self) -> int:
        return sum(r.status in self.model.waiting for r in self.model.runs.values())

    # -- operations ---------------------------------------------------------------------------
    operations = ("enqueue", "repeat", "claim", "send", "record", "extend_lease", "reclaim_stale")
    heartbeat_op: ClassVar[str] = "extend_lease"
    """The heartbeat's operation name. Behind an id-only fence, where a stale heartbeat lands
    like a stale outcome, it is ``renew_lease``: rules are drawn by name, and of two equally
    short counterexamples the shrinker then shows the stale outcome, the one that matters."""

    @initialize(n=st.integers(1, 2))
    def enqueue_some(self, n: int) -> None:
        """Every example starts with a few runs waiting, so work flows from the first step."""
        for _ in range(n):
            self.do(0, self._enqueue(0, self.model.next_key()))

    def actions(self, w: int) -> list[Action]:
        """What worker ``w`` can do now: add a run (or, with an idempotency key, repeat a request
        under a key already used: it gets the same run), claim, make the external call for a run
        it holds, record that run's outcome (the owner's fenced write), renew its lease, reap."""
        if w == self.REAPER:
            return [self._reap(w)]
        out = []
        if self._waiting() < 3:
            out.append(self._enqueue(w, self._new_key(w)))
        if self.description.idempotency_key:
            out += [self._enqueue(w, k, "repeat") for k in sorted(self.model.runs, key=_order)]
        out += [self._claim(w, batch) for batch in self._batches()]
        for key in self._mine(w, sent=None):
            h = self.held[w][key]
            if self.receiver is not None and h.result is None:
                out += [self._send(w, key, answer) for answer in self._answers()]
            else:
                out += self._records(w, key)
            if generic.EXTEND in self.description.events():
                out.append(self._extend(w, key))
        if reaping(self.description, w):
            out.append(self._reap(w))
        return out

    def _new_key(self, w: int) -> str:
        """The key of a new run worker ``w`` adds: the next one; a key of its own when the
        system keeps none (``keys="producers"``: two producers never add under one key)."""
        key = self.model.next_key()
        return str(int(key) + w) if self.description.keys == "producers" else key

    def _enqueue(self, w: int, key: str, op: str = "enqueue") -> Action:
        worker = self.workers[w]

        def impl(conn):
            _, lost = self._call(worker, "enqueue", conn, key)
            if lost and not self.description.idempotency_key:
                return LostRace(generic.KEY_TAKEN)
            return Won(key)

        def after(got) -> None:
            if op == "repeat":
                self.event("repeat answered")

        return Action(
            op,
            f"enqueue(key={key})",
            lambda m: m.enqueue(key),
            impl,
            after=after,
            runs=frozenset({("key", key)}),
        )

    @classmethod
    def _batches(cls) -> list[int]:
        """The batches a claim asks for: 1 to 3, or to the most one claim takes."""
        return list(range(1, min(3, cls.description.claim.most or 3) + 1))

    def _holder(self, w: int) -> str:
        """Whose lease a claim stamps: the worker's, when the lease is per worker."""
        lease = self.description.lease
        return self.workers[w].name if lease is not None and lease.per == "worker" else ""

    def _claim(self, w: int, batch: int) -> Action:
        """A claim of up to ``batch`` due runs. Among others (a block) SKIP LOCKED may skip runs
        another claim holds: any due runs, in order, are then a right answer."""
        worker, m, holder = self.workers[w], self.model, self._holder(w)
        due = [r.key for r in m.due()]
        lapsed = frozenset(r.key for r in m.runs.values() if m.lapsed(r))
        reach = frozenset(sorted({*due, *lapsed}, key=_order)[:batch]) & lapsed
        # of those, the runs it takes once the reaper put them back (not: ended, or due later)
        freed = frozenset(k for k in reach if m.claimable_once_reaped(m.runs[k]))

        def among_others(m, got):
            taken = tuple(j.key for j in got.value) if isinstance(got, Won) else ()
            return self._tokens(m.claim_skipping(batch, taken, holder))

        return Action(
            "claim",
            f"claim(batch={batch})",
            lambda m: self._tokens(m.claim(batch, holder)),
            lambda conn: self._claimed(worker, conn, batch),
            after=self._took(w),
            on_error=lambda: self.forget(worker),
            guarantee="claim",
            among_others=among_others if self.description.claim.skip_locked else None,
            runs=frozenset(due) | reach,
            once_freed=freed,
        )

    def offers(self, w: int) -> list[Action]:
        """A block schedules psycopg's connections, synchronous or asyncio: an adapter on a
        driver of its own runs sequential steps (and the claim race) alone. Two producers
        with keys of their own meet on no row: which of their runs came first, which the
        claim order reads, is then no race of the system's, and their adds are not offered."""
        if self.workers[w].mode == "own":
            return []
        offered = super().offers(w)
        if self.description.keys == "producers":
            return [a for a in offered if a.op != "enqueue"]
        return offered

    def _tokens(self, got: Won) -> Won:
        """A claim's outcome as the system can show it: no attempt when it keeps none."""
        if self.model.tracks_attempts():
            return got
        return Won(tuple(Job(j.key, None) for j in got.value))

    def _claimed(self, worker, conn, batch: int, closes: bool = True) -> Won:
        named = {"worker": worker.name} if self._holder(worker.index) else {}
        started = self.adapter.started
        fresh = self.adapter.implements("start") and worker.name not in started
        if fresh:
            started[worker.name], _ = self._call(worker, "start", conn, worker.name)
        try:
            result, _ = self._call(worker, "claim", conn, batch, closes=closes, named=named)
        except BaseException:
            if fresh:  # the model registers a worker with its first claim: that failed
                started.pop(worker.name, None)
            raise
        claimed = [c if isinstance(c, Claimed) else Claimed(str(c)) for c in (result or ())]
        self.handles[worker.index].update({c.key: c for c in claimed})
        jobs = sorted((Job(c.key, c.attempt) for c in claimed), key=lambda j: _order(j.key))
        return Won(tuple(jobs))

    def _took(self, w: int):
        """After a claim: the worker holds what it took, under the attempt the model gave it.
        After a block the model is past every claim in it: a run another worker's claim in the
        same block took after this one (a lease per worker names its holder) is held under
        the claim before, no longer the run's."""

        def after(got) -> None:
            runs, me = self.candidates[0].model.runs, self._holder(w)
            for job in got.value if isinstance(got, Won) else ():
                claimed = self.handles[w].pop(job.key, None) or Claimed(job.key, job.attempt)
                run = runs[job.key]
                claims = run.claims - 1 if me and run.holder != me else run.claims
                self.held[w][job.key] = Held(
                    Job(job.key, run.attempts, claims, me, run.extra), claimed
                )

        return after

    def _records(self, w: int, key: str) -> list[Action]:
        """The owner's fenced write of a run's outcome: what its call answered, or (without an
        external side) each outcome the work may have had."""
        h = self.held[w][key]
        results = [h.result] if h.result is not None else [ANSWERS[a] for a in self._answers()]
        return [self._record(w, key, result) for result in results]

    def _record(self, w: int, key: str, result: str) -> Action:
        """Complete, or fail (retry / give up / end), fenced by the description's fence."""
        worker, h = self.workers[w], self.held[w][key]
        if result == OK:
            label = f"complete({key}, {self._tag(h)})"

            def model_op(m):
                return m.complete(h.job)

            impl = self._write("complete")(worker, self._handle(w, key))
        else:
            permanent = result == PERMANENT
            label = f"fail({key}, {self._tag(h)}, permanent={permanent})"

            def model_op(m):
                self.owing = frozenset({key})  # judged after this step: it owes its backoff
                return m.fail(h.job, permanent)

            impl = self._write("fail")(worker, self._handle(w, key), permanent)
        stale = self._stale(h)

        def after(got) -> None:
            self.held[w].pop(key, None)
            if stale:
                self.event(f"stale {'complete' if result == OK else 'fail'} on a re-claimed run")
            if isinstance(got, LostRace) and self.description.fence.answers:
                self.event("fence rejection")

        return Action(
            "record",
            label,
            model_op,
            impl,
            after=after,
            on_error=self._unanswered(worker, h),
            fence=self._fence(h, "complete" if result == OK else "fail"),
            runs=frozenset({key}),
        )

    def _extend(self, w: int, key: str) -> Action:
        """The owner's heartbeat (on a timer: a stall freezes it with the worker). Behind an
        id-only fence (``unless-terminal``) a stale beat is predicted to land, stamping the
        lease of a run another worker holds and no outcome: it is not judged as a stale write
        (the stale outcome writes are), so the finding reported is the one that matters."""
        worker, h = self.workers[w], self.held[w][key]
        stale = self._stale(h)
        judged = self.description.fence.of("extend_lease") != "unless-terminal"

        def after(got) -> None:
            if stale:
                self.event("stale extend_lease on a re-claimed run")
            if isinstance(got, LostRace):
                if self.description.fence.answers:
                    self.event("fence rejection")
                self.held[w].pop(key, None)

        def model_op(m):
            return m.extend_lease(h.job)

        return Action(
            self.heartbeat_op,
            f"extend_lease({key}, {self._tag(h)})",
            model_op,
            self._write("extend_lease")(worker, self._handle(w, key)),
            after=after,
            on_error=self._unanswered(worker, h),
            fence=self._fence(h, "extend_lease") if judged else None,
            owner_write=not judged,
            runs=frozenset({key}),
        )

    def _reap(self, w: int) -> Action:
        """The reaper. An adapter that answers how many runs it took back, or nothing, is
        judged by the rows read back (:class:`Counted`)."""
        worker, m = self.workers[w], self.model
        lapsed = frozenset(r.key for r in m.runs.values() if m.lapsed(r))

        def impl(conn):
            result, _ = self._call(worker, "reclaim_stale", conn)
            if result is None:
                return Won(Counted(None))
            if isinstance(result, int) and not isinstance(result, bool):
                return Won(Counted(result))
            keys = [
                getattr(r, "key", None) or (r["key"] if isinstance(r, dict) else r) for r in result
            ]
            return Won(tuple(sorted((str(k) for k in keys), key=_order)))

        # one transaction per run (Lease(reaps="one-by-one")): a failure may leave any taken
        keys = sorted(lapsed, key=_order)
        parts = tuple(partial(type(m).take_back, key=k) for k in keys)

        def split(got) -> tuple | None:
            taken = got.value if isinstance(got, Won) else None
            if not isinstance(taken, tuple):  # a count, or nothing: the rows judge
                return (UNKNOWN,) * len(keys)
            if not set(taken) <= lapsed:  # a run none of its parts takes: judged whole
                return None
            return tuple(Won((k,) if k in taken else ()) for k in keys)

        terminal = self.description.terminal

        def terminal_taken(got) -> tuple[str, ...]:
            """A terminal run among those it took back: the terminal state's too, whether or
            not taking it changed its row."""
            taken = got.value if isinstance(got, Won) and isinstance(got.value, tuple) else ()
            done = [k for k in taken if k in m.runs and m.runs[k].status in terminal]
            return ("terminal-answers-from-receipts",) if done else ()

        return Action(
            "reclaim_stale",
            "reclaim_stale()",
            lambda m: m.reclaim_stale(),
            impl,
            guarantee="lease",
            also_breaks=terminal_taken,
            runs=lapsed,
            parts=parts if self.description.reaps_apart else (),
            split=split,
        )


# ---------------------------------------------------------------------------------------
# Building a check.
# ---------------------------------------------------------------------------------------


def _heartbeat_last(d: RunKind) -> dict[str, Any]:
    """Behind an id-only fence, the heartbeat's rule named after the record's (see
    :attr:`GenericCheck.heartbeat_op`); elsewhere nothing changes."""
    beat = heartbeat_op(d)
    ops = tuple(beat if op == "extend_lease" else op for op in GenericCheck.operations)
    return {"heartbeat_op": beat, "operations": ops}


def kind(
    description: RunKind,
    adapter: type[Adapter],
    *,
    mutants: Iterable[Mutant] = (),
    owners_only: bool | Literal["under-lease"] = False,
) -> type[GenericCheck]:
    """The check of ``description`` run against the system ``adapter`` binds. Raises
    :class:`KindError` naming what to change when the two cannot make a check. With
    ``owners_only`` it is a control: workers never write for a run they no longer own (with
    ``"under-lease"``, nor once their lease lapsed), named ``<name>-owners-only``."""
    if owners_only and not description.name.endswith("-owners-only"):
        description = description.model_copy(update={"name": f"{description.name}-owners-only"})
    problems = generic.fit_problems(description) + adapter_problems(description, adapter)
    if problems:
        raise KindError(f"run kind {description.name!r}: " + "; ".join(problems))
    timing = Timing.of(description, QUANTUM)
    mode = adapter.mode()
    # a driver of its own sends no COMMIT the gate sees; in autocommit the COMMIT faults meet
    # the next statement, which commits on its own
    no_commit = mode == "own"
    policy = FaultPolicy(
        gap=1,
        heal_after=6,
        stall=timing.lease + QUANTUM if timing.lease else None,
        reply_lost=description.external != "none",
        commit_faults=() if no_commit else FaultPolicy().commit_faults,
    )
    title = "".join(p.capitalize() for p in description.name.split("-"))
    failures = description.retry is not None and description.retry.counts != "claims"
    app_clock = description.app_clock
    mixins = (FailsAgain,) * failures + (SkewsAppClock,) * app_clock
    cls = type(
        f"{title}Check",
        (*mixins, GenericCheck),
        {
            "__module__": adapter.__module__,
            "__doc__": f"The {description.name} kind, checked from its description.",
            "kind": description.name,
            "n_workers": 3 if description.lease and description.lease.taken_back_by else 2,
            "description": description,
            "adapter_class": adapter,
            "timing": timing,
            "contract": description.contract(),
            "schema": adapter.schema,
            "policy": policy,
            "commit_point": "COMMIT" if description.commits == "transaction" else "statement",
            "required_events": required_events(description, mode, owners_only),
            "owners_only": owners_only,
            **_heartbeat_last(description),
            "worker_class": adapter_worker(adapter),
        },
    )
    cls.mutants = derived_mutants(description, adapter) + list(mutants)
    return cls
