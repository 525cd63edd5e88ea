"""A claim/lease/fence/retry queue, as a pure state machine run from its description.

Theory of operation
-------------------

Most durable run kinds are queues of one shape: a run waits (the *initial* status, or another
waiting status a claim takes runs from) until a worker claims it (the *owned* status), under a
lease; the owner completes it, fails it for good,
or fails it for now (a retry, spaced by a backoff, given up after a number of attempts); a
reaper takes back a run whose lease lapsed. What differs from one queue to the next is data —
the status names, the lease, the fence, the retry policy — and a
:class:`~knownstate.model.describe.RunKind` holds that data. This module is the one machine
those descriptions drive, so a user binds a queue to the gate without writing a model.

The vocabulary is the events of the description's table, which must be these (the outbox's):

========================  =============================================================
``enqueue``               ``(new) -> initial``: a producer adds a run under its key
``claim``                 ``waiting -> owned``: due runs, oldest first, ``attempts + 1``
                          (from the initial status, and from each other waiting one);
                          with ``Claim(reclaims=True)`` also ``owned -> owned``: a run whose
                          lease lapsed, re-picked as it is (no reaper between)
``extend_lease``          ``owned -> owned``: the owner's heartbeat
``complete``              ``owned -> terminal``: the work succeeded
``fail_permanent``        ``owned -> terminal``: the work failed for good (or, without a
                          retry policy, failed at all)
``retry``, ``give_up``    ``owned -> waiting`` after a backoff, or ``owned -> terminal``
                          once ``max_attempts`` attempts were made
``reclaim``,              the reaper: a lapsed lease's run goes back to waiting, due at
``reclaim_dead``          once (``reclaim_dead`` at the attempt limit, when described: a
                          reaper need not know the retry policy); without a retry policy
                          ``reclaim`` ends the run. A queue whose claim re-picks has none.
========================  =============================================================

Attempts are counted as the library counts them (``Retry(counts=...)``): per claim, per
retry, or per run of the work that ended; a take-back may add one to a run's limit
(``Retry(taken_back="one-more")``). Ownership is apart from that count: every claim gives its
holder a new token (the run's ``claims``), and :meth:`GenericModel.owns` compares the holder's
with the run's.

The fence decides which writes by an owner land: ``attempt``, ``claim`` (a claim id, set
afresh by each claim) and ``row-lock`` match the holder's claim, ``status`` only the owned
status, ``unless-terminal`` the run's id (a write lands unless the run ended; a heartbeat only
stamps the lease), ``none`` nothing at all. The
model predicts what the described system does, so a queue described with a weak fence is
predicted to accept a stale owner's write — and the contract's ``lease-fence`` invariant,
which judges every write by *ownership* (:meth:`GenericModel.owns`: still owned, under the
same claim), names it.

Every operation looks its event up in the table (:meth:`TransitionTable.next`) and returns an
outcome (``Won``, ``LostRace``), never raises for a lost race. Time is the database clock in
whole seconds, moved by :meth:`GenericModel.advance`. Run keys are given by the caller (the
check), never predicted from a sequence.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

from .contract import CREATED, LostRace, Outcome, RetryView, RunView, StepView, Violation, Won
from .describe import RunKind

ENQUEUE, CLAIM, EXTEND = "enqueue", "claim", "extend_lease"
COMPLETE, FAIL = "complete", "fail_permanent"
RETRY, GIVE_UP = "retry", "give_up"
RECLAIM, RECLAIM_DEAD = "reclaim", "reclaim_dead"
VOCABULARY = (ENQUEUE, CLAIM, EXTEND, COMPLETE, FAIL, RETRY, GIVE_UP, RECLAIM, RECLAIM_DEAD)
OWNER_WRITES = frozenset({EXTEND, COMPLETE, FAIL, RETRY, GIVE_UP})
WRITE_OF = {
    EXTEND: "extend_lease",
    COMPLETE: "complete",
    FAIL: "fail",
    RETRY: "fail",
    GIVE_UP: "fail",
}
"""The owner's write each event is (``Fence.operations`` names writes)."""
STEP = "run"  # a queued run's single step; its identity is the run's key
KEY_TAKEN = "a run with this key exists"
ALWAYS_DUE = -(2**62)  # a run with no schedule (Claim(unscheduled="always")): due at any time
APP_AHEAD = 7 * 86_400
"""How far the application's clock is ahead of the database's when a check starts: the gate
starts the database's a week behind real time (``chaos.harness.CLOCK_BASE``); a clock jump
moves the database's only. A schedule stamped with the application's now
(``Lease(requeue_clock="application")``) is that far in the database's future."""


def fit_problems(d: RunKind) -> list[str]:
    """Why the generic model cannot run this description (empty: it can), with hints."""
    out: list[str] = []
    names = ", ".join(VOCABULARY)
    unknown = sorted(d.events() - set(VOCABULARY))
    if unknown:
        out.append(
            f"event(s) {', '.join(map(repr, unknown))} unknown to the generic queue, whose "
            f"events are {names}: rename them, or write a model by hand (README, "
            "'Validating your own run kind')"
        )
    if len(d.owned) != 1:
        out.append(f"the generic queue has one owned status, not {len(d.owned)}")
    if out:
        return out
    owned, events = d.owned[0], d.events()
    moves = {e: (s, t) for s, e, t in d.transitions}
    want = [(CREATED, ENQUEUE, d.initial)] + [(w, CLAIM, owned) for w in d.waiting]
    for s, e, t in want:
        if (s, e, t) not in d.transitions:
            out.append(f"the generic queue needs '{s} -{e}-> {t}'")
    for e in (COMPLETE, FAIL, GIVE_UP, RECLAIM_DEAD):
        if e in moves and (moves[e][0] != owned or moves[e][1] not in d.terminal):
            out.append(
                f"{e!r} must take an owned run to a terminal status ('{owned} -{e}-> <terminal>')"
            )
    if COMPLETE not in moves:
        out.append(f"the generic queue needs 'complete', e.g. '{owned} -complete-> done'")
    if EXTEND in moves and moves[EXTEND] != (owned, owned):
        out.append(f"'extend_lease' keeps the run owned: '{owned} -extend_lease-> {owned}'")
    if d.retry is not None:
        for e, target in ((RETRY, d.initial), (GIVE_UP, None)):
            if e not in moves:
                out.append(
                    f"with a retry policy the generic queue needs {e!r} ('{owned} -{e}-> "
                    f"{target or '<terminal>'}')"
                )
            elif target and (moves[e][0] != owned or moves[e][1] not in d.waiting):
                out.append(
                    f"{e!r} goes back to a status a claim takes runs from: "
                    f"'{owned} -{e}-> {target}'"
                )
    elif RETRY in events or GIVE_UP in events:
        out.append("'retry'/'give_up' without a retry policy: declare retry=Retry(...)")
    if d.lease is not None:
        if RECLAIM not in moves and (RECLAIM_DEAD in moves or not d.claim.reclaims):
            out.append(f"a lease needs the reaper's 'reclaim' ('{owned} -reclaim-> ...')")
        elif RECLAIM not in moves:
            pass  # the claim re-picks lapsed runs: no reaper
        elif moves[RECLAIM][0] != owned:
            out.append("'reclaim' takes back an owned run")
        elif d.retry is not None and moves[RECLAIM][1] not in d.waiting:
            out.append(f"with a retry policy 'reclaim' goes back to {d.initial!r}")
        elif d.retry is None and moves[RECLAIM][1] not in (*d.terminal, *d.waiting):
            # a reaper that re-queues (the run runs again, unbounded) or ends the run
            out.append(
                f"without a retry policy 'reclaim' goes back to {d.initial!r} or ends the run"
            )
        extra = set(d.lease.taken_back_by) - {RECLAIM, RECLAIM_DEAD}
        if extra:
            out.append(
                f"the generic queue's reaper events are 'reclaim' and 'reclaim_dead', "
                f"not {sorted(extra)}"
            )
        if d.lease.heartbeat is not None and EXTEND not in moves:
            out.append(
                f"a heartbeat is the 'extend_lease' event: add '{owned} -extend_lease-> {owned}'"
            )
    elif RECLAIM in events or RECLAIM_DEAD in events:
        out.append("'reclaim' without a lease: describe the lease")
    return out


@dataclass(frozen=True)
class Timing:
    """The description's durations as a check runs them, in seconds: each multiplied by
    ``scale``, the smallest factor that makes every one a whole number of ``quantum`` seconds
    (1 when they already are). The system under check is configured with these."""

    lease: int | None
    heartbeat: int | None
    max_attempts: int | None
    backoff_base: int | None
    backoff_cap: int | None
    scale: int = 1
    clock_skew: int | None = None
    """The most the application's clock is apart from the database's (``RunKind.clock_skew``,
    scaled like the others); None: unbounded."""

    @classmethod
    def of(cls, d: RunKind, quantum: int = 1) -> "Timing":
        spans = [
            s
            for s in (
                d.lease and d.lease.seconds,
                d.lease and d.lease.heartbeat,
                d.retry and d.retry.base,
                d.retry and d.retry.cap,
                d.clock_skew,
            )
            if s
        ]
        k = quantum // math.gcd(quantum, *spans) if spans else 1
        lease, r = d.lease, d.retry
        return cls(
            lease=lease.seconds * k if lease else None,
            heartbeat=lease.heartbeat * k if lease and lease.heartbeat else None,
            max_attempts=r.max_attempts if r else None,
            backoff_base=r.base * k if r and r.base else None,
            backoff_cap=r.cap * k if r and r.cap else None,
            scale=k,
            clock_skew=d.clock_skew * k if d.clock_skew else None,
        )


@dataclass(frozen=True)
class Run:
    key: str
    seq: int  # creation order
    status: str
    attempts: int  # as the library counts them (Retry.counts)
    due: int
    lease_until: int | None = None
    claims: int = 0  # every claim so far: the current holder's token
    holder: str = ""  # who claimed it last (a lease per worker is that worker's)
    extra: int = 0  # attempts its take-backs added to the limit (Retry(taken_back="one-more"))


@dataclass(frozen=True)
class Job:
    """What a claim hands a worker: the run's key and its attempts as the library shows them
    at the claim; ``claim``, the holder's token (the run's claim count; None: ``attempt``, as
    when attempts count claims), is the model's own and no part of what is compared."""

    key: str
    attempt: int | None
    claim: int | None = field(default=None, compare=False, repr=False)
    holder: str = field(default="", compare=False, repr=False)
    extra: int = field(default=0, compare=False, repr=False)  # the limit's, as claimed

    @property
    def token(self) -> int | None:
        return self.attempt if self.claim is None else self.claim


@dataclass(frozen=True)
class Observed:
    """A run as the check compares it: the fields the description says the system keeps, in
    relative time (``due_in``: seconds until due, ``lease_left``: until the lease lapses);
    ``holder``: the worker holding it, when the lease is per worker and the rows show it;
    ``max_attempts``: its own limit, when take-backs add to it (``Retry(taken_back=...)``)."""

    key: str
    status: str
    attempts: int | None = None
    due_in: int | None = None
    lease_left: int | None = None
    holder: str | None = None
    max_attempts: int | None = None


class GenericModel:
    """Every run of one described queue, the database clock, and what the external side got."""

    def __init__(self, description: RunKind, timing: Timing | None = None):
        problems = fit_problems(description)
        if problems:
            raise ValueError(f"run kind {description.name!r}: " + "; ".join(problems))
        self.d = description
        self.timing = timing or Timing.of(description)
        self.table = description.table()
        self.owned = description.owned[0]
        self.waiting = description.waiting
        self.now = 0
        self.runs: dict[str, Run] = {}
        self.received: dict[str, int] = {}
        self.beats: dict[str, int] = {}  # a lease per worker: each worker's last beat
        self.app_ahead = APP_AHEAD  # the application's clock, less the database's
        self.app_skew = 0  # the gate's application clock moved apart from the database's
        self.transitions: list[tuple[str, str, str, str]] = []  # drained by the check
        self._next = 1

    # -- plumbing ---------------------------------------------------------------------------
    def copy(self) -> "GenericModel":
        return copy.deepcopy(self)

    _SHARED = frozenset({"d", "timing", "table", "waiting"})  # immutable: every copy shares them

    def __deepcopy__(self, memo: dict) -> "GenericModel":
        """A copy of the state; the description, its timing and its table are shared (copying
        the description was most of a copy's cost, and a check copies a model at every step)."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name in self._SHARED:
                new.__dict__[name] = value
            elif name == "runs":  # a Run's fields are immutable values: a shallow copy each
                new.runs = {key: copy.copy(r) for key, r in value.items()}
            else:
                new.__dict__[name] = copy.deepcopy(value, memo)
        return new

    def advance(self, seconds: int) -> None:
        self.now += seconds
        self.app_ahead -= seconds  # the database's clock moved, not the application's

    def app_now(self) -> int:
        """The application's clock the gate hands the adapter (``Adapter.now()``), in database
        time: it started where the database's did, the gate's database clock jumps moved the
        database's only, and its skews (``skew_app``) the application's only (the library's own
        clock, real time, is ``APP_AHEAD`` further on, never skewed)."""
        return self.now + self.app_ahead - APP_AHEAD + self.app_skew

    def app_apart(self) -> int:
        """Seconds the application's clock is ahead of the database's (behind: negative)."""
        return self.app_now() - self.now

    def skew_app(self, seconds: int) -> None:
        """The gate's application clock (``Adapter.now()``) moves ``seconds``; the database's
        stays."""
        self.app_skew += seconds

    def next_key(self) -> str:
        return str(self._next)

    def backoff(self, attempts: int) -> int:
        return self.d.retry.wait(attempts, self.timing.scale) if self.d.retry else 0

    def tracks_attempts(self) -> bool:
        """Whether the system's rows keep the attempt count (its fence or its retries need it)."""
        return "attempt" in self.d.fence.kinds() or self.d.retry is not None

    def state(self, holders: bool = False) -> tuple[Observed, ...]:
        """Every run as observed; ``holders``: with who holds each held run (the rows show it)."""
        runs = sorted(self.runs.values(), key=lambda r: r.seq)
        return tuple(self.observe(r, holders) for r in runs)

    def observe(self, r: Run, holders: bool = False) -> Observed:
        due = max(0, r.due - self.now) if self.d.retry and r.status in self.waiting else None
        lease = (
            max(0, r.lease_until - self.lease_now())
            if r.status == self.owned and r.lease_until is not None
            else None
        )
        holder = (r.holder or None) if holders and r.status == self.owned else None
        attempts = r.attempts if self.tracks_attempts() else None
        limit = self.limit(r.extra) if self.limits_per_run() else None
        return Observed(r.key, r.status, attempts, due, lease, holder, limit)

    def limits_per_run(self) -> bool:
        """Whether each run keeps a limit of its own (take-backs add to it)."""
        return self.d.retry is not None and self.d.retry.taken_back == "one-more"

    def limit(self, extra: int) -> int:
        return (self.timing.max_attempts or 0) + extra

    def _move(self, r: Run, event: str, **changes) -> Run:
        unguarded = self.d.fence.of(WRITE_OF.get(event, "")) in ("none", "unless-terminal")
        if event == EXTEND and unguarded and r.status != self.owned:
            new = replace(r, **changes)  # a heartbeat by id only stamps the lease, nothing else
            self.runs[r.key] = new
            return new
        if event in OWNER_WRITES and unguarded and r.status != self.owned:
            target = self.table.next(self.owned, event)  # an unconditional write lands anyway
        else:
            target = self.table.next(r.status, event)
        new = replace(r, status=target, **changes)
        self.runs[r.key] = new
        self.transitions.append((r.key, r.status, event, target))
        return new

    def owns(self, job: Job) -> bool:
        """Whether ``job``'s holder still owns its run: still owned, under the same claim."""
        r = self.runs.get(job.key)
        return r is not None and r.status == self.owned and r.claims == job.token

    def _fenced(self, job: Job, write: str) -> Run | None:
        """The run ``write`` by ``job``'s holder lands on, as the described fence decides."""
        r = self.runs.get(job.key)
        if r is None:
            return None
        kind = self.d.fence.of(write)
        if kind == "none":
            return r
        if kind == "unless-terminal":
            return r if r.status not in self.d.terminal else None
        if kind == "status":
            return r if r.status == self.owned else None
        return r if self.owns(job) else None

    def lands(self, job: Job, write: str) -> bool:
        """Whether ``write`` by ``job``'s holder lands, as the described fence decides."""
        return self._fenced(job, write) is not None

    def _refused(self) -> Outcome:
        """A write its guard refused: a lost race, or, from a library whose writes say nothing
        (``Fence(answers=False)``), the same None as a write that landed."""
        return LostRace("fenced") if self.d.fence.answers else Won()

    # -- operations -------------------------------------------------------------------------
    def enqueue(self, key: str) -> Outcome:
        """A new run under ``key``; a repeated key is the same run with an idempotency key, and
        without one a lost race (another producer created it first)."""
        if key in self.runs:
            return Won(key) if self.d.idempotency_key else LostRace(KEY_TAKEN)
        due = {"always": ALWAYS_DUE, "application": self.app_now()}  # a NULL schedule: always
        r = Run(key, self._next, CREATED, 0, due.get(self.d.claim.unscheduled, self.now))
        self._next = max(self._next, int(key) + 1) if key.isdigit() else self._next + 1
        self._move(r, ENQUEUE)
        return Won(key)

    def lease_now(self) -> int:
        """Now by the clock leases are stamped and judged by, in database time: the database's,
        or the application's the gate hands the adapter (``Lease(clock="application")``)."""
        return self.app_now() if self.d.app_clock_lease else self.now

    def lapsed(self, r: Run) -> bool:
        at = self.lease_now()
        return r.status == self.owned and r.lease_until is not None and r.lease_until <= at

    def due(self) -> list[Run]:
        """The runs a claim may take now: waiting and due, and, when the claim re-picks, owned
        runs whose lease lapsed."""
        runs = [r for r in self.runs.values() if r.status in self.waiting and r.due <= self.now]
        if self.d.claim.reclaims:
            runs += [r for r in self.runs.values() if self.lapsed(r)]
        if self.d.claim.order == "due":
            return sorted(runs, key=lambda r: (r.due, r.seq))
        return sorted(runs, key=lambda r: r.seq)

    def claim(self, batch: int, holder: str = "") -> Outcome:
        """Up to ``batch`` due runs, in the claim's order, each ``attempts + 1``, leased (by
        ``holder``'s lease, when the lease is per worker)."""
        return self._take(self.due()[:batch], holder)

    def claim_skipping(self, batch: int, taken: tuple[str, ...], holder: str = "") -> Outcome:
        """A claim among others in flight: ``SKIP LOCKED`` may skip due runs another transaction
        holds (and that transaction may still abort), so what it takes is *some* due runs, at
        most ``batch``. Claims ``taken`` when that is such a choice; a lost race (nothing
        changes) when one of them is not a due run."""
        due = self.due()
        keys = {r.key for r in due}
        if len(taken) > batch or len(set(taken)) != len(taken) or not set(taken) <= keys:
            return LostRace("not a claim SKIP LOCKED can make")
        return self._take([r for r in due if r.key in taken], holder)

    def _per_worker(self) -> bool:
        return self.d.lease is not None and self.d.lease.per == "worker"

    def _take(self, runs: list[Run], holder: str = "") -> Outcome:
        jobs = []
        lease = self.timing.lease
        stamp = self.lease_now()
        if self._per_worker():  # the worker's first claim registers it; a claim stamps nothing
            if holder not in self.beats:
                self._forget_lapsed(holder)
            stamp = self.beats.setdefault(holder, stamp)
        per_claim = self.d.retry is None or self.d.retry.counts == "claims"
        for r in runs:
            attempts = r.attempts + 1 if per_claim and r.status != self.owned else r.attempts
            self._move(
                r,
                CLAIM,
                attempts=attempts,
                claims=r.claims + 1,
                holder=holder,
                lease_until=None if lease is None else stamp + lease,
            )
            jobs.append(Job(r.key, attempts, r.claims + 1, holder, r.extra))
        return Won(tuple(jobs))

    def _forget_lapsed(self, beating: str) -> None:
        """``Lease(lapsed_workers="forgotten")``: a worker's beat deletes every other worker
        whose lease lapsed; their runs' leases stay lapsed whatever the clock does next."""
        if self.d.lease.lapsed_workers != "forgotten":
            return
        for worker, beat in list(self.beats.items()):
            if worker != beating and beat + self.timing.lease <= self.lease_now():
                self.beats[worker] = ALWAYS_DUE  # no row: lapsed at any time
                for r in list(self.runs.values()):
                    if r.status == self.owned and r.holder == worker:
                        self.runs[r.key] = replace(r, lease_until=ALWAYS_DUE)

    def extend_lease(self, job: Job) -> Outcome:
        """The owner's heartbeat; with a lease per worker, its worker's: every run that worker
        holds is extended, whoever's job the beat was for (it names no run)."""
        if self._per_worker():
            self._forget_lapsed(job.holder)
            self.beats[job.holder] = now = self.lease_now()
            for r in list(self.runs.values()):
                if r.status == self.owned and r.holder == job.holder:  # logged: a transition
                    self._move(r, EXTEND, lease_until=now + self.timing.lease)
            return Won()
        r = self._fenced(job, "extend_lease")
        if r is None:
            return self._refused()
        self._move(r, EXTEND, lease_until=self.lease_now() + (self.timing.lease or 0))
        return Won()

    def _finished(self, r: Run) -> int:
        """The attempts of a run whose work just finished, as the library counts them."""
        executions = self.d.retry is not None and self.d.retry.counts == "executions"
        return r.attempts + 1 if executions else r.attempts

    def complete(self, job: Job) -> Outcome:
        r = self._fenced(job, "complete")
        if r is None:
            return self._refused()
        self._move(r, COMPLETE, lease_until=None, attempts=self._finished(r))
        return Won()

    def fail(self, job: Job, permanent: bool) -> Outcome:
        """A failed run of the work: for good, or retried after a backoff, or given up at the
        limit, judged on the count the policy says (the row's, or the one the worker read)."""
        r = self._fenced(job, "fail")
        if r is None:
            return self._refused()
        retry = self.d.retry
        if permanent or retry is None:
            self._move(r, FAIL, lease_until=None, attempts=self._finished(r))
            return Won()
        worker = retry.decided_by == "worker"
        count, extra = (job.attempt, job.extra) if worker else (r.attempts, r.extra)
        if retry.spent(count, self.limit(extra)):
            self._move(r, GIVE_UP, lease_until=None, attempts=self._finished(r))
        else:
            attempts = r.attempts + 1 if retry.counts != "claims" else r.attempts
            due = r.due if retry.backoff == "none" else self.now + self.backoff(retry.runs(count))
            self._move(r, RETRY, lease_until=None, due=due, attempts=attempts)
        return Won()

    def reclaim_stale(self) -> Outcome:
        taken = tuple(
            r.key for r in sorted(self.runs.values(), key=lambda r: r.seq) if self.lapsed(r)
        )
        for key in taken:
            self.take_back(key)
        return Won(taken)

    def take_back(self, key: str) -> Outcome:
        """The reaper's write of one run, if its lease lapsed: put back, or ended at its limit
        (a reaper that takes back one run per transaction, ``Lease(reaps="one-by-one")``, may
        have done any of these when it failed part-way)."""
        r = self.runs.get(key)
        if r is None or not self.lapsed(r):
            return Won(())
        if self.requeues(r):
            extra = r.extra + self.limits_per_run()
            self._move(r, RECLAIM, lease_until=None, due=self._requeued_due(r), extra=extra)
        else:
            self._move(r, RECLAIM_DEAD, lease_until=None)
        return Won((key,))

    def requeues(self, r: Run) -> bool:
        """Whether the reaper puts run ``r`` back to be claimed again: not when it knows the
        retry policy and ``r``'s attempts are spent (it ends the run)."""
        limit = self.timing.max_attempts
        dead = RECLAIM_DEAD in self.d.events() and limit is not None
        dead = dead and r.attempts >= self.limit(r.extra)
        return not dead

    def claimable_once_reaped(self, r: Run) -> bool:
        """Whether a claim can take run ``r``, whose lease lapsed, as soon as the reaper took it
        back: the reaper puts it back (not ends it), due at once."""
        return self.lapsed(r) and self.requeues(r) and self._requeued_due(r) <= self.now

    def _requeued_due(self, r: Run) -> int:
        """When a run the reaper put back is due: now, the application's now, or when it was."""
        clock = self.d.lease.requeue_clock if self.d.lease is not None else "database"
        if clock == "application":
            return self.now + self.app_ahead
        return r.due if clock == "unchanged" else self.now

    def sent(self, key: str) -> None:
        """The external side received one call for this run (at-least-once)."""
        self.received[key] = self.received.get(key, 0) + 1

    # -- the contract's view ------------------------------------------------------------------
    def views(self) -> dict[str, RunView]:
        return views(self.d, self.timing, self.state(), self.received)


def views(
    d: RunKind,
    timing: Timing,
    rows: tuple[Observed, ...],
    received: dict[str, int],
    owing: frozenset[str] = frozenset(),
) -> dict[str, RunView]:
    """Observed runs in the contract's kind-neutral view. The row is the receipt: a completed
    run counts one receipt and one effect of its single step. ``owing``: runs the step just
    failed, which owe their backoff (a reclaimed run is due at once)."""
    done = next((t for s, e, t in d.transitions if e == COMPLETE), None)
    per_worker = d.lease is not None and d.lease.per == "worker"
    out = {}
    for r in rows:
        finished = 1 if r.status == done else 0
        owned = r.status in d.owned and r.lease_left is not None
        # attempts are the fence's token when a claim counts one; else owning is the token
        per_claim = d.retry is None or d.retry.counts == "claims"
        token = r.attempts if r.attempts is not None and per_claim else int(r.status in d.owned)
        retry = None
        if d.retry is not None and r.attempts is not None:
            waiting = r.status in d.waiting and r.attempts > 0
            owed = d.retry.wait(r.attempts, timing.scale) if r.key in owing and waiting else 0
            # counting retries, the last run allowed is the one after max_attempts retries;
            # counting executions, the attempts are finished runs: the limit itself
            limit = r.max_attempts if r.max_attempts is not None else timing.max_attempts or 0
            most = limit + (d.retry.counts == "retries")
            retry = RetryView(r.attempts, most, waiting, due_in=r.due_in or 0, owed=owed)
        out[r.key] = RunView(
            run_id=r.key,
            status=r.status,
            fence_token=token,
            steps={
                STEP: StepView(
                    receipts=finished, effects=finished, external_calls=received.get(r.key, 0)
                )
            },
            retry=retry,
            lease_left=r.lease_left if owned else None,
            # a claim stamps its lease, unless the lease is its worker's (then the run has
            # what the worker's last beat left it: the claim stamps nothing to judge)
            lease_granted=timing.lease if owned and not per_worker else None,
        )
    return out


def cut_short(rows: tuple[Observed, ...], possible: list[tuple[Observed, ...]]) -> list[Violation]:
    """Runs whose lease, or whose wait for their backoff, the database shows shorter than every
    possible state does (``possible``: the rows of each). A held run's lease cut short: the
    system lost lease time its owner was granted (a heartbeat kept where a crash empties it,
    ...), so the run may be taken back while its owner's lease is live, the contract's
    ``lease``. A waiting run due sooner after the same attempts: a retry that did not wait its
    backoff, ``retry-policy``. Both are named where the rows first show them."""
    out = []
    for r in rows:
        same = [x for p in possible for x in p if x.key == r.key]
        if not same:
            continue
        if r.lease_left is not None and all(
            x.lease_left is not None and x.lease_left > r.lease_left for x in same
        ):
            granted = min(x.lease_left for x in same)
            out.append(
                Violation(
                    "lease",
                    f"run {r.key}: its lease has {r.lease_left}s left in the database, "
                    f"{granted}s by its owner's last heartbeat: lease time lost, so "
                    "the run can be taken back while its owner's lease is live",
                )
            )
        waits = [x.due_in for x in same if (x.status, x.attempts) == (r.status, r.attempts)]
        if (
            r.attempts
            and r.due_in is not None
            and len(waits) == len(same)
            and all(w is not None and w > r.due_in for w in waits)
        ):
            out.append(
                Violation(
                    "retry-policy",
                    f"run {r.key} is due again in {r.due_in}s after attempt {r.attempts}, "
                    f"where every possible state has it wait {min(waits)}s: its backoff cut short",
                )
            )
    return out
