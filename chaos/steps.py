"""What a step is judged with: the failure every check raises, the possible states after an
indeterminate step, the operations a kind offers, and what an outcome that differs from the
model breaks. Shared by the sequential engine (:mod:`.check`) and concurrent blocks
(:mod:`.blocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import psycopg

from knownstate.model.contract import LostRace, Won

from . import interleave, linearize


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
    part_way: bool = False  # for an operation of several transactions: some, not none, landed


@dataclass(frozen=True)
class Action:
    """One operation a worker can do now, as its kind declares it: once, for every use. The
    engine runs it as a step of its own (one rule per ``op``: :meth:`.check.KindCheck.act`), in
    a concurrent block beside other workers' actions (:mod:`.blocks`), as the turn a fault meets,
    and as the write a stalled worker freezes inside. A kind lists what each worker can do now in
    :meth:`.check.KindCheck.actions`; every field below is data, the optional ones with their
    default stated (Porcupine's ``Model`` is the pattern)."""

    op: str
    """The operation's name. The engine makes one rule per name the kind lists in its
    ``operations`` and draws among the actions of that name, so each operation is as likely as
    the others whatever its number of variants."""
    label: str
    """How the trace shows it, without its worker: ``complete(3, attempt=2)``."""
    model_op: Callable[[Any], Any]
    """What it does to a model (a copy the engine owns); returns the model's outcome."""
    impl_op: Callable[[psycopg.Connection], Any]
    """What it does to the implementation, on the worker's own connection; returns its outcome."""
    after: Callable[[Any], None] | None = None
    """What the kind remembers of the implementation's outcome once it answered, sequentially or
    in a block (default: nothing)."""
    on_error: Callable[[], None] | None = None
    """What the worker loses when the operation fails on a fault, answer unknown (default:
    nothing)."""
    guarantee: str | None = None
    """The guarantee of the contract the outcome *is* (``claim``: which runs a claim takes,
    ``lease``: which runs a reaper takes back): an outcome other than the model's breaks it
    (default: none)."""
    also_breaks: Callable[[Any], tuple[str, ...]] | None = None
    """Besides ``guarantee``, what an outcome other than the model's breaks, read from that
    outcome (a reaper that took back a terminal run: the terminal state's too, whether or not
    its row changed) (default: nothing more)."""
    fence: Callable[[], tuple[Any, Any, bool]] | None = None
    """For a write by an owner, which the contract refuses once the writer lost the run:
    ``(run, token, owner)`` now, ``owner`` whether the model says the writer still owns the run
    (default None: not such a write)."""
    external_maybe: Callable[[Any], None] | None = None
    """For an operation that calls an external side whose answer may be lost: what the side's
    having acted does to a model (default None: no external side)."""
    calls_out: bool = False
    """It calls an external side through the worker's own link inside its transaction: a lost
    reply armed for the worker's next call acts on that call (default: no such call)."""
    run: Callable[[], Any] | None = None
    """How the engine runs it as a step of its own when that is not one transaction on the
    worker's connection (an external call, driven by the kind): default None, through
    :meth:`.check.KindCheck.apply`. In a block such an action runs its ``impl_op`` when it has
    one (the call as one step of the schedule), and is not offered when it has none."""
    likely: bool = True
    """False for an action expected to lose (a lost race or a refusal, which the contract must
    get right too): drawn one time in three against the likely ones of its operation."""
    among_others: Callable[[Any, Any], Any] | None = None
    """For an operation whose correct outcomes are several when others run at once (a SKIP
    LOCKED claim may skip rows another transaction holds): the model operation given what the
    implementation answered, which accepts it when it is one of them (default None)."""
    parts: tuple[Callable[[Any], Any], ...] = ()
    """For an operation of several transactions (a reaper taking back each run in one of its
    own): each transaction's write as a model operation. One that fails part-way may leave any
    of them landed and the rest not, so after a failure every such state stays possible, in a
    step of its own and in a block, where each part is linearized on its own (default ():
    one transaction, all or nothing)."""
    split: Callable[[Any], tuple[Any, ...] | None] | None = None
    """With ``parts``: each part's share of the operation's answer, in order, by which a block
    judges each; None for an answer no part gives, judged whole (default None: each part's
    answer unknown, judged by the rows alone)."""
    runs: frozenset = frozenset()
    """The runs it may write (a fenced write: its run; a claim: the due runs; the reaper: the
    runs whose lease lapsed), so a block can aim at a run two workers contest."""
    once_freed: frozenset = frozenset()
    """Of its ``runs``, those it can write only once another operation freed them (a claim of
    a row whose lease lapsed: after the reaper took it back). A worker frozen inside its write
    on such a run sees the others act in that order (:func:`.schedules.frozen`)."""

    owner_write: bool = False
    """For a write only its run's owner makes that the contract lets land whether or not the
    writer still owns the run (a heartbeat matched by the run's id alone): a stalled owner
    races the others with it, as with its fenced writes (:meth:`.blocks.Blocks.race`)
    (default False; a fenced write is an owner's already)."""

    @property
    def fenced(self) -> bool:
        return self.fence is not None

    @property
    def by_owner(self) -> bool:
        """A write its run's owner makes: fenced, or :attr:`owner_write`."""
        return self.fenced or self.owner_write

    def breaks(self, got: Any) -> tuple[str, ...]:
        """What an outcome ``got`` other than the model's breaks: its guarantee, and what
        ``also_breaks`` reads in it."""
        own = (self.guarantee,) if self.guarantee else ()
        return own + (self.also_breaks(got) if self.also_breaks else ())

    def shown(self, worker: str) -> str:
        """The label with its worker: ``complete(w1, 3, attempt=2)``."""
        name, paren, rest = self.label.partition("(")
        if not paren:
            return f"{self.label}({worker})"
        return f"{name}({worker}{', ' if rest != ')' else ''}{rest}"


def part_way(models: list[Any], parts: tuple[Callable[[Any], Any], ...]) -> list[Any]:
    """The states an operation of several transactions (:attr:`Action.parts`) may leave when
    it failed part-way, from each of ``models``: every one with some of its parts landed, not
    none (``models`` themselves) and not all (the operation's own outcome)."""
    states: list[tuple[Any, int]] = [(m, 0) for m in models]
    for part in parts:
        for m, n in list(states):
            m = m.copy()
            part(m)
            states.append((m, n + 1))
    return [m for m, n in states if 0 < n < len(parts)]


def in_parts(history: list, actions: dict[str, Action], failed: set[str]) -> list:
    """A block's history (``actions``: each client's, ``failed``: the clients whose operation
    raised) with each operation of several transactions (:attr:`Action.parts`) judged as its
    parts, each linearized on its own within the operation's span (two reapers taking back one
    run each, of two, is then an order): answered, each part answers its share of the answer
    (:attr:`Action.split`); failed, indeterminate, or with an answer that says nothing of a part
    (a count, a lost race that ended its loop), each may or may not have landed. One that
    raised, or answered what no part answers, stays whole."""
    parted = {name for name, a in actions.items() if a.parts}
    whole = {op.client: op for op in history if op.client in parted}
    out = [op for op in history if op.client not in parted]
    for name in sorted(parted):
        action, op = actions[name], whole.get(name)
        answered = op is not None and op.ret is not None and name not in failed
        n = len(action.parts)
        unknown = (linearize.UNKNOWN,) * n
        outputs = action.split(op.output) if answered and action.split else unknown
        if outputs is None or (op is not None and isinstance(op.output, interleave.Raised)):
            out.append(op)
            continue
        out += [
            linearize.Operation(
                name,
                f"{action.label}: its transaction {i + 1} of {n}",
                part,
                op.call if op is not None else 0,
                op.ret if answered and output is not linearize.UNKNOWN else None,
                output,
            )
            for i, (part, output) in enumerate(zip(action.parts, outputs))
        ]
    return out


def broken_by(
    expected: Any, got: Any, fenced: bool, guarantee: str | Callable[[Any], tuple] | None
) -> tuple[str, ...]:
    """What an outcome that differs from the model's breaks, besides what the state shows: the
    guarantee the operation's outcome is (which runs a claim or a reaper takes, which step a
    step is, a payload approval froze), if it is one; and when a write the contract refuses
    went through, or one it lets win was refused, also the fence (a write by an owner) or the
    conditional transition (any other: exactly one caller wins, and it is this one).
    ``guarantee`` may be read in the outcome (:meth:`Action.breaks`)."""
    if callable(guarantee):
        guarantee = guarantee(got)
    own = (guarantee,) if isinstance(guarantee, str) else tuple(guarantee or ())
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
