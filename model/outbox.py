"""The notification outbox, as a pure state machine.

Theory of operation
-------------------

A delivery is a row: ``pending`` until a worker claims it, ``processing`` while one worker owns
it, then ``sent``, ``failed`` (the sink refused it for good), or ``dead`` (retries exhausted).
A retryable failure puts it back to ``pending`` with ``attempts > 0`` and a later
``next_attempt_at``: that *is* the retry.

claim
    ``FOR UPDATE SKIP LOCKED`` over due pending rows, in id order, at most ``batch`` of them;
    each claimed row gets ``attempts + 1`` and a lease ``lease_until = now() + lease``. The
    claimed attempt number is the owner's token.
fence
    Every write an owner makes afterwards — the terminal write, a retry, a lease extension —
    matches ``attempts = <claimed attempt>``. After the reaper reclaimed the row and another
    worker claimed it again, the old owner's token is stale and its write matches nothing:
    a lost race, never a silent overwrite.
batched completion
    ``record_batch`` records the outcomes of a worker's batch in one transaction. Each row is
    fenced on its own claimed attempt, exactly as ``complete`` / ``fail`` fence it one by one:
    a stale row is a lost race for that row alone and never stops the others.
lease + reaper
    ``reclaim_stale`` takes back every ``processing`` row whose lease lapsed (database clock),
    to ``pending`` (or ``dead`` at the attempt limit). Nobody waits for a dead worker.
retry policy
    Exponential backoff, ``min(cap, base * 2 ** (attempts - 1))``, dead after ``max_attempts``.
time
    ``now`` is the database clock in whole seconds. The implementation stamps and compares
    leases with Postgres ``now()``; the model's ``now`` is the same clock, moved by the check.
external effect
    The send to the notification sink is **at-least-once**: a worker whose lease lapsed
    mid-send can send again after a reclaim. A duplicate notification is cheaper than a lost
    one. The row itself is the receipt.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, replace
from typing import Sequence

from .contract import CREATED, LostRace, Outcome, Rejected, RunView, StepView, Won
from .describe import Claim, Fence, Lease, Retry, RunKind


class Status(enum.StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    SENT = "sent"
    FAILED = "failed"
    DEAD = "dead"


DESCRIPTION = RunKind(
    name="outbox",
    statuses=("pending", "processing", "sent", "failed", "dead"),
    initial="pending",
    owned=("processing",),
    terminal=("sent", "failed", "dead"),
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> processing",
        "processing -extend_lease-> processing",
        "processing -complete-> sent",
        "processing -fail_permanent-> failed",
        "processing -retry-> pending",
        "processing -give_up-> dead",
        "processing -reclaim-> pending",
        "processing -reclaim_dead-> dead",
    ),
    claim=Claim(how="FOR UPDATE SKIP LOCKED claim of due rows that bumps attempts"),
    lease=Lease(
        seconds="5m",
        taken_back_by=("reclaim", "reclaim_dead"),
        how="claim lease (default 5 min) stamped with the database's now()",
        reaper="reclaim_stale: processing rows whose lease lapsed go back to pending "
        "(dead at the limit)",
    ),
    fence=Fence(
        kind="attempt",
        how="terminal writes and lease extensions match attempts = <claimed attempt>",
    ),
    receipts="the delivery row itself",
    retry=Retry(
        max_attempts=3,
        base="1m",
        cap="1h",
        how="exponential backoff on next_attempt_at with a cap; dead after max attempts",
    ),
    external="at-least-once",
)
"""The kind, described as data: its contract and transition table are computed from it, and
its column of ``specs/contract.md`` is generated from it."""

CONTRACT = DESCRIPTION.contract()
TABLE = CONTRACT.table

STEP = "deliver"  # the outbox's single step; its identity is the row id


@dataclass(frozen=True)
class Config:
    lease: int = 300
    backoff_base: int = 60
    backoff_cap: int = 3600
    max_attempts: int = 3

    def backoff(self, attempts: int) -> int:
        return min(self.backoff_cap, self.backoff_base * 2 ** max(0, attempts - 1))


@dataclass(frozen=True)
class Delivery:
    id: int
    status: str
    attempts: int
    next_attempt_at: int
    lease_until: int | None = None


@dataclass(frozen=True)
class Claim:
    """What a worker holds after a claim: the row and its token."""

    id: int
    attempt: int


OK, RETRYABLE, PERMANENT = "ok", "retryable", "permanent"
"""What a worker learned from one send: delivered; refused for now (5xx, no answer); refused
for good (4xx)."""

DUPLICATE_ID = "a delivery with this id exists"
TWICE_IN_BATCH = "a delivery appears twice in one batch"


@dataclass(frozen=True)
class Report:
    """One row of a batched completion: the claim a worker holds and what its send answered."""

    claim: Claim
    result: str

    def __post_init__(self) -> None:
        if self.result not in (OK, RETRYABLE, PERMANENT):
            raise ValueError(
                f"result {self.result!r} of delivery {self.claim.id}: "
                f"use {OK!r}, {RETRYABLE!r} or {PERMANENT!r}"
            )


class OutboxModel:
    """All deliveries, the database clock, and what the sink received."""

    def __init__(self, config: Config = Config()):
        self.config = config
        self.now = 0
        self.deliveries: dict[int, Delivery] = {}
        self.received: dict[int, int] = {}  # delivery id -> deliveries the sink recorded
        # (id, from, event, to), drained by the check
        self.transitions: list[tuple[int, str, str, str]] = []
        self._next_id = 1

    # -- plumbing ---------------------------------------------------------------
    def copy(self) -> "OutboxModel":
        return copy.deepcopy(self)

    def state(self) -> tuple:
        """The observable state: what the implementation's projection must equal."""
        return tuple(self.deliveries[k] for k in sorted(self.deliveries))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, OutboxModel)
            and self.state() == other.state()
            and self.received == other.received
        )

    def advance(self, seconds: int) -> None:
        self.now += seconds

    def _move(self, d: Delivery, event: str, **changes) -> Delivery:
        new = replace(d, status=TABLE.next(d.status, event), **changes)
        self.deliveries[d.id] = new
        self.transitions.append((d.id, d.status, event, new.status))
        return new

    def _owned(self, c: Claim) -> Delivery | None:
        d = self.deliveries.get(c.id)
        if d is None or d.status != Status.PROCESSING or d.attempts != c.attempt:
            return None
        return d

    # -- operations (same vocabulary as impl.outbox) ------------------------------
    def next_id(self) -> int:
        """The event id the producer gives the next delivery."""
        return self._next_id

    def enqueue(self, id: int) -> Outcome:
        """A new delivery; an id already taken is refused (the table's primary key) and
        changes nothing."""
        if id in self.deliveries:
            return Rejected(DUPLICATE_ID)
        d = Delivery(id, CREATED, 0, self.now)
        self._next_id = max(self._next_id, id + 1)
        self._move(d, "enqueue")
        return Won(d.id)

    def claim(self, batch: int) -> Outcome:
        due = [
            d
            for _, d in sorted(self.deliveries.items())
            if d.status == Status.PENDING and d.next_attempt_at <= self.now
        ]
        claims = []
        for d in due[:batch]:
            self._move(
                d, "claim", attempts=d.attempts + 1, lease_until=self.now + self.config.lease
            )
            claims.append(Claim(d.id, d.attempts + 1))
        return Won(tuple(claims))

    def claim_skipping(self, batch: int, taken: tuple[int, ...]) -> Outcome:
        """A claim among others in flight: ``FOR UPDATE SKIP LOCKED`` may skip due rows another
        transaction holds (and that transaction may still abort), so what it takes is *some*
        due rows, in id order, at most ``batch``, not always the first ones. Claims ``taken``
        when that is such a choice; refused (nothing changes) when a row is not due and pending."""
        due = {
            d.id: d
            for d in self.deliveries.values()
            if d.status == Status.PENDING and d.next_attempt_at <= self.now
        }
        if len(taken) > batch or list(taken) != sorted(taken) or any(i not in due for i in taken):
            return LostRace("not a claim SKIP LOCKED can make")
        claims = []
        for i in taken:
            d = due[i]
            self._move(
                d, "claim", attempts=d.attempts + 1, lease_until=self.now + self.config.lease
            )
            claims.append(Claim(d.id, d.attempts + 1))
        return Won(tuple(claims))

    def extend_lease(self, c: Claim) -> Outcome:
        d = self._owned(c)
        if d is None:
            return LostRace("fenced")
        self._move(d, "extend_lease", lease_until=self.now + self.config.lease)
        return Won()

    def complete(self, c: Claim) -> Outcome:
        d = self._owned(c)
        if d is None:
            return LostRace("fenced")
        self._move(d, "complete", lease_until=None)
        return Won(Status.SENT.value)

    def fail(self, c: Claim, permanent: bool) -> Outcome:
        d = self._owned(c)
        if d is None:
            return LostRace("fenced")
        if permanent:
            self._move(d, "fail_permanent", lease_until=None)
        elif d.attempts >= self.config.max_attempts:
            self._move(d, "give_up", lease_until=None)
        else:
            self._move(
                d,
                "retry",
                lease_until=None,
                next_attempt_at=self.now + self.config.backoff(d.attempts),
            )
        return Won(self.deliveries[d.id].status)

    def record_batch(self, reports: Sequence[Report]) -> Outcome:
        """The outcomes of a batch in one transaction. Each row is fenced on its own claimed
        attempt and moves as :meth:`complete` or :meth:`fail` would move it alone; a stale row
        is a ``LostRace`` for that row only. Returns ``Won`` of the per-row outcomes, in the
        order of ``reports``; a delivery reported twice refuses the whole batch."""
        ids = [r.claim.id for r in reports]
        if len(set(ids)) != len(ids):
            return Rejected(TWICE_IN_BATCH)
        return Won(
            tuple(
                self.complete(r.claim)
                if r.result == OK
                else self.fail(r.claim, permanent=r.result == PERMANENT)
                for r in reports
            )
        )

    def reclaim_stale(self) -> Outcome:
        reclaimed = []
        for _, d in sorted(self.deliveries.items()):
            if (
                d.status == Status.PROCESSING
                and d.lease_until is not None
                and d.lease_until <= self.now
            ):
                if d.attempts >= self.config.max_attempts:
                    self._move(d, "reclaim_dead", lease_until=None)
                else:
                    self._move(d, "reclaim", lease_until=None, next_attempt_at=self.now)
                reclaimed.append(d.id)
        return Won(tuple(reclaimed))

    def sink_received(self, delivery_id: int) -> None:
        """The sink recorded one delivery of this row (an external effect, at-least-once)."""
        self.received[delivery_id] = self.received.get(delivery_id, 0) + 1

    # -- the contract's view ----------------------------------------------------------
    def views(self) -> dict[str, RunView]:
        return views(self.state(), self.received)


def views(deliveries: tuple[Delivery, ...], received: dict[int, int]) -> dict[str, RunView]:
    """Project deliveries into the contract's kind-neutral view. The row is the receipt,
    so a sent row counts as one receipt and one effect of its single step."""
    out = {}
    for d in deliveries:
        done = 1 if d.status == Status.SENT else 0
        out[str(d.id)] = RunView(
            run_id=str(d.id),
            status=d.status,
            fence_token=d.attempts,
            steps={
                STEP: StepView(receipts=done, effects=done, external_calls=received.get(d.id, 0))
            },
        )
    return out
