"""Branch reset: reset a database branch through an external operations API (dbops/operations.ts).

Theory of operation
-------------------

A *branch reset* is one row per request. Its life is one table (:data:`TABLE`)::

    (new) --request--> queued --start--> running --poll_succeeded--> succeeded
                                          |  ^   --poll_failed-----> failed
                                          |  |   --reap------------> failed
                                          +--+   --cancel----------> canceled
                                   poll_in_progress

There is no ``queued -> canceled``. The seed orders the statuses "queued → running →
succeeded | failed | canceled" and guards every transition that ends a run on
``status = 'running'``. A queued run has no owner and no external operation, and any worker
moves it on by ``start``. So ``cancel`` is the running run's exit, and only that.

The run's one real effect happens outside the database: ``start`` creates an *operation* at
the operations API, and from then on the run only *polls* it. The stand-in API takes an
idempotency key, and the run id is that key. A worker that dies between the HTTP create and
its COMMIT leaves the run ``queued`` (the claim rolled back) and the operation created. The
next ``start`` sends the same key, gets the same operation back, and the API counts no second
creation. **The external effect is exactly one creation, because the API takes an idempotency
key.** The POST itself is at least once.

The contract, element by element (:data:`CONTRACT`):

claim
    At most one run in flight (queued or running) per branch, enforced by a partial unique
    index, plus an ``idempotency_key`` under a unique index. A repeated request with the same
    key gets the existing run back, terminal or not. It never makes a second run.
lease + reaper
    ``start`` and every in-progress ``poll`` stamp ``lease_until = app_now + lease``. Every
    poll checks the lease first, and a poll that finds it lapsed writes nothing. ``reap``
    (the dbops-reaper job) fails every running run whose lease lapsed. **The lease is read and
    stamped in application time**, each worker's own clock, not the database's ``now()``.
    The seed records this as a deviation, and so does :data:`CONTRACT`.
fence
    Every write that leaves ``running`` or extends it matches ``status = 'running'``. A stalled
    poller that wakes up after a reap or a cancel matches no row (a lost race).
receipts
    The external operation's id and every status observed by a poll (``op_statuses``,
    dbops' ``neonOpStatuses``) are written on the run row, in the same transaction as the
    transition they caused.
retry policy
    None. The external operation is polled, never re-issued. A failed reset is a receipt, and
    another reset is another request.

Clocks and the skew bound
-------------------------

The model has two kinds of clock. ``now`` is the database clock, integer seconds that the
check controls with :meth:`BranchResetModel.advance`. Time passing moves every clock.
Each worker also has an application clock, ``now + app_skew[worker]``, which
:meth:`BranchResetModel.skew` moves alone. The branch-reset lease reads only application
clocks. A database-only clock jump changes nothing here.

Let ``L`` be the lease and ``M`` the poll margin: a live run is polled at least every ``M``
seconds. A poll at real time ``t_p`` by a worker with skew ``s_p`` stamps
``lease_until = t_p + s_p + L``. A reaper with skew ``s_r`` at real time ``t_r`` finds that
lease lapsed exactly when ``(t_r - t_p) + (s_r - s_p) >= L``. A live run has
``t_r - t_p <= M``, so the following holds:

* **Bound.** When the reaper's clock is less than ``L - M`` ahead of the last poller's
  (``s_r - s_p < L - M``), no live run is ever reaped. The same bound holds between two
  pollers: a poll never finds a live run's lease lapsed.
* **Past the bound, the known deviation.** When ``s_r - s_p >= L - M``, a reap made just before
  a poll that is due ends a live run as ``failed``. Its external operation keeps going, and
  the run's row no longer follows it. The reset on the external side stays a single
  creation, so the fence and the create-once invariant still hold. The run's status is
  wrong. This deviation would not happen with a database-clock lease.
  :func:`skew_bound` gives ``L - M``: 540 s for the defaults (600 s lease, 60 s margin).
* A reaper whose clock is *behind* never reaps a live run. It reaps a dead run ``|s_r - s_p|``
  seconds late.

State shape
-----------

:meth:`BranchResetModel.rows` gives ``{run_id: Run}``. The implementation's ``project``
returns exactly this. :meth:`BranchResetModel.external_state` gives the operations API's state
(:class:`ExternalState`), and the stand-in's ``snapshot()`` returns exactly that. Run ids are
``"<branch>#<n>"``, where ``n`` counts the branch's runs. Operation ids are ``"op-<n>"`` in
order of creation at the API.

Operations return outcomes (:class:`Won`, :class:`LostRace`, :class:`Rejected`). A guard that
does not match is ``LostRace``, as it is in SQL. A run id that names no run is
``Rejected("no such run")``. The table step every operation ends with is :meth:`fire`. Asked
for a transition the table lacks, it raises :class:`IllegalTransition` and changes nothing.

An external call that fails (stand-in unreachable, a 503, a timeout) is an exception in the
implementation, and the run's row does not change. The check then does not apply the operation
to the model. If the stand-in acted all the same (a POST whose answer was lost), the check
mirrors that with :meth:`BranchResetModel.external_create`. The same call mirrors a worker that
died between the create and its COMMIT.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Mapping

from .contract import (
    CREATED,
    IllegalTransition,
    LostRace,
    Outcome,
    Rejected,
    RunView,
    StepView,
    Won,
)
from .describe import Claim, Fence, Lease, RunKind

KIND = "branch-reset"

LEASE_SECONDS = 600
"""Default lease: generous, because it only guards crashes (the seed)."""

POLL_INTERVAL_SECONDS = 60
"""Default poll margin M: a live run is polled at least this often."""


class Status(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class Event(enum.StrEnum):
    REQUEST = "request"
    START = "start"
    POLL_IN_PROGRESS = "poll_in_progress"
    POLL_SUCCEEDED = "poll_succeeded"
    POLL_FAILED = "poll_failed"
    CANCEL = "cancel"
    REAP = "reap"


class ExternalStatus(enum.StrEnum):
    """An operation's status at the operations API."""

    IN_PROGRESS = "in_progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


DESCRIPTION = RunKind(
    name="branch-reset",
    statuses=("queued", "running", "succeeded", "failed", "canceled"),
    initial="queued",
    owned=("running",),
    terminal=("succeeded", "failed", "canceled"),
    transitions=(
        "(new) -request-> queued",
        "queued -start-> running",
        "running -poll_in_progress-> running",
        "running -poll_succeeded-> succeeded",
        "running -poll_failed-> failed",
        "running -cancel-> canceled",
        "running -reap-> failed",
    ),
    claim=Claim(
        how="one run in flight per branch (partial unique index over queued|running) + "
        "idempotency_key under a unique index: a repeated request with the same key "
        "returns the existing run",
        skip_locked=False,
    ),
    lease=Lease(
        seconds="10m",
        clock="application",
        taken_back_by=("reap",),
        how="lease_until = app_now + 600 s, stamped by start and by every in-progress "
        "poll; checked on every poll, and a poll that finds it lapsed writes nothing",
        reaper="dbops-reaper job: reap fails every running run whose lease lapsed, "
        "judged by the reaper's app clock",
    ),
    fence=Fence(
        kind="status",
        how="every transition out of running, and every lease extension, is guarded on "
        "status = 'running'",
    ),
    receipts="the external operation id and the observed operation statuses (op_statuses, "
    "dbops' neonOpStatuses) on the run row, written with the transition they cause",
    retry_prose="none: the external operation is polled, never re-issued",
    external="create-once-then-poll",
    external_key=True,
    idempotency_key="idempotency_key under a unique index: a repeated request with the same key "
    "gets the existing run",
    deviations=(
        "lease in application time, not database now(): each worker's clock judges the lease, "
        "so an app-clock skew of L - M or more (reaper ahead of the last poller; 540 s with the "
        "defaults) can reap a live run. Below that bound no live run is reaped. Accepted "
        "because the lease is generous and only guards crashes.",
        "the POST that creates the operation is at least once; the creation is exactly once "
        "because the operations API takes an idempotency key (the run id).",
    ),
)
"""The kind, described as data: its contract and transition table are computed from it, and
its column of ``specs/contract.md`` is generated from it."""

CONTRACT = DESCRIPTION.contract()
"""The kind's contract, computed from its description."""
TABLE = CONTRACT.table

IN_FLIGHT = frozenset({Status.QUEUED, Status.RUNNING})
TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELED})

POLL_EVENT = {
    ExternalStatus.IN_PROGRESS: Event.POLL_IN_PROGRESS,
    ExternalStatus.SUCCEEDED: Event.POLL_SUCCEEDED,
    ExternalStatus.FAILED: Event.POLL_FAILED,
}
"""What a poll does to the run, given the operation's status it observed."""

# Outcome reasons. The implementation returns the same strings, so outcomes compare equal.
NO_SUCH_RUN = "no such run"
IN_FLIGHT_REASON = "in flight"
KEY_REUSED = "idempotency key reused for another branch"
LEASE_LAPSED = "lease lapsed"
EXTERNAL_FAILED = "external operation failed"


def not_in(status: str) -> str:
    """The reason of a lost race: the guard expected another status."""
    return f"run is {status}"


ERROR = {Event.POLL_FAILED: EXTERNAL_FAILED, Event.REAP: LEASE_LAPSED}
"""The ``error`` a transition writes on the row (None for the others)."""

EXTERNAL_STEP = "external-operation"
"""The one step of a branch reset: the external operation, created once then polled."""

GENERATION = {
    Status.QUEUED: 0,
    Status.RUNNING: 1,
    Status.SUCCEEDED: 2,
    Status.FAILED: 2,
    Status.CANCELED: 2,
}
"""The fence token of RunView. The fence is the status itself: a write must find the run at
generation 1 (running)."""


def skew_bound(lease: int = LEASE_SECONDS, poll_interval: int = POLL_INTERVAL_SECONDS) -> int:
    """``L - M``. An application-clock skew of the reaper (or of another poller) ahead of the last
    poller, strictly below this, never ends a live run. At or above it, a reap can end one."""
    return lease - poll_interval


# ---------------------------------------------------------------------------
# State: rows (what the database holds) and the operations API's state.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One branch_reset row, in model time (integer seconds)."""

    run_id: str
    branch: str
    idempotency_key: str
    status: Status
    claimed_by: str | None = None  # the worker whose start won
    external_op_id: str | None = None
    op_statuses: tuple[str, ...] = ()  # observed operation statuses, a new entry on each change
    lease_until: int | None = None  # application time; set exactly while running
    error: str | None = None


@dataclass(frozen=True)
class ExternalOp:
    """One operation at the operations API."""

    op_id: str
    run_id: str
    branch: str
    idempotency_key: str
    status: ExternalStatus


@dataclass(frozen=True)
class ExternalState:
    """The operations API's state: its operations, and the create requests it acted on per run
    (a create answered with an existing operation counts here, not as a creation)."""

    ops: Mapping[str, ExternalOp] = field(default_factory=dict)
    create_requests: Mapping[str, int] = field(default_factory=dict)

    def creations(self, run_id: str) -> int:
        """Operations created for the run: the number create-once says is at most 1."""
        return sum(1 for op in self.ops.values() if op.run_id == run_id)


def views(rows: Mapping[str, Run], external: ExternalState) -> dict[str, RunView]:
    """The kind-neutral views that :func:`knownstate.model.contract.check_invariants` reads, built
    from rows plus the operations API's state. The model and the projection+stand-in both use
    this."""
    out: dict[str, RunView] = {}
    for run_id, r in rows.items():
        step = StepView(
            receipts=1 if r.external_op_id is not None else 0,  # the op id recorded on the row
            # the claim that took the run past queued
            effects=0 if r.status is Status.QUEUED else 1,
            external_calls=external.create_requests.get(run_id, 0),
        )
        out[run_id] = RunView(
            run_id=run_id,
            status=r.status.value,
            fence_token=GENERATION[r.status],
            steps={EXTERNAL_STEP: step},
            valid_step_ids=frozenset({EXTERNAL_STEP}),
            external_creations=external.creations(run_id),
        )
    return out


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


class BranchResetModel:
    """Every run, the database clock, each worker's application clock, and the operations API."""

    def __init__(self, lease: int = LEASE_SECONDS):
        self.lease = lease
        self.now = 0
        self.app_skew: dict[str, int] = {}
        self.runs: dict[str, Run] = {}
        self.ops: dict[str, ExternalOp] = {}
        self.create_requests: dict[str, int] = {}
        self.transitions: list[tuple[str, str, str, str]] = []
        """(run_id, source, event, target) of every transition taken, in order; the stateful check
        drains it after each step to count which rows of :data:`TABLE` it observed."""

    # -- clocks ---------------------------------------------------------------
    def advance(self, seconds: int) -> None:
        """Time passes: the database clock and every application clock move together."""
        self.now += seconds

    def skew(self, worker: str, seconds: int) -> None:
        """Move one worker's application clock by ``seconds`` (cumulative; negative: back)."""
        self.app_skew[worker] = self.app_skew.get(worker, 0) + seconds

    def app_now(self, worker: str) -> int:
        return self.now + self.app_skew.get(worker, 0)

    # -- the table ------------------------------------------------------------
    def fire(self, run_id: str, event: str) -> Run:
        """Move a run along the table by ``event`` alone, with no guard and no side effect.
        Every operation ends with this step. An event the table lacks from the run's status
        raises IllegalTransition and leaves the state unchanged."""
        run = self.runs[run_id]
        self.runs[run_id] = moved = self._moved(run, Event(event))
        return moved

    def _moved(self, run: Run | None, event: Event, **changes) -> Run:
        """The one transition function: ``run`` (None: a new run, from ``(new)``) takes ``event``
        per :data:`TABLE`, with ``changes`` applied, and the transition is logged. Raises
        IllegalTransition before any change."""
        source = CREATED if run is None else run.status.value
        target = Status(TABLE.next(source, event.value))
        if target is not Status.RUNNING:
            changes.setdefault("lease_until", None)
        if event in ERROR:
            changes.setdefault("error", ERROR[event])
        moved = (
            Run(status=target, **changes) if run is None else replace(run, status=target, **changes)
        )
        self.transitions.append((moved.run_id, source, event.value, target.value))
        return moved

    # -- operations (the implementation's vocabulary) --------------------------
    def request(self, branch: str, idempotency_key: str) -> Outcome:
        """Ask for a reset of ``branch``. Won(run_id): a new queued run, or the existing run when
        the key was seen before. Rejected: the key belongs to another branch's run, or another run
        is in flight on this branch."""
        for r in self.runs.values():
            if r.idempotency_key == idempotency_key:
                return Won(r.run_id) if r.branch == branch else Rejected(KEY_REUSED)
        if any(r.branch == branch and r.status in IN_FLIGHT for r in self.runs.values()):
            return Rejected(IN_FLIGHT_REASON)
        n = 1 + sum(1 for r in self.runs.values() if r.branch == branch)
        run_id = f"{branch}#{n}"
        self.runs[run_id] = self._moved(
            None, Event.REQUEST, run_id=run_id, branch=branch, idempotency_key=idempotency_key
        )
        return Won(run_id)

    def start(self, run_id: str, worker: str) -> Outcome:
        """queued -> running: claim the run, create its external operation once (the run id is
        the API's idempotency key), stamp the lease in the worker's app time. Won(op_id)."""
        run = self.runs.get(run_id)
        if run is None:
            return Rejected(NO_SUCH_RUN)
        if run.status is not Status.QUEUED:
            return LostRace(not_in(run.status))
        op = self.external_create(run_id, run.branch)
        self.runs[run_id] = self._moved(
            run,
            Event.START,
            claimed_by=worker,
            external_op_id=op.op_id,
            op_statuses=(op.status.value,),
            lease_until=self.app_now(worker) + self.lease,
        )
        return Won(op.op_id)

    def poll(self, run_id: str, worker: str) -> Outcome:
        """Check the lease in the worker's app time, ask the API for the operation's status,
        record what was observed, and finish the run if the operation finished, else extend the
        lease. Guarded on running. Won(the run's status after the poll)."""
        run = self.runs.get(run_id)
        if run is None:
            return Rejected(NO_SUCH_RUN)
        if run.status is not Status.RUNNING:
            return LostRace(not_in(run.status))
        app = self.app_now(worker)
        if run.lease_until <= app:
            return LostRace(LEASE_LAPSED)
        observed = self.external_status(run.external_op_id)
        statuses = (
            run.op_statuses
            if run.op_statuses[-1:] == (observed.value,)
            else run.op_statuses + (observed.value,)
        )
        event = POLL_EVENT[observed]
        changes: dict = {"op_statuses": statuses}
        if event is Event.POLL_IN_PROGRESS:
            changes["lease_until"] = app + self.lease
        self.runs[run_id] = moved = self._moved(run, event, **changes)
        return Won(moved.status.value)

    def cancel(self, run_id: str) -> Outcome:
        """running -> canceled. The external operation is not touched; the run stops following
        it."""
        run = self.runs.get(run_id)
        if run is None:
            return Rejected(NO_SUCH_RUN)
        if run.status is not Status.RUNNING:
            return LostRace(not_in(run.status))
        self.runs[run_id] = self._moved(run, Event.CANCEL)
        return Won(Status.CANCELED.value)

    def reap(self, worker: str) -> Outcome:
        """The dbops-reaper: fail every running run whose lease lapsed by this worker's app clock.
        Won(the reaped run ids, sorted); Won(()) when there was none."""
        app = self.app_now(worker)
        lapsed = sorted(
            r.run_id
            for r in self.runs.values()
            if r.status is Status.RUNNING and r.lease_until <= app
        )
        for run_id in lapsed:
            self.runs[run_id] = self._moved(self.runs[run_id], Event.REAP)
        return Won(tuple(lapsed))

    # -- the operations API (mirrors the stand-in) ----------------------------
    def external_create(
        self, run_id: str, branch: str, idempotency_key: str | None = None
    ) -> ExternalOp:
        """A create request the API acted on. The same idempotency key (default: the run id)
        returns the existing operation, and only a new key creates one."""
        key = run_id if idempotency_key is None else idempotency_key
        self.create_requests[run_id] = self.create_requests.get(run_id, 0) + 1
        for op in self.ops.values():
            if op.idempotency_key == key:
                return op
        op = ExternalOp(
            op_id=f"op-{len(self.ops) + 1}",
            run_id=run_id,
            branch=branch,
            idempotency_key=key,
            status=ExternalStatus.IN_PROGRESS,
        )
        self.ops[op.op_id] = op
        return op

    def external_status(self, op_id: str) -> ExternalStatus:
        return self.ops[op_id].status

    def external_finish(self, op_id: str, ok: bool) -> None:
        """The check decides: the operation succeeded (ok) or failed. Only an operation in
        progress finishes; otherwise IllegalTransition, and nothing changes."""
        op = self.ops[op_id]
        if op.status is not ExternalStatus.IN_PROGRESS:
            raise IllegalTransition(f"{KIND} operations API", op.status.value, "finish")
        target = ExternalStatus.SUCCEEDED if ok else ExternalStatus.FAILED
        self.ops[op_id] = replace(op, status=target)

    # -- state ----------------------------------------------------------------
    def rows(self) -> dict[str, Run]:
        """The state shape ``knownstate.impl.branch_reset.project`` returns."""
        return dict(self.runs)

    def external_state(self) -> ExternalState:
        """The state shape ``knownstate.chaos.opsapi.OpsApi.snapshot`` returns."""
        return ExternalState(ops=dict(self.ops), create_requests=dict(self.create_requests))

    def views(self) -> dict[str, RunView]:
        return views(self.runs, self.external_state())

    def copy(self) -> "BranchResetModel":
        other = BranchResetModel(self.lease)
        other.now = self.now
        other.app_skew = dict(self.app_skew)
        other.runs = dict(self.runs)
        other.ops = dict(self.ops)
        other.create_requests = dict(self.create_requests)
        other.transitions = list(self.transitions)
        return other

    def _key(self):
        return (
            self.lease,
            self.now,
            {w: s for w, s in self.app_skew.items() if s},
            self.runs,
            self.ops,
            self.create_requests,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BranchResetModel):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        runs = ", ".join(f"{r.run_id}:{r.status.value}" for r in self.runs.values())
        return (
            f"BranchResetModel(now={self.now}, skew={self.app_skew}, runs=[{runs}], "
            f"ops={len(self.ops)})"
        )
