"""The contract that every durable run kind shares.

Theory of operation
-------------------

A *run* (an outbox delivery, an approved plan, a branch reset) is a row with a status.
Six elements make it survive a worker that dies halfway:

status machine
    Every transition is a conditional write ``UPDATE ... WHERE status = <from>``. A
    transition that matches no row is a *lost race*, an ordinary outcome, never an error.
claim
    Exactly one worker owns a run at a time.
lease + reaper
    An owner that died is detected and its run taken back; nobody waits forever.
fence
    An owner that lost its lease cannot write any more: its writes match a token
    (the claimed attempt, or the still-executing status) that the reaper changed.
receipts
    What committed is recorded in the same transaction as the effect.
retry policy
    Retries are bounded and spaced, or there are none and a new request is a new run.

This module is pure: it holds the vocabulary (outcomes, transition tables, the
contract descriptor) and the six invariants of the source document as predicates
over a kind-neutral *view* of the runs. Each run kind projects its own state into
:class:`RunView` so the same predicates check all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

# ---------------------------------------------------------------------------
# Outcomes: what an operation returns. A lost race is a value, not an exception.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Won:
    """The operation's conditional write matched and committed."""

    value: object = None


@dataclass(frozen=True)
class LostRace:
    """The conditional write matched no row: someone else moved the run first."""

    reason: str = ""


@dataclass(frozen=True)
class Rejected:
    """The operation was refused by a rule (not by a race): e.g. a key reused."""

    reason: str


Outcome = Won | LostRace | Rejected


# ---------------------------------------------------------------------------
# Status machine as data.
# ---------------------------------------------------------------------------

CREATED = "(new)"
"""Pseudo-status a run has before its creating transition."""


class IllegalTransition(Exception):
    """A run was asked to take a transition its kind's table does not have."""

    def __init__(self, kind: str, status: str, event: str):
        self.kind, self.status, self.event = kind, status, event
        super().__init__(f"{kind}: no transition for event {event!r} from status {status!r}")


@dataclass(frozen=True)
class Transition:
    source: str
    event: str
    target: str


class TransitionTable:
    """One table per kind: ``(source, event) -> target``. Lookups never mutate anything."""

    def __init__(self, kind: str, transitions: Iterable[tuple[str, str, str]]):
        self.kind = kind
        # plain strings: a table written with StrEnum members reads and prints as its values
        self.transitions = tuple(Transition(*map(str, t)) for t in transitions)
        self._next: dict[tuple[str, str], str] = {}
        for t in self.transitions:
            key = (t.source, t.event)
            if key in self._next:
                raise ValueError(f"{kind}: two targets for {key}")
            self._next[key] = t.target

    def __deepcopy__(self, memo: dict) -> "TransitionTable":
        return self  # immutable: every copy of a model shares its kind's table

    def next(self, status: str, event: str) -> str:
        try:
            return self._next[(status, event)]
        except KeyError:
            raise IllegalTransition(self.kind, status, event) from None

    def allows(self, source: str, target: str) -> bool:
        return any(t.source == source and t.target == target for t in self.transitions)

    def edges(self) -> frozenset[tuple[str, str]]:
        """The distinct (source, target) pairs: what vacuity counts as 'every transition'."""
        return frozenset((t.source, t.target) for t in self.transitions)

    def statuses(self) -> tuple[str, ...]:
        seen: list[str] = []
        for t in self.transitions:
            for s in (t.source, t.target):
                if s != CREATED and s not in seen:
                    seen.append(s)
        return tuple(seen)

    def mermaid(self) -> str:
        """A Mermaid state diagram generated from the table (specs/ embed it verbatim)."""
        lines = ["stateDiagram-v2"]
        for t in self.transitions:
            src = "[*]" if t.source == CREATED else t.source
            lines.append(f"    {src} --> {t.target}: {t.event}")
        return "\n".join(lines)


class LeaseClock(enum.StrEnum):
    DATABASE = "database now()"
    APPLICATION = "application time"


class ExternalEffect(enum.StrEnum):
    NONE = "none: every effect is a database mutation, exactly once per step"
    AT_LEAST_ONCE = "at-least-once: a reclaimed run can repeat the external call"
    CREATE_ONCE_THEN_POLL = (
        "exactly one creation: the external operation is created once, then only polled"
    )


@dataclass(frozen=True)
class Contract:
    """One column of the seed's contract table, for one run kind."""

    kind: str
    table: TransitionTable
    terminal: frozenset[str]
    claim: str
    lease: str
    lease_clock: LeaseClock
    reaper: str
    fence: str
    receipts: str
    retry_policy: str
    external_effect: ExternalEffect
    deviations: tuple[str, ...] = ()
    retries: bool = True  # False: no retry at all; a failed step ends the run
    owned: frozenset[str] = frozenset()  # statuses in which a worker owns the run (claimed)

    @property
    def statuses(self) -> tuple[str, ...]:
        return self.table.statuses()

    def is_terminal(self, status: str) -> bool:
        return status in self.terminal


@runtime_checkable
class RunModel(Protocol):
    """What the engine asks of a kind's model. A model is a pure state machine: each of the
    kind's operations is a method returning an :data:`Outcome`, never raising for a lost race.
    Besides those, the engine uses exactly these (the hooks the engine asks of the *check* are
    listed in one table in :mod:`knownstate.chaos.engine`):

    ``copy()``
        an independent copy: the transactions engine applies an operation to a copy, and keeps
        several copies after a step whose outcome nobody knows (the possible states). (The
        replay engine, whose models hold a client's sessions, uses ``copy.deepcopy``.)
    ``advance(seconds)``
        the clock its leases are judged by moves (the database's, or the application's);
        called only when a kind lets the clock jump (``clock_matters()``).
    ``transitions``
        ``(run, source, event, target)`` for every transition taken since the engine last
        drained it (it clears the list after each observed step): what coverage counts. A
        model without it counts no transition (its check's ``counted`` may count them).

    Its attributes, but for ``transitions``, are its state: a concurrent block's search tells
    two states apart by them unless the check gives a ``fingerprint``
    (:func:`knownstate.chaos.linearize.default_fingerprint`).
    """

    transitions: list[tuple[Any, str, str, str]]

    def copy(self) -> "RunModel": ...

    def advance(self, seconds: int) -> None: ...


# ---------------------------------------------------------------------------
# Kind-neutral view of the runs, which the six invariants read.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepView:
    """One step of one run, counted from the data (not from what the code believes)."""

    receipts: int = 0  # receipt rows recorded for this step
    effects: int = 0  # database effects of this step, counted in the domain data
    external_calls: int = 0  # calls an external stand-in received for this step
    failed: int = 0  # receipts recorded for this step as not ok (a failed step)


@dataclass(frozen=True)
class RetryView:
    """Where a retried run stands against its retry policy, read from its row."""

    attempts: int  # attempts made so far
    max_attempts: int  # the policy's bound
    waiting: bool  # the run waits to be tried again (pending after an attempt)
    due_in: int = 0  # seconds until it is due again, when waiting
    owed: int = 0  # the wait its policy owes it now: the backoff after a failed attempt, 0
    #                after a lease that lapsed (the reaper's reclaim is due at once)


@dataclass(frozen=True)
class RunView:
    run_id: str
    status: str
    fence_token: int  # what a terminal write must match (claimed attempt, execution generation)
    steps: Mapping[str, StepView] = field(default_factory=dict)
    valid_step_ids: frozenset[str] | None = None  # None: any id is valid (row-id identity)
    external_creations: int = 0  # for create-once kinds: how many times the external op was created
    retry: RetryView | None = None  # for kinds with a retry policy
    lease_left: int | None = None  # seconds its lease has left, by the clock that judges it
    lease_granted: int | None = None  # the lease a claim grants


@dataclass(frozen=True)
class Write:
    """A write some owner attempted, judged by the model: was the writer still the owner?"""

    run_id: str
    token: int
    accepted: bool  # what the implementation did
    owner_current: bool  # what the model says: token current and lease not lost


@dataclass(frozen=True)
class Repeat:
    """A repeated request on a run that was terminal when it arrived."""

    run_id: str
    reexecuted: bool


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


INVARIANTS: dict[str, str] = {
    "conditional-transition": "Every transition is conditional on the state it leaves; "
    "a transition that matches no row is a lost race, not an error.",
    "lease-fence": "A lease is always paired with a fence: a stale owner never commits "
    "behind a terminal status.",
    "receipt-with-effect": "A step's receipt commits in the same transaction as the step's "
    "database effect.",
    "stable-step-identity": "Step identity is stable across retries: a position in a frozen "
    "payload, or a row id, never a counter of calls made so far.",
    "terminal-answers-from-receipts": "A terminal run answers every repeat request from its "
    "receipts and never re-executes.",
    "external-effect-semantics": "External effects are at-least-once unless the external API "
    "takes an idempotency key, and each implementation says which it is.",
    # Three guarantees of the contract table's elements, judged like the six:
    "claim": "Exactly one worker owns a run: a claim takes what nobody holds, and skips, never "
    "waits on, a run another worker is claiming.",
    "lease": "A dead owner is detected, never waited on forever: once its lease lapsed, by the "
    "clock that stamped it, its run is taken back, and never while the lease is live.",
    "retry-policy": "Retries are bounded and spaced: a retry waits its backoff, a run is never "
    "tried again past its maximum attempts, and without retries a failed step ends the run.",
}
"""The six invariants of the source document, and three guarantees of its contract table."""


def check_invariants(
    contract: Contract,
    before: Mapping[str, RunView],
    after: Mapping[str, RunView],
    writes: Iterable[Write] = (),
    repeats: Iterable[Repeat] = (),
) -> list[Violation]:
    """The six invariants, evaluated on one step: the views before and after it, and the
    writes and repeat requests the step made. Returns every violation found (empty: all hold)."""
    out: list[Violation] = []
    table = contract.table
    for run_id, now in after.items():
        prev = before.get(run_id)
        src = prev.status if prev else CREATED
        if src != now.status and not table.allows(src, now.status):
            out.append(
                Violation(
                    "conditional-transition",
                    f"run {run_id} moved {src} -> {now.status}, which the table does not allow",
                )
            )
        if (
            prev is not None
            and prev.status not in contract.owned
            and now.status in contract.owned
            and table.allows(src, now.status)
            and now.fence_token <= prev.fence_token
        ):
            out.append(
                Violation(
                    "lease-fence",
                    f"run {run_id} was claimed ({prev.status} -> {now.status}) "
                    f"keeping fence token {now.fence_token}: an owner that lost it is "
                    "not fenced off",
                )
            )
        for step_id, s in now.steps.items():
            if s.receipts != s.effects:
                out.append(
                    Violation(
                        "receipt-with-effect",
                        f"run {run_id} step {step_id}: {s.effects} effect(s) but "
                        f"{s.receipts} receipt(s)",
                    )
                )
            if s.receipts > 1 or s.effects > 1:
                out.append(
                    Violation(
                        "stable-step-identity",
                        f"run {run_id} step {step_id} committed {max(s.receipts, s.effects)} times",
                    )
                )
            if (
                now.valid_step_ids is not None
                and step_id not in now.valid_step_ids
                and (s.receipts or s.effects)
            ):
                out.append(
                    Violation(
                        "stable-step-identity",
                        f"run {run_id} recorded step {step_id!r}, which is not a step "
                        "of its frozen payload",
                    )
                )
        if prev is not None and contract.is_terminal(prev.status):
            # At-least-once kinds: a stale owner may still repeat the external call after the run
            # ended (the documented duplicate); what must not change is the record.
            def record(v: RunView):
                calls = contract.external_effect is not ExternalEffect.AT_LEAST_ONCE
                return (
                    v.status,
                    v.external_creations,
                    {
                        k: (s.receipts, s.effects, s.external_calls if calls else None)
                        for k, s in v.steps.items()
                    },
                )

            if record(now) != record(prev):
                out.append(
                    Violation(
                        "terminal-answers-from-receipts",
                        f"run {run_id} changed after it was terminal ({prev.status})",
                    )
                )
        out += _retry_policy(contract, run_id, prev, now)
        if (
            prev is not None
            and prev.status not in contract.owned
            and now.status in contract.owned
            and now.lease_granted is not None
            and now.lease_left != now.lease_granted
        ):
            out.append(
                Violation(
                    "lease",
                    f"run {run_id} was claimed with {now.lease_left}s of "
                    "lease left by the clock that judges it, not the "
                    f"{now.lease_granted}s a claim grants: the lease was "
                    "stamped by another clock",
                )
            )
        if (
            contract.external_effect is ExternalEffect.CREATE_ONCE_THEN_POLL
            and now.external_creations > 1
        ):
            out.append(
                Violation(
                    "external-effect-semantics",
                    f"run {run_id}: external operation created {now.external_creations} times",
                )
            )
        if contract.external_effect is ExternalEffect.AT_LEAST_ONCE:
            for step_id, s in now.steps.items():
                if s.effects and not s.external_calls:
                    out.append(
                        Violation(
                            "external-effect-semantics",
                            f"run {run_id} step {step_id} recorded as done but the "
                            "external call never arrived",
                        )
                    )
    for run_id in before:
        if run_id not in after:
            out.append(Violation("receipt-with-effect", f"run {run_id} disappeared"))
    for w in writes:
        if w.accepted and not w.owner_current:
            out.append(
                Violation(
                    "lease-fence",
                    f"run {w.run_id}: a write with stale token {w.token} was accepted",
                )
            )
        if not w.accepted and w.owner_current:
            out.append(
                Violation(
                    "lease-fence",
                    f"run {w.run_id}: the current owner's write (token {w.token}) was "
                    "refused by the fence",
                )
            )
    for r in repeats:
        if r.reexecuted:
            out.append(
                Violation(
                    "terminal-answers-from-receipts",
                    f"run {r.run_id}: a repeat request on a terminal run re-executed",
                )
            )
    return out


def _retry_policy(
    contract: Contract, run_id: str, prev: RunView | None, now: RunView
) -> list[Violation]:
    out = []
    if not contract.retries and not contract.is_terminal(now.status):
        failed = [k for k, s in now.steps.items() if s.failed]
        if failed:
            out.append(
                Violation(
                    "retry-policy",
                    f"run {run_id} recorded step {failed[0]} as "
                    f"failed and is still {now.status}: without "
                    "retries a failed step ends the run",
                )
            )
    r = now.retry
    if r is None or not r.waiting:
        return out
    if r.attempts >= r.max_attempts > 0:  # a state no move may reach: judged in any step
        out.append(
            Violation(
                "retry-policy",
                f"run {run_id} waits to be tried again after its last "
                f"attempt ({r.attempts} of {r.max_attempts})",
            )
        )
    if prev is not None and prev.status == now.status:
        return out  # the backoff is owed by the move into waiting: the time left runs down after
    if r.due_in < r.owed:
        out.append(
            Violation(
                "retry-policy",
                f"run {run_id} is due again in {r.due_in}s, before the {r.owed}s its backoff owes",
            )
        )
    return out
