"""The approved-plan executor, as a pure state machine.

Theory of operation
-------------------

A *proposal* is a plan: an ordered list of steps that someone (an AI agent) proposes and a
person approves. Approval freezes the payload. From then on a step *is* its position in that
frozen list (``step_index``); nothing ever counts calls to decide which step comes next.

Executing a proposal is a run with the shared contract (:mod:`knownstate.model.contract`):

status machine
    ``pending -> approved -> executing -> executed | failed``, plus ``expired`` and
    ``rejected``. :data:`TABLE` is the whole machine. Every operation's guard *is* a lookup in
    that table: when the run's status has no row for the operation's event, the operation
    returns :class:`LostRace` and changes nothing, exactly as the implementation's
    ``UPDATE ... WHERE status = <from>`` matches no row. :meth:`ApprovedPlanModel.transition`
    is the unguarded table step; it raises :class:`IllegalTransition` (state unchanged).
claim
    ``mark_executing``: the conditional ``approved -> executing``. Exactly one caller wins and
    gets the claim token (the run's execution generation, 1: a plan is claimed at most once).
lease + reaper
    Every step stamps a heartbeat with the database clock (:attr:`ApprovedPlanModel.now`).
    There is no background reaper: the next *read* of a run that is executing with a
    heartbeat ``heartbeat_s`` or more seconds old moves it to ``failed`` ("interrupted"). This
    is ``mark_interrupted_if_stale``; ``read``, ``repeat`` and ``compensate`` all start with
    it. Until somebody reads, a late owner simply carries on: since a plan is never
    re-executed there is no second owner to protect, only readers to tell the truth.
fence
    ``run_step`` and ``heartbeat`` lock the run and refuse (``LostRace``) unless it is still
    executing under the caller's token (``lock_executing``). After a read healed the run,
    the stalled owner can no longer write anything.
receipts
    Each step's database effect (a ledger row and a balance change in the demo domain) and its
    receipt (``agent_proposal_step``, key ``(proposal_id, step_index)``) happen in one atomic
    operation. Running a step that already has a receipt answers from the receipt.
retry policy
    None. The run stops at the first step that is not ok and becomes ``failed``; the steps
    before it stay committed. A new plan is a new proposal. Undoing committed steps is a
    separate *compensating* proposal (``compensate``), linked to the original, whose steps
    undo the committed ones in reverse order and which has its own receipts. No cross-step
    rollback is ever claimed.

The demo domain makes "exactly once per step" countable from the data: a step is
``{"op": "credit", "account": "a", "amount": 5}``, ``{"op": "debit", ...}`` (not ok, and
without effect, when the account holds less than the amount) or ``{"op": "fail"}`` (never ok).
An ok credit or debit writes one :class:`LedgerEntry` tagged ``(proposal_id, step_index)``.

Time is the database clock in whole seconds; the check controls it with :meth:`advance`.
Operations return outcomes (``Won``, ``LostRace``, ``Rejected``); none raises for a race.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from knownstate.model.contract import (
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

KIND = "approved-plan"
HEARTBEAT_S = 120
"""Default heartbeat: a run whose last stamp is older than this is interrupted on the next read."""

MAX_AMOUNT = 1_000_000_000


class Status(enum.StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    EXECUTING = "executing"
    EXECUTED = "executed"
    FAILED = "failed"
    EXPIRED = "expired"
    REJECTED = "rejected"


DESCRIPTION = RunKind(
    name="approved-plan",
    statuses=("pending", "approved", "executing", "executed", "failed", "expired", "rejected"),
    initial="pending",
    owned=("executing",),
    terminal=("executed", "failed", "expired", "rejected"),
    transitions=(
        "(new) -propose-> pending",
        "(new) -compensate-> pending",
        "pending -revise-> pending",
        "pending -approve-> approved",
        "pending -reject-> rejected",
        "pending -expire-> expired",
        "approved -expire-> expired",
        "approved -mark_executing-> executing",
        "executing -heartbeat-> executing",
        "executing -step_ok-> executing",
        "executing -last_step_ok-> executed",
        "executing -step_failed-> failed",
        "executing -mark_interrupted_if_stale-> failed",
    ),
    claim=Claim(
        how="mark_executing: the conditional approved -> executing; exactly one caller "
        "wins the claim token",
        skip_locked=False,
    ),
    lease=Lease(
        seconds="120s",
        taken_back_by=("mark_interrupted_if_stale",),
        how="120 s per-step heartbeat, stamped with the database's now() by the claim "
        "and by every step",
        reaper="none in the background: mark_interrupted_if_stale heals a stale "
        "executing run to failed on the next read (read, repeat, compensate)",
    ),
    fence=Fence(
        kind="row-lock",
        how="lock_executing: each step's transaction locks the run row and refuses "
        "unless it is still executing under the caller's token",
    ),
    receipts="agent_proposal_step, primary key (proposal_id, step_index), written in the step's "
    "own transaction together with the step's database effect",
    retry_prose="none: a failed step is a receipt and a new plan is a new proposal; undoing "
    "committed steps is a separate compensating proposal with its own receipts",
    external="none",
)
"""The kind, described as data: its contract and transition table are computed from it, and
its column of ``specs/contract.md`` is generated from it."""

CONTRACT = DESCRIPTION.contract()
"""The kind's contract, computed from its description."""
TABLE = CONTRACT.table
"""``(source, event) -> target``: the whole status machine, and every operation's guard."""

TERMINAL = frozenset({Status.EXECUTED, Status.FAILED, Status.EXPIRED, Status.REJECTED})


INTERRUPTED = "interrupted: no heartbeat within the lease"


# ---------------------------------------------------------------------------
# Values: steps, receipts, runs, the demo domain and the whole state.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of a plan. ``credit``/``debit`` move ``amount`` on ``account``; ``fail`` never
    succeeds."""

    op: str
    account: str | None = None
    amount: int | None = None

    @classmethod
    def from_json(cls, d: Mapping) -> "Step":
        return cls(d["op"], d.get("account"), d.get("amount"))

    def to_json(self) -> dict:
        return (
            {"op": self.op}
            if self.op == "fail"
            else {"op": self.op, "account": self.account, "amount": self.amount}
        )

    def inverse(self) -> "Step":
        """The step that undoes this one once it committed ok."""
        return replace(self, op={"credit": "debit", "debit": "credit"}[self.op])


@dataclass(frozen=True)
class Receipt:
    """What committed for one step, with its effect. ``ok=False``: the step ran and failed (no
    effect)."""

    step_index: int
    ok: bool
    detail: str


@dataclass(frozen=True)
class Proposal:
    proposal_id: int
    status: Status
    steps: tuple[Step, ...]
    compensates: int | None = None  # the proposal this one undoes
    generation: int = 0  # the claim token: 1 once claimed (a plan is claimed at most once)
    heartbeat_at: int | None = None  # database clock, model seconds
    failure: str | None = None
    receipts: tuple[Receipt, ...] = ()  # ordered by step_index


@dataclass(frozen=True, order=True)
class LedgerEntry:
    """One database effect of one step in the demo domain (no uniqueness: duplicates stay
    countable)."""

    proposal_id: int
    step_index: int
    account: str
    delta: int


@dataclass(frozen=True)
class PlanState:
    """Everything observable, in the shape the implementation's ``project`` returns."""

    proposals: tuple[Proposal, ...] = ()  # ordered by proposal_id
    balances: tuple[tuple[str, int], ...] = ()  # (account, balance), ordered by account
    ledger: tuple[LedgerEntry, ...] = ()  # sorted


@dataclass(frozen=True)
class RunReport:
    """What ``read`` and ``repeat`` answer: the run as seen, from its row and its receipts."""

    proposal_id: int
    status: Status
    failure: str | None
    receipts: tuple[Receipt, ...]


# ---------------------------------------------------------------------------
# Pure rules shared with the implementation, so both sides say the same thing.
# ---------------------------------------------------------------------------


def parse_steps(steps: Iterable) -> tuple[Step, ...] | Rejected:
    """The payload as frozen steps, or why it is not a plan."""
    try:
        items = list(steps)
    except TypeError:
        return Rejected("a plan is a list of steps")
    if not items:
        return Rejected("a plan has at least one step")
    out = []
    for i, s in enumerate(items):
        d = s.to_json() if isinstance(s, Step) else s
        if not isinstance(d, Mapping) or d.get("op") not in ("credit", "debit", "fail"):
            return Rejected(f"step {i}: op must be credit, debit or fail")
        if d["op"] == "fail":
            if set(d) != {"op"}:
                return Rejected(f"step {i}: a fail step has no other fields")
        else:
            account, amount = d.get("account"), d.get("amount")
            if set(d) != {"op", "account", "amount"} or not isinstance(account, str) or not account:
                return Rejected(f"step {i}: {d['op']} needs an account and an amount")
            if type(amount) is not int or not 0 < amount <= MAX_AMOUNT:
                return Rejected(f"step {i}: amount must be a whole number from 1 to {MAX_AMOUNT}")
        out.append(Step.from_json(d))
    return tuple(out)


def describe(step: Step, ok: bool) -> str:
    """A receipt's detail line."""
    if step.op == "fail":
        return "failed by its payload"
    if step.op == "credit":
        return f"credited {step.amount} to {step.account}"
    return (
        f"debited {step.amount} from {step.account}"
        if ok
        else f"{step.account} holds less than {step.amount}"
    )


def step_failure(step_index: int, detail: str) -> str:
    return f"step {step_index}: {detail}"


def lost(event: str) -> LostRace:
    """The lost race of an operation whose guard matched no row."""
    sources = [t.source for t in TABLE.transitions if t.event == event]
    return LostRace(f"{event}: not {' or '.join(sources)}")


def no_proposal(proposal_id: int) -> Rejected:
    return Rejected(f"no proposal {proposal_id}")


def fence(event: str, status: str, generation: int, token: int) -> LostRace | None:
    """lock_executing's verdict on the locked row: None lets the caller write."""
    if status != Status.EXECUTING:
        return LostRace(f"{event}: not executing")
    if token != generation:
        return LostRace(f"{event}: token {token} does not hold the claim")
    return None


def compensation_steps(steps: tuple[Step, ...], receipts: Iterable[Receipt]) -> tuple[Step, ...]:
    """The committed steps' inverses, last committed first."""
    done = sorted((r.step_index for r in receipts if r.ok), reverse=True)
    return tuple(steps[i].inverse() for i in done)


NOTHING_TO_COMPENSATE = Rejected("compensate: no step committed ok, nothing to undo")
COMPENSATION_IS_FROZEN = Rejected("revise: a compensation's steps come from the receipts it undoes")


def not_terminal(status: str) -> Rejected:
    return Rejected(f"repeat: run is {status}, not terminal")


def compensation_refusal(status: str) -> Rejected | None:
    if status in (Status.EXECUTED, Status.FAILED):
        return None
    return Rejected(
        f"compensate: run is {status}; only an executed or failed run has committed steps"
    )


def check_step_index(steps: tuple[Step, ...], done: int, step_index: int) -> Rejected | bool | None:
    """None: this is the next step, run it. True: it already has a receipt, answer from it.
    Rejected: it is not a position of the frozen payload, or not the next one."""
    if type(step_index) is not int or not 0 <= step_index < len(steps):
        return Rejected(f"run_step: no step {step_index} in a plan of {len(steps)}")
    if step_index < done:
        return True
    if step_index > done:
        return Rejected(f"run_step: step {step_index} out of order, step {done} is next")
    return None


def step_event(ok: bool, step_index: int, n_steps: int) -> str:
    if not ok:
        return "step_failed"
    return "last_step_ok" if step_index == n_steps - 1 else "step_ok"


def report(p: Proposal) -> RunReport:
    return RunReport(p.proposal_id, p.status, p.failure, p.receipts)


def views(state: PlanState) -> dict[str, RunView]:
    """The kind-neutral view the six invariants read. A step's ``receipts`` are its receipts that
    claim an effect (ok ones); its ``effects`` are counted in the ledger, not taken from
    receipts."""
    effects: dict[tuple[int, int], int] = {}
    for e in state.ledger:
        effects[(e.proposal_id, e.step_index)] = effects.get((e.proposal_id, e.step_index), 0) + 1
    out: dict[str, RunView] = {}
    for p in state.proposals:
        ok = {r.step_index for r in p.receipts if r.ok}
        failed = {r.step_index for r in p.receipts if not r.ok}
        ids = ok | failed | {i for (pid, i) in effects if pid == p.proposal_id}
        out[str(p.proposal_id)] = RunView(
            run_id=str(p.proposal_id),
            status=p.status.value,
            fence_token=p.generation,
            steps={
                str(i): StepView(
                    receipts=int(i in ok),
                    effects=effects.get((p.proposal_id, i), 0),
                    failed=int(i in failed),
                )
                for i in sorted(ids)
            },
            valid_step_ids=frozenset(str(i) for i in range(len(p.steps))),
        )
    return out


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


class ApprovedPlanModel:
    """All proposals, the demo domain, and the database clock ``now`` (whole seconds)."""

    def __init__(self, heartbeat_s: int = HEARTBEAT_S, now: int = 0):
        self.heartbeat_s = heartbeat_s
        self.now = now
        self._runs: dict[int, Proposal] = {}
        self._balances: dict[str, int] = {}
        self._ledger: list[LedgerEntry] = []
        self.transitions: list[tuple[int, str, str, str]] = []
        """Every transition taken, ``(proposal_id, source, event, target)``, in order; the
        stateful check drains it to count which rows of :data:`TABLE` were observed."""

    # -- clock, copies, observation ----------------------------------------------
    def advance(self, seconds: int) -> None:
        self.now += seconds

    def copy(self) -> "ApprovedPlanModel":
        m = ApprovedPlanModel(self.heartbeat_s, self.now)
        m._runs, m._balances, m._ledger = dict(self._runs), dict(self._balances), list(self._ledger)
        m.transitions = list(self.transitions)
        return m

    def state(self) -> PlanState:
        return PlanState(
            proposals=tuple(self._runs[k] for k in sorted(self._runs)),
            balances=tuple(sorted(self._balances.items())),
            ledger=tuple(sorted(self._ledger)),
        )

    def views(self) -> dict[str, RunView]:
        return views(self.state())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ApprovedPlanModel):
            return NotImplemented
        return (self.now, self.heartbeat_s, self.state()) == (
            other.now,
            other.heartbeat_s,
            other.state(),
        )

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        runs = ", ".join(f"{p.proposal_id}:{p.status.value}" for p in self.state().proposals)
        return f"<ApprovedPlanModel now={self.now} runs=[{runs}]>"

    def proposal(self, proposal_id: int) -> Proposal | None:
        return self._runs.get(proposal_id)

    # -- the table ---------------------------------------------------------------
    def transition(self, proposal_id: int, event: str) -> Status:
        """The unguarded table step: move the run along ``event``. Raises
        :class:`IllegalTransition` (state unchanged) when the table has no such row."""
        p = self._runs[proposal_id]
        target = Status(TABLE.next(p.status.value, event))
        self._runs[proposal_id] = replace(p, status=target)
        self.transitions.append((proposal_id, p.status.value, event, target.value))
        return target

    @staticmethod
    def _allows(p: Proposal, event: str) -> bool:
        try:
            TABLE.next(p.status.value, event)
            return True
        except IllegalTransition:
            return False

    def _conditional(self, proposal_id: int, event: str, **changes) -> Outcome:
        """UPDATE ... WHERE id = :id AND status = <a source of event>."""
        p = self._runs.get(proposal_id)
        if p is None:
            return no_proposal(proposal_id)
        if not self._allows(p, event):
            return lost(event)
        self.transition(proposal_id, event)
        self._runs[proposal_id] = replace(self._runs[proposal_id], **changes)
        return Won()

    def _heal(self, proposal_id: int) -> None:
        """mark_interrupted_if_stale: a run executing with a heartbeat older than the lease fails.

        ``>=``, while the SQL says ``heartbeat_at < now() - interval``: model instant t stands for a
        database instant a little after t (real time passes between operations, and a read starts
        after the stamp it reads), so ``heartbeat_s`` model seconds after the stamp the database has
        seen strictly more than the lease. With this rule the two agree exactly at the boundary."""
        p = self._runs[proposal_id]
        if p.status is Status.EXECUTING and self.now - p.heartbeat_at >= self.heartbeat_s:
            self.transition(proposal_id, "mark_interrupted_if_stale")
            self._runs[proposal_id] = replace(self._runs[proposal_id], failure=INTERRUPTED)

    # -- operations (the implementation's vocabulary) ----------------------------
    def propose(self, steps: Iterable) -> Outcome:
        parsed = parse_steps(steps)
        if isinstance(parsed, Rejected):
            return parsed
        return Won(self._create(parsed, None))

    def _create(self, steps: tuple[Step, ...], compensates: int | None) -> int:
        pid = max(self._runs, default=0) + 1
        event = "propose" if compensates is None else "compensate"
        target = TABLE.next(CREATED, event)
        self._runs[pid] = Proposal(pid, Status(target), steps, compensates)
        self.transitions.append((pid, CREATED, event, target))
        return pid

    def revise(self, proposal_id: int, steps: Iterable) -> Outcome:
        """Replace a pending plan's steps. Approval froze them: afterwards this is a lost race."""
        parsed = parse_steps(steps)
        if isinstance(parsed, Rejected):
            return parsed
        p = self._runs.get(proposal_id)
        if p is not None and p.compensates is not None:
            return COMPENSATION_IS_FROZEN
        return self._conditional(proposal_id, "revise", steps=parsed)

    def approve(self, proposal_id: int) -> Outcome:
        return self._conditional(proposal_id, "approve")

    def reject(self, proposal_id: int) -> Outcome:
        return self._conditional(proposal_id, "reject")

    def expire(self, proposal_id: int) -> Outcome:
        return self._conditional(proposal_id, "expire")

    def mark_executing(self, proposal_id: int) -> Outcome:
        """The claim. Won(token): the token every step of this run must present."""
        p = self._runs.get(proposal_id)
        out = self._conditional(
            proposal_id,
            "mark_executing",
            heartbeat_at=self.now,
            generation=p.generation + 1 if p else 0,
        )
        return Won(self._runs[proposal_id].generation) if isinstance(out, Won) else out

    def heartbeat(self, proposal_id: int, token: int) -> Outcome:
        """The owner's lease renewal, fenced like a step. Won()."""
        p = self._runs.get(proposal_id)
        if p is None:
            return no_proposal(proposal_id)
        refused = fence("heartbeat", p.status, p.generation, token)
        if refused:
            return refused
        self.transition(proposal_id, "heartbeat")
        self._runs[proposal_id] = replace(self._runs[proposal_id], heartbeat_at=self.now)
        return Won()

    def run_step(self, proposal_id: int, step_index: int, token: int) -> Outcome:
        """One step, atomically: fence, effect, receipt, heartbeat, and the terminal transition
        when the step is the last or not ok. Won(Receipt). A step that already has a receipt is
        answered from it; a step out of order or outside the frozen payload is Rejected."""
        p = self._runs.get(proposal_id)
        if p is None:
            return no_proposal(proposal_id)
        refused = fence("run_step", p.status, p.generation, token)
        if refused:
            return refused
        checked = check_step_index(p.steps, len(p.receipts), step_index)
        if checked is not None:
            return checked if isinstance(checked, Rejected) else Won(p.receipts[step_index])
        step = p.steps[step_index]
        ok = self._apply(proposal_id, step_index, step)
        receipt = Receipt(step_index, ok, describe(step, ok))
        event = step_event(ok, step_index, len(p.steps))
        self.transition(proposal_id, event)
        self._runs[proposal_id] = replace(
            self._runs[proposal_id],
            receipts=p.receipts + (receipt,),
            heartbeat_at=self.now,
            failure=None if ok else step_failure(step_index, receipt.detail),
        )
        return Won(receipt)

    def _apply(self, proposal_id: int, step_index: int, step: Step) -> bool:
        """The step's database effect in the demo domain; False (and no effect) when not ok."""
        if step.op == "fail":
            return False
        if step.op == "debit" and self._balances.get(step.account, 0) < step.amount:
            return False
        delta = step.amount if step.op == "credit" else -step.amount
        self._balances[step.account] = self._balances.get(step.account, 0) + delta
        self._ledger.append(LedgerEntry(proposal_id, step_index, step.account, delta))
        return True

    def read(self, proposal_id: int) -> Outcome:
        """The run as seen, after the lazy heal. Won(RunReport)."""
        if proposal_id not in self._runs:
            return no_proposal(proposal_id)
        self._heal(proposal_id)
        return Won(report(self._runs[proposal_id]))

    def repeat(self, proposal_id: int) -> Outcome:
        """An execute request arriving again. A terminal run (after the lazy heal) is answered
        from its receipts, Won(RunReport), and never re-executes; any other run is Rejected."""
        if proposal_id not in self._runs:
            return no_proposal(proposal_id)
        self._heal(proposal_id)
        p = self._runs[proposal_id]
        if p.status not in TERMINAL:
            return not_terminal(p.status)
        return Won(report(p))

    def compensate(self, proposal_id: int) -> Outcome:
        """Propose the run that undoes this one's committed steps, in reverse. Won(new id), or
        Won(existing id) when a compensation already exists. Only an executed or failed run
        with at least one ok step can be compensated (after the lazy heal)."""
        if proposal_id not in self._runs:
            return no_proposal(proposal_id)
        self._heal(proposal_id)
        p = self._runs[proposal_id]
        refused = compensation_refusal(p.status)
        if refused:
            return refused
        existing = [q.proposal_id for q in self._runs.values() if q.compensates == proposal_id]
        if existing:
            return Won(existing[0])
        steps = compensation_steps(p.steps, p.receipts)
        if not steps:
            return NOTHING_TO_COMPENSATE
        return Won(self._create(steps, proposal_id))
