"""A run kind, described as data: the contract's elements, filled in for one kind.

Theory of operation
-------------------

Every durable run kind answers the same questions: which statuses, which transitions, how a
worker claims a run, how long its lease lasts and by whose clock, what fences a stale owner
off, where the receipts live, how retries are bounded and spaced, and what the external effect
promises. :class:`RunKind` holds those answers, one field each, and is the boundary where a
person writes them (pydantic: a mistake is refused when the description is *defined*, with a
hint naming what to change, never discovered halfway through a check).

From a description come:

- its :class:`~knownstate.model.contract.Contract` (:meth:`RunKind.contract`), which the six
  invariants and the three guarantees read, and the column ``specs/contract.md`` shows;
- for a claim/lease/fence/retry queue, a model (:mod:`knownstate.model.generic`) and, with an
  adapter binding the operations to a real system, a check (:mod:`knownstate.chaos.generic`).

Transitions are written one per line, ``"source -event-> target"``, with ``(new)`` as the
source of the transition that creates a run. Durations are in the user's units: seconds as a
number, a :class:`~datetime.timedelta`, or ``"90s"``, ``"5m"``, ``"2h"``.

This module is pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from .contract import CREATED, Contract, ExternalEffect, LeaseClock, TransitionTable
from .elements import STRICT, Claim, Fence, Lease, Retry, Seconds, seconds

__all__ = ["EXTERNAL", "Claim", "Fence", "Lease", "Retry", "RunKind", "Seconds", "seconds"]

EXTERNAL = {
    "none": ExternalEffect.NONE,
    "at-least-once": ExternalEffect.AT_LEAST_ONCE,
    "create-once-then-poll": ExternalEffect.CREATE_ONCE_THEN_POLL,
}

_ARROW = re.compile(r"^\s*(\S+)\s+-([A-Za-z0-9_.:]+)->\s+(\S+)\s*$")


def _parse(line: str | tuple[str, str, str]) -> tuple[str, str, str]:
    if isinstance(line, (tuple, list)) and len(line) == 3:
        return tuple(line)  # type: ignore[return-value]
    m = _ARROW.match(line) if isinstance(line, str) else None
    if m is None:
        raise ValueError(
            f"transition {line!r}: write it as 'source -event-> target', e.g. "
            "'pending -claim-> processing' (a creating one from '(new)')"
        )
    return m.group(1), m.group(2), m.group(3)


class RunKind(BaseModel):
    """A run kind's contract, as data. Inconsistent descriptions are refused with a hint."""

    model_config = STRICT
    name: str = Field(
        pattern=r"^[a-z][a-z0-9-]*$", description="the kind's name (lower case, digits and dashes)"
    )
    transitions: tuple[tuple[str, str, str], ...]
    owned: tuple[str, ...] = Field(description="statuses in which a worker holds the claim")
    statuses: tuple[str, ...] = Field(
        (), description="every status (default: those the transitions name, in their order)"
    )
    initial: str = Field(
        "", description="the status a new run starts in (default: where '(new)' leads)"
    )
    terminal: tuple[str, ...] = Field(
        (), description="statuses a run never leaves (default: those no transition leaves)"
    )
    claim: Claim
    lease: Lease | None = None
    fence: Fence
    receipts: str = Field(description="where what committed is recorded, with the effect")
    retry: Retry | None = Field(None, description="None: no retries; a failed attempt ends the run")
    retry_prose: str = Field(
        "", description="the retry policy in a sentence, when there is none (default: 'none')"
    )
    external: Literal["none", "at-least-once", "create-once-then-poll"] = "none"
    external_key: bool = Field(
        False, description="every external call for a run carries the same idempotency key"
    )
    idempotency_key: str | None = Field(
        None,
        description="a repeated request carrying the same "
        "key gets the existing run (where the key is unique)",
    )
    keys: Literal["deduplicated", "producers"] = Field(
        "deduplicated",
        description="what the system does with a run's key: deduplicated (a second run under "
        "a key it holds is refused, or gets the existing run with an idempotency key), or "
        "the producers' (it keeps no key of its own: each producer's keys are its own, and "
        "two producers never add runs under one key)",
    )
    commits: Literal["transaction", "autocommit"] = Field(
        "transaction",
        description="how the library commits: each operation in a transaction it COMMITs, or "
        "every statement in autocommit (it insists on it): then it sends no COMMIT, and the "
        "gate's COMMIT faults (the answer lost, the request lost, the worker dead before "
        "sending, the server crashed) meet the worker's next statement, which commits on its "
        "own; no claim races another's open COMMIT",
    )
    clock_skew: Seconds | None = Field(
        None,
        description="the most the application's clock is apart from the database's, either "
        "way, in the deployment the library is built for (NTP keeps hosts within seconds): the "
        "gate then keeps its application clock within it, each skew drawn within "
        "±clock_skew and each jump of the database's clock passing on both; needs an "
        "application clock (Claim(unscheduled='application') or Lease(clock='application')). "
        "None: unbounded, the clocks apart by whatever the gate's jumps and skews drew",
    )
    deviations: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _transitions_from_lines(cls, data):
        if not isinstance(data, dict) or "transitions" not in data:
            return data
        moves = tuple(_parse(t) for t in data["transitions"])
        named = list(dict.fromkeys(s for src, _, dst in moves for s in (src, dst) if s != CREATED))
        created = [dst for src, _, dst in moves if src == CREATED]
        left = {src for src, _, dst in moves if src != dst}
        return {
            "statuses": tuple(named),
            "initial": created[0] if created else "",
            "terminal": tuple(s for s in named if s not in left),
            **data,
            "transitions": moves,
        }

    @model_validator(mode="after")
    def _consistent(self) -> "RunKind":
        problems = self.problems()
        if problems:
            raise ValueError(f"run kind {self.name!r}: " + "; ".join(problems))
        return self

    @property
    def waiting(self) -> tuple[str, ...]:
        """The statuses a run waits in to be claimed: the initial one, and any other that a
        transition leaves into an owned status (chancy's ``retrying`` beside ``pending``)."""
        held = (CREATED, *self.owned)
        claimed = [s for s, _, t in self.transitions if t in self.owned and s not in held]
        return tuple(dict.fromkeys((self.initial, *claimed)))

    @property
    def app_clock_lease(self) -> bool:
        """Whether its leases are stamped and judged by the application's clock."""
        return self.lease is not None and self.lease.clock == "application"

    @property
    def reaps_apart(self) -> bool:
        """Whether its reaper takes back each run in a transaction of its own."""
        return self.lease is not None and self.lease.reaps == "one-by-one"

    @property
    def app_clock(self) -> bool:
        """Whether the application's clock schedules its runs or stamps its leases."""
        return self.claim.unscheduled == "application" or self.app_clock_lease

    # -- consistency ---------------------------------------------------------------------
    def problems(self) -> list[str]:
        """What is inconsistent, each with a hint (empty: nothing)."""
        out: list[str] = []
        declared = set(self.statuses)
        listed = ", ".join(self.statuses)
        for what, names in (
            ("initial", (self.initial,)),
            ("owned", self.owned),
            ("terminal", self.terminal),
        ):
            for s in names:
                if s not in declared:
                    out.append(
                        f"{what} status {s!r} is not among statuses ({listed}): add it "
                        "or fix the spelling"
                    )
        if not self.owned:
            out.append("no owned status: name the status(es) in which a worker holds the claim")
        if not self.terminal:
            out.append("no terminal status: a run must be able to end")
        for s in set(self.owned) & set(self.terminal):
            out.append(
                f"status {s!r} is both owned and terminal: a worker cannot hold a run "
                "that has ended"
            )
        if self.initial in self.terminal or self.initial in self.owned:
            out.append(
                f"initial status {self.initial!r} is owned or terminal: a new run waits "
                "to be claimed"
            )
        seen: dict[tuple[str, str], str] = {}
        for src, event, dst in self.transitions:
            for s in (src, dst):
                if s != CREATED and s not in declared:
                    out.append(
                        f"transition {src} -{event}-> {dst}: status {s!r} is not among "
                        f"statuses ({listed}): add it or fix the spelling"
                    )
            if dst == CREATED:
                out.append(f"transition {src} -{event}-> {dst}: nothing goes back to {CREATED}")
            if src in self.terminal:
                out.append(
                    f"terminal status {src!r} has a transition out of it ({src} -{event}"
                    f"-> {dst}): a terminal run never changes; remove the transition or "
                    f"drop {src!r} from terminal"
                )
            if (src, event) in seen and seen[(src, event)] != dst:
                out.append(
                    f"event {event!r} from {src!r} leads both to {seen[(src, event)]!r} "
                    f"and to {dst!r}: give the two transitions different event names"
                )
            seen[(src, event)] = dst
        if out:
            return out
        if not any(src == CREATED and dst == self.initial for src, _, dst in self.transitions):
            out.append(
                f"no transition creates a run in {self.initial!r}: add "
                f"'{CREATED} -enqueue-> {self.initial}'"
            )
        out += self._reachability()
        owned = set(self.owned)
        if not any(src not in owned and dst in owned for src, _, dst in self.transitions):
            out.append(
                f"no transition claims a run (into {', '.join(self.owned)}): add e.g. "
                f"'{self.initial} -claim-> {self.owned[0]}'"
            )
        out += self._lease_problems() + self._retry_problems()
        if self.claim.reclaims and self.lease is None:
            out.append("Claim(reclaims=True) without a lease: describe the lease it re-picks on")
        if self.clock_skew is not None and not self.app_clock:
            out.append(
                f"clock_skew={self.clock_skew} s without an application clock: it bounds the "
                "application's clock against the database's; drop it, or say where the "
                "application's clock is used (Claim(unscheduled='application') or "
                "Lease(clock='application'))"
            )
        if self.fence.kinds() != {"none"} and self.lease is None:
            out.append(
                f"fence {self.fence.kind!r} without a lease: an owner never loses its "
                "claim, so there is nothing to fence; describe the lease, or use "
                "Fence(kind='none')"
            )
        if self.external_key and self.external == "none":
            out.append(
                "external_key=True but external='none': an idempotency key goes with an "
                "external call; say which (at-least-once, create-once-then-poll)"
            )
        return out

    def _reachability(self) -> list[str]:
        out = []
        reach, frontier = set(), [CREATED]
        while frontier:
            s = frontier.pop()
            for src, _, dst in self.transitions:
                if src == s and dst not in reach:
                    reach.add(dst)
                    frontier.append(dst)
        for s in self.statuses:
            if s not in reach:
                out.append(
                    f"status {s!r} is never reached from {CREATED}: add a transition "
                    "into it or drop it from statuses"
                )
        ends = set(self.terminal)
        changed = True
        while changed:
            changed = False
            for src, _, dst in self.transitions:
                if dst in ends and src not in ends and src != CREATED:
                    ends.add(src)
                    changed = True
        for s in self.statuses:
            if s not in ends and s in reach:
                out.append(
                    f"status {s!r} can never end: add a transition from it toward a "
                    f"terminal status ({', '.join(self.terminal)})"
                )
        return out

    def _lease_problems(self) -> list[str]:
        out: list[str] = []
        lease = self.lease
        if lease is None:
            return out
        owned = set(self.owned)
        events = {e for _, e, _ in self.transitions}
        if not lease.taken_back_by and not self.claim.reclaims:
            out.append(
                "a lease that nothing takes back never ends a dead owner's claim: name "
                "the reaper's event(s) in Lease(taken_back_by=...), or say the claim "
                "re-picks lapsed runs itself (Claim(reclaims=True))"
            )
        for e in lease.taken_back_by:
            if e not in events:
                out.append(
                    f"Lease(taken_back_by) names event {e!r}, which no transition has: "
                    f"add e.g. '{self.owned[0]} -{e}-> {self.initial}'"
                )
            elif not any(
                ev == e and src in owned and dst not in owned for src, ev, dst in self.transitions
            ):
                out.append(
                    f"event {e!r} does not take a run out of an owned status "
                    f"({', '.join(self.owned)}): a reaper moves an owned run on"
                )
        if self.claim.reclaims and not any(
            e == "claim" and src == dst and src in owned for src, e, dst in self.transitions
        ):
            out.append(
                "Claim(reclaims=True): the claim takes a lapsed run as it is; add "
                f"'{self.owned[0]} -claim-> {self.owned[0]}'"
            )
        if lease.heartbeat is not None:
            if lease.heartbeat * 2 > lease.seconds:
                out.append(
                    f"a heartbeat every {lease.heartbeat} s with a {lease.seconds} s "
                    "lease: one late beat loses the lease; beat at least twice per lease"
                )
            if not any(src == dst and src in owned for src, _, dst in self.transitions):
                out.append(
                    "a heartbeat needs a transition that keeps the run owned, e.g. "
                    f"'{self.owned[0]} -extend_lease-> {self.owned[0]}'"
                )
        return out

    def _retry_problems(self) -> list[str]:
        out: list[str] = []
        owned = set(self.owned)
        back = [
            (s, e, d)
            for s, e, d in self.transitions
            if s in owned
            and d in self.waiting
            and e not in (self.lease.taken_back_by if self.lease else ())
        ]
        if self.retry is None and back:
            s, e, d = back[0]
            out.append(
                f"no retry policy, but '{s} -{e}-> {d}' tries the run again: declare "
                "retry=Retry(max_attempts=..., base=...) or end the run instead"
            )
        if self.retry is not None:
            if not back:
                out.append(
                    f"a retry policy needs a transition from {self.owned[0]!r} back to "
                    f"{self.initial!r}, e.g. '{self.owned[0]} -retry-> {self.initial}'"
                )
            if self.retry.cap is not None and self.retry.cap < (self.retry.base or 0):
                out.append(
                    f"Retry(cap={self.retry.cap}) is shorter than base="
                    f"{self.retry.base}: the cap bounds the wait from above"
                )
            if self.retry.backoff == "fixed" and self.retry.cap is not None:
                out.append("Retry(backoff='fixed') has no cap: drop cap, or use 'exponential'")
        return out

    # -- what follows from it ----------------------------------------------------------------
    def table(self) -> TransitionTable:
        return TransitionTable(self.name, self.transitions)

    def events(self) -> frozenset[str]:
        return frozenset(e for _, e, _ in self.transitions)

    def skew_text(self) -> str:
        """The bound on the two clocks, as the contract states it ("": unbounded)."""
        if self.clock_skew is None:
            return ""
        return f"the application's clock within ±{self.clock_skew} s of the database's"

    def claim_text(self) -> str:
        """The claim, with the bound on the clocks where the application's now schedules."""
        if self.claim.unscheduled != "application" or self.clock_skew is None:
            return self.claim.how
        return f"{self.claim.how}; due by the application's now at enqueue, {self.skew_text()}"

    def lease_text(self) -> str:
        lease = self.lease
        if lease is None:
            return "none"
        bound = f"; {self.skew_text()}" if self.app_clock_lease and self.clock_skew else ""
        if lease.how:
            return lease.how + bound
        clock = "the database's now()" if lease.clock == "database" else "the application clock"
        beat = f", extended by a heartbeat every {lease.heartbeat} s" if lease.heartbeat else ""
        return f"{lease.seconds} s claim lease stamped with {clock}{beat}{bound}"

    def reaper_text(self) -> str:
        lease = self.lease
        if lease is None:
            return "none"
        if lease.reaper:
            return lease.reaper
        moves = "; ".join(
            f"{s} -{e}-> {d}" for s, e, d in self.transitions if e in lease.taken_back_by
        )
        if self.claim.reclaims and not moves:
            return "none: the claim re-picks runs whose lease lapsed"
        again = "; the claim also re-picks them" if self.claim.reclaims else ""
        apart = ", each in a transaction of its own" if self.reaps_apart else ""
        return f"runs whose lease lapsed are taken back ({moves}){apart}{again}"

    def fence_text(self) -> str:
        if self.fence.how:
            return self.fence.how
        texts = {
            "attempt": "every write by an owner matches the claimed attempt",
            "claim": "every write by an owner matches the id its claim set (a new one per claim)",
            "status": f"every write by an owner is guarded on status = {self.owned[0]!r}",
            "row-lock": "each write locks the row and refuses unless it is still the caller's",
            "unless-terminal": "every write matches the run's id only: it lands unless the run "
            "ended",
            "none": "none: a stale owner's write is not refused",
        }
        own = "; ".join(f"{w}: {texts[k]}" for w, k in sorted(self.fence.operations.items()))
        return texts[self.fence.kind] + (f" (except {own})" if own else "")

    def retry_text(self) -> str:
        r = self.retry
        if r is None:
            return self.retry_prose or "none: a failed attempt ends the run"
        if r.how:
            return r.how
        if r.backoff == "none":
            space = "no backoff (due again at once)"
        elif r.backoff == "fixed":
            space = f"a fixed {r.base} s wait"
        else:
            space = f"exponential backoff from {r.base} s" + (f" up to {r.cap} s" if r.cap else "")
        counted = f" (counting {r.counts})" if r.counts != "claims" else ""
        return f"{space}; given up after {r.max_attempts} attempts{counted}"

    def contract(self) -> Contract:
        """The contract the invariants read, and the column specs/contract.md shows."""
        clock = LeaseClock.APPLICATION if self.app_clock_lease else LeaseClock.DATABASE
        return Contract(
            kind=self.name,
            table=self.table(),
            terminal=frozenset(self.terminal),
            claim=self.claim_text(),
            lease=self.lease_text(),
            lease_clock=clock,
            reaper=self.reaper_text(),
            fence=self.fence_text(),
            receipts=self.receipts,
            retry_policy=self.retry_text(),
            external_effect=EXTERNAL[self.external],
            deviations=self.deviations,
            retries=self.retry is not None,
            owned=frozenset(self.owned),
        )

    def summary(self) -> str:
        """The description's structured facts in one line (the contract table's last row)."""
        parts = [f"fence: {self.fence.kind}"]
        if self.lease:
            beat = f", heartbeat {self.lease.heartbeat} s" if self.lease.heartbeat else ""
            parts.append(f"lease: {self.lease.seconds} s, {self.lease.clock} clock{beat}")
        else:
            parts.append("lease: none")
        if self.retry:
            r = self.retry
            spaced = f" from {r.base} s" if r.base is not None else ""
            parts.append(f"retry: {r.max_attempts} attempts, {r.backoff} backoff{spaced}")
        else:
            parts.append("retry: none")
        parts.append(f"claim: {'SKIP LOCKED' if self.claim.skip_locked else 'waits on locks'}")
        parts.append(
            f"external: {self.external}" + (" with an idempotency key" if self.external_key else "")
        )
        return "; ".join(parts)
