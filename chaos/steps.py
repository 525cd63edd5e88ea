"""What a step is judged with: the failure every check raises, the possible states after an
indeterminate step, the operations a kind offers, and what an outcome that differs from the
model breaks. Shared by the sequential engine (:mod:`.check`) and concurrent blocks
(:mod:`.blocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import psycopg

from knownstate.model.contract import LostRace, Won


class Failure(AssertionError):
    """The implementation broke the contract: the message says how, ``invariants`` names the
    invariants it broke (empty when the failure is a difference from the model only)."""

    def __init__(self, message: str, invariants: tuple[str, ...] = ()):
        super().__init__(message)
        self.invariants = invariants


@dataclass
class Candidate:
    """One possible state of the world after an indeterminate step."""

    model: Any
    committed: bool | None = None  # for a COMMIT whose answer was lost: whether it landed here
    external: bool | None = None  # for a call whose answer was lost: whether the stand-in acted


@dataclass(frozen=True)
class Offer:
    """An operation a worker can start now, for a concurrent block: what it does to the model and
    to the implementation, what the kind remembers of its outcome (``after``), and what its
    outcome is of the contract (``guarantee``, as in :meth:`KindCheck.apply`)."""

    label: str
    model_op: Callable[[Any], Any]
    impl_op: Callable[[psycopg.Connection], Any]
    after: Callable[[Any], None] | None = None
    guarantee: str | None = None
    among_others: Callable[[Any, Any], Any] | None = None
    """For an operation whose correct outcomes are several when others run at once (a SKIP
    LOCKED claim may skip rows another transaction holds): the model operation given what the
    implementation answered, which accepts it when it is one of them."""
    runs: frozenset = frozenset()
    """The runs it may write (a fenced write: its run; a claim: the due runs; the reaper: the
    runs whose lease lapsed), so a block can aim at a run two workers contest."""
    fenced: bool = False
    """A write by an owner, which the contract refuses once the writer lost the run."""
    once_freed: frozenset = frozenset()
    """Of its ``runs``, those it can write only once another operation freed them (a claim of
    a row whose lease lapsed: after the reaper took it back). A worker frozen inside its write
    on such a run sees the others act in that order (:meth:`.blocks.Blocks._frozen`)."""


def broken_by(expected: Any, got: Any, fenced: bool, guarantee: str | None) -> tuple[str, ...]:
    """What an outcome that differs from the model's breaks, besides what the state shows: the
    guarantee the operation's outcome is (which runs a claim or a reaper takes, which step a
    step is, a payload approval froze), if it is one; and when a write the contract refuses
    went through, or one it lets win was refused, also the fence (a write by an owner) or the
    conditional transition (any other: exactly one caller wins, and it is this one)."""
    own = (guarantee,) if guarantee else ()
    if {type(expected), type(got)} == {LostRace, Won}:
        return (("lease-fence",) if fenced else ("conditional-transition",)) + own
    return own


def fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:297] + "..."


def diff(expected: Any, real: Any) -> str:
    if isinstance(expected, tuple) and isinstance(real, tuple):
        lines = []
        for i in range(max(len(expected), len(real))):
            e = expected[i] if i < len(expected) else "(absent)"
            r = real[i] if i < len(real) else "(absent)"
            if e != r:
                lines.append(f"  model:    {fmt(e)}\n  database: {fmt(r)}")
        if lines:
            return "\n".join(lines)
    return f"  model:    {fmt(expected)}\n  database: {fmt(real)}"
