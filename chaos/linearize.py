"""Linearizability of a concurrent history against a pure model.

Theory of operation
-------------------

A *history* is a set of operations, each with a call time, a return time and the outcome the
implementation observed. It is *linearizable* when some total order of the operations

* respects real time: an operation that returned before another was called comes first,
* and, applied one by one to the pure model from its initial state, produces every observed
  outcome,
* and ends in a model state whose projection equals the rows observed afterwards (the final-
  state check, when the caller supplies one).

The search is Wing & Gong's, with Lowe's improvement that Porcupine implements
(github.com/anishathalye/porcupine, ``checker.go``): the calls and returns, sorted by time, form
a doubly linked list; the search walks it, *lifting* an operation out of the list when the model
accepts it next (its call is reached before any pending return) and backtracking at a return
whose operation is not yet linearized. A cache of (set of linearized operations, model state)
prunes every configuration already explored, which is what keeps realistic histories fast.

Nondeterminism, Porcupine's way: the search state is a *set* of model states. An
*indeterminate* operation (its connection was cut while COMMIT was in flight: ``ret=None``) has
no return (it may linearize anywhere after its call), and either took effect or did not: both
successors are kept, and its outcome is not compared (:data:`UNKNOWN`). An operation whose
outcome was not observed but which certainly happened has a return time and ``output=UNKNOWN``.
The caller may also start from several candidate states (a check that is still narrowing an
earlier indeterminate COMMIT).

P-compositionality: when the model is a product of independent parts (one per run, or per
row), each part's sub-history is linearizable on its own iff the whole is (Herlihy & Wing).
``partition`` maps an operation to its part; the caller says when the model allows it.
The final-state check then compares each part's share of the rows (``FinalState.split``), and
the rows of parts no operation touched must still equal the initial state's.

A non-linearizable history yields a :class:`Verdict` naming the operations, the longest prefix
that the model does explain, and, for each operation that could come next, what the model
answers instead of what was observed (or, when every outcome is explained, the final rows
that no order produces).

Models are the project's pure models: ``copy()``, and operations that return outcome values.
The search needs equal states to compare equal: ``fingerprint(model)`` returns a hashable value
that captures everything an operation can read (default: the model's attributes, frozen,
without its ``transitions`` log).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence


class _Unknown:
    def __repr__(self) -> str:
        return "unknown"


UNKNOWN: Any = _Unknown()
"""An outcome nobody observed: any outcome of the model matches it."""

_NEVER = float("inf")


@dataclass(frozen=True, eq=False)
class Operation:
    """One operation of a history. ``apply(model)`` changes the model (a copy the checker owns)
    and returns the model's outcome, compared with ``output`` by ``==``. ``ret=None``: the
    operation never returned and may or may not have taken effect."""

    client: str
    label: str
    apply: Callable[[Any], Any]
    call: float
    ret: float | None
    output: Any = UNKNOWN
    key: Hashable = None

    def describe(self) -> str:
        if self.ret is None:
            return f"{self.client} {self.label} -> indeterminate (may or may not have happened)"
        out = "(outcome not observed)" if self.output is UNKNOWN else _short(repr(self.output))
        return f"{self.client} {self.label} -> {out}"


@dataclass(frozen=True)
class FinalState:
    """The rows observed after the history, and how to read a model state in the same shape.
    ``split`` cuts an observation into the parts of a partitioned check ({key: part})."""

    observed: Any
    project: Callable[[Any], Any]
    split: Callable[[Any], Mapping[Hashable, Any]] | None = None


@dataclass(frozen=True)
class Verdict:
    """The result of a check. ``ok``: True (linearizable), False, or None (the time budget ran
    out before the search decided)."""

    ok: bool | None
    history: tuple[Operation, ...]
    order: tuple[Operation, ...] = ()
    """A linearization (when ok; per part, parts one after another), else the longest prefix
    the model explains in the part that failed."""
    part: tuple[Operation, ...] = ()
    """The operations of the part that failed (the whole history when not partitioned)."""
    key: Hashable = None
    next_refused: tuple[tuple[Operation, str], ...] = ()
    """After the longest prefix: each operation that could come next, and why it cannot."""
    final: tuple[Any, Any] | None = None
    """(model, observed) rows when every outcome is explained but no order produces the rows."""
    final_states: tuple[Any, ...] = ()
    """When ok: the model states the history can have ended in (several after indeterminate
    operations, or orders that leave what the rows do not show apart), that the final rows
    accept, for a check that continues from them. With ``every_end``, those of every order
    that explains the history; else those of the first order found (in a partitioned check,
    the parts' orders one after another)."""
    partitions: int = 1
    seconds: float = 0.0
    next_answers: tuple[tuple[Any, ...], ...] = ()
    """For each of ``next_refused``: what the model answers instead (one per possible state)."""
    refused_anywhere: tuple[tuple[Operation, tuple[Any, ...], tuple[Any, ...]], ...] = ()
    """For a small part (:data:`DEAD_ENDS_UP_TO` operations): every operation some order of the
    part cannot go on with, what the model answers instead, and the model states it was refused
    in, over *all* orders, not only the
    longest prefix. Which guarantee a history breaks depends on the order it is read in (a
    heartbeat before a heal makes the heal wrong; after it, the heartbeat): a failure names the
    guarantees of all of them."""
    refused_in_end_order: tuple[tuple[Operation, tuple[Any, ...], tuple[Any, ...]], ...] = ()
    """The first operation refused when the part's operations are taken in the order they
    returned (the order in which the database let them take effect), as in
    ``refused_anywhere``; empty when that order explains them all."""

    def __bool__(self) -> bool:
        return bool(self.ok)

    def explain(self) -> list[str]:
        """The verdict as lines a counterexample can print."""
        if self.ok:
            return [
                f"linearizable: {len(self.history)} operations, {self.partitions} part(s), "
                f"{self.seconds:.3f} s"
            ]
        if self.ok is None:
            return [
                f"undecided: the search ran out of time after {self.seconds:.1f} s "
                f"({len(self.history)} operations)"
            ]
        where = "" if self.key is None else f" (part {self.key!r})"
        lines = [
            f"not linearizable{where}: no order of these {len(self.part)} operations, "
            "consistent with real time, explains what was observed:"
        ]
        if len(self.part) <= 30:
            lines += [f"  {op.describe()}" for op in self.part]
        if self.final is not None and len(self.order) == len(self.part):
            lines.append(
                "every outcome is explained, but no order ends in the observed rows; closest order:"
            )
            lines += [f"  {i}. {op.client} {op.label}" for i, op in enumerate(self.order, 1)]
            lines += [
                f"  model:    {_short(repr(self.final[0]), 300)}",
                f"  observed: {_short(repr(self.final[1]), 300)}",
            ]
            return lines
        if self.order:
            lines.append(f"longest linearizable prefix ({len(self.order)} of {len(self.part)}):")
            lines += [f"  {i}. {op.describe()}" for i, op in enumerate(self.order, 1)]
        else:
            lines.append("no operation can come first:")
        if self.order:
            lines.append("then none of the others can come next:")
        lines += [f"  {op.client} {op.label}: {why}" for op, why in self.next_refused]
        if self.final is not None:
            lines += [
                f"  (rows) model: {_short(repr(self.final[0]), 300)}",
                f"         observed: {_short(repr(self.final[1]), 300)}",
            ]
        return lines


def _short(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------
# Fingerprints: equal model states must give equal, hashable values.
# ---------------------------------------------------------------------------------------

NOT_STATE = frozenset({"transitions"})
"""Model attributes that are logs of the past, not state an operation can read."""


def freeze(value: Any) -> Hashable:
    """A hashable value equal for equal data (dicts by items, lists as tuples)."""
    if isinstance(value, dict):
        return ("dict", frozenset((freeze(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        if hasattr(value, "__dict__"):
            return (type(value).__name__, freeze(vars(value)))
        return repr(value)
    return value


def default_fingerprint(model: Any) -> Hashable:
    """Every attribute of the model except its transition log, frozen."""
    return (
        type(model).__name__,
        freeze({k: v for k, v in vars(model).items() if k not in NOT_STATE}),
    )


# ---------------------------------------------------------------------------------------
# The search.
# ---------------------------------------------------------------------------------------


class _States:
    """A set of model states, keyed by fingerprint."""

    __slots__ = ("models", "key")

    def __init__(self, models: dict[Hashable, Any]):
        self.models = models
        self.key = frozenset(models)


def _apply(op: Operation, model: Any, copy: Callable[[Any], Any]) -> tuple[Any, Any]:
    """(new model, outcome); a model that raises refuses the operation."""
    trial = copy(model)
    try:
        return trial, op.apply(trial)
    except Exception as e:  # the model refuses: an illegal transition, an unknown id...
        return None, f"the model raises {type(e).__name__}: {e}"


def _step(
    states: _States, op: Operation, fp: Callable[[Any], Hashable], copy: Callable[[Any], Any]
) -> _States | None:
    out: dict[Hashable, Any] = {}
    for key, model in states.models.items():
        if op.ret is None:
            out.setdefault(key, model)  # it may not have happened
        trial, got = _apply(op, model, copy)
        if trial is not None and (op.output is UNKNOWN or op.ret is None or got == op.output):
            out.setdefault(fp(trial), trial)
    return _States(out) if out else None


def states_met(
    order: Sequence[Operation],
    initial: Sequence[Any],
    *,
    fingerprint: Callable[[Any], Hashable] = default_fingerprint,
    copy: Callable[[Any], Any] = lambda model: model.copy(),
) -> dict[str, tuple[Any, ...]]:
    """For an order that explains a history (a verdict's ``order``, from the states it started
    in): the model states each client's first operation met, just before it applied. A check's
    judgment of an outcome that depends on what came before it in a block reads these, not the
    state before the block."""
    state = _States({fingerprint(m): m for m in initial})
    met: dict[str, tuple[Any, ...]] = {}
    for op in order:
        met.setdefault(op.client, tuple(state.models.values()))
        state = _step(state, op, fingerprint, copy) or state
    return met


class _Budget(Exception):
    pass


def _search(
    ops: Sequence[Operation],
    start: _States,
    fp: Callable[[Any], Hashable],
    copy: Callable[[Any], Any],
    final_ok: Callable[[Any], bool] | None,
    deadline: float | None,
    every_end: bool = False,
) -> tuple[bool, list[int], _States | None, bool]:
    """Porcupine's checkSingle over ``ops``. Returns (ok, order or longest prefix, final states
    when ok, whether the longest prefix covers every operation but failed the final check).
    ``every_end``: the final states of every order that explains ``ops``, not only the first
    order's (the search goes on past it; its cache keeps that to the configurations not yet
    explored)."""
    n = len(ops)
    events = []
    for i, op in enumerate(ops):
        events.append((op.call, 0, i))
        events.append((_NEVER if op.ret is None else op.ret, 1, i))
    events.sort(key=lambda e: (e[0], e[1]))
    # Doubly linked list over positions 1..2n; 0 is the head, 2n + 1 the end.
    end = 2 * n + 1
    nxt = list(range(1, end + 1)) + [end]
    prv = [0] + list(range(0, end))
    is_call = [False] * (end + 1)
    op_at = [-1] * (end + 1)
    ret_pos = [0] * n
    call_pos = [0] * n
    for pos, (_, kind, i) in enumerate(events, start=1):
        op_at[pos] = i
        if kind == 0:
            is_call[pos] = True
            call_pos[i] = pos
        else:
            ret_pos[i] = pos

    def lift(c: int) -> None:
        r = ret_pos[op_at[c]]
        nxt[prv[c]] = nxt[c]
        prv[nxt[c]] = prv[c]
        nxt[prv[r]] = nxt[r]
        prv[nxt[r]] = prv[r]

    def unlift(c: int) -> None:
        r = ret_pos[op_at[c]]
        prv[nxt[r]] = r
        nxt[prv[r]] = r
        prv[nxt[c]] = c
        nxt[prv[c]] = c

    cache: set[tuple[int, frozenset]] = set()
    calls: list[tuple[int, _States]] = []  # (call position, state before it)
    linearized = 0
    state = start
    longest: list[int] = []
    longest_complete = False
    found: list[int] | None = None  # the first order that explains ops
    ends: dict[Hashable, Any] = {}  # the final states of the orders found
    entry = nxt[0]
    steps = 0
    while True:
        steps += 1
        if deadline is not None and steps % 512 == 1 and time.monotonic() > deadline:
            raise _Budget()
        if nxt[0] == end:  # everything linearized: the rows decide
            accepted = {k: m for k, m in state.models.items() if final_ok is None or final_ok(m)}
            if accepted:
                if found is None:
                    found = [op_at[c] for c, _ in calls]
                ends.update(accepted)
                if not every_end:
                    return True, found, _States(ends), False
            elif len(calls) >= len(longest):
                longest, longest_complete = [op_at[c] for c, _ in calls], True
            entry = end  # backtrack below
        if entry != end and is_call[entry]:
            i = op_at[entry]
            new = _step(state, ops[i], fp, copy)
            if new is not None:
                bits = linearized | (1 << i)
                memo = (bits, new.key)
                if memo not in cache:
                    cache.add(memo)
                    calls.append((entry, state))
                    state, linearized = new, bits
                    lift(entry)
                    entry = nxt[0]
                    continue
            entry = nxt[entry]
            continue
        # A return whose operation is not linearized (or the end): backtrack.
        if not calls:
            if found is not None:
                return True, found, _States(ends), False
            return False, longest, None, longest_complete
        if len(calls) > len(longest):
            longest, longest_complete = [op_at[c] for c, _ in calls], False
        entry, state = calls.pop()
        linearized &= ~(1 << op_at[entry])
        unlift(entry)
        entry = nxt[entry]


def _refusals(
    ops: Sequence[Operation],
    prefix: list[int],
    start: _States,
    fp: Callable[[Any], Hashable],
    copy: Callable[[Any], Any],
) -> tuple[_States, list[tuple[Operation, str, tuple[Any, ...]]]]:
    """The states after ``prefix``, and why each operation that could come next cannot (and what
    the model answers instead)."""
    state = start
    for i in prefix:
        state = _step(state, ops[i], fp, copy) or state
    rest = [i for i in range(len(ops)) if i not in set(prefix)]
    first_ret = min((ops[i].ret for i in rest if ops[i].ret is not None), default=_NEVER)
    out = []
    for i in rest:
        op = ops[i]
        if op.call > first_ret:
            continue  # must come after an operation that is not linearized yet
        answers, raw = [], []
        for model in state.models.values():
            trial, got = _apply(op, model, copy)
            answers.append(got if trial is None else f"the model answers {_short(repr(got))}")
            if trial is not None:
                raw.append(got)
        why = "; ".join(sorted(set(answers)))
        if op.ret is not None and op.output is not UNKNOWN:
            why = f"observed {_short(repr(op.output))}, {why}"
        out.append((op, why, tuple(raw)))
    return state, out


DEAD_ENDS_UP_TO = 6
"""Parts up to this many operations have their dead ends enumerated (at most 6! orders)."""


def _dead_ends(
    ops: Sequence[Operation],
    start: _States,
    fp: Callable[[Any], Hashable],
    copy: Callable[[Any], Any],
) -> tuple[tuple[Operation, tuple[Any, ...], tuple[Any, ...]], ...]:
    """Every (operation, the model's answers, the states it was refused in) refused right after
    some prefix that the model explains, over every order consistent with real time (for small
    parts only)."""
    out: dict[int, tuple[list[Any], list[Any]]] = {}

    def walk(state: _States, done: frozenset) -> None:
        rest = [i for i in range(len(ops)) if i not in done]
        first_ret = min((ops[i].ret for i in rest if ops[i].ret is not None), default=_NEVER)
        for i in rest:
            if ops[i].call > first_ret:
                continue
            new = _step(state, ops[i], fp, copy)
            if new is not None:
                walk(new, done | {i})
            else:
                _refused_in(state, ops[i], copy, *out.setdefault(i, ([], [])))

    walk(start, frozenset())
    return tuple((ops[i], tuple(out[i][0]), tuple(out[i][1])) for i in sorted(out))


def _refused_in(
    state: _States, op: Operation, copy: Callable[[Any], Any], answers: list, states: list
) -> None:
    """Add to ``answers`` what the model answers ``op`` instead, in each of ``state``'s models
    that refuses it, and those models to ``states``."""
    for m in state.models.values():
        trial, got = _apply(op, m, copy)
        if trial is not None:
            states.append(m)
            if got not in answers:
                answers.append(got)


def _refused_in_end_order(
    ops: Sequence[Operation],
    start: _States,
    fp: Callable[[Any], Hashable],
    copy: Callable[[Any], Any],
) -> tuple[tuple[Operation, tuple[Any, ...], tuple[Any, ...]], ...]:
    """The first operation the model refuses when the operations are taken in the order they
    returned (those without an answer last), as ``(operation, the model's answers, the states
    it was refused in)``; empty when it refuses none. Operations that overlapped on one row
    ended in the order the database serialised them: the order their writes took effect."""
    state = start
    for op in sorted(ops, key=lambda op: (op.ret is None, op.ret or 0)):
        new = _step(state, op, fp, copy)
        if new is None:
            answers: list[Any] = []
            states: list[Any] = []
            _refused_in(state, op, copy, answers, states)
            return ((op, tuple(answers), tuple(states)),)
        state = new
    return ()


def check(
    history: Iterable[Operation],
    initial: Any | Sequence[Any],
    *,
    fingerprint: Callable[[Any], Hashable] = default_fingerprint,
    copy: Callable[[Any], Any] = lambda model: model.copy(),
    final: FinalState | None = None,
    partition: Callable[[Operation], Hashable] | None = None,
    budget_s: float | None = None,
    every_end: bool = False,
) -> Verdict:
    """Is ``history`` linearizable from ``initial`` (a model, or a list of candidate models)?

    ``partition(op)``: check each part alone (the caller asserts the model's parts are
    independent). ``final``: the rows the order must also produce. ``copy``: how to copy a
    model (its own ``copy()``). ``budget_s``: give up (``ok=None``) after this long.
    ``every_end``: ``final_states`` from every order that explains the history, for a check
    that goes on from them (a small history: every order is searched); else from the first."""
    t0 = time.monotonic()
    ops = tuple(history)
    for op in ops:
        if op.ret is not None and op.ret < op.call:
            raise ValueError(
                f"{op.client} {op.label}: returns at {op.ret}, before its call at {op.call}"
            )
    candidates = list(initial) if isinstance(initial, (list, tuple)) else [initial]
    start = _States({fingerprint(m): m for m in candidates})
    deadline = None if budget_s is None else t0 + budget_s
    parts: dict[Hashable, list[Operation]] = {}
    for op in ops:
        parts.setdefault(partition(op) if partition else None, []).append(op)
    if not parts:
        parts[None] = []
    split = final.split if final is not None and partition is not None else None
    if partition is not None and final is not None and split is None:
        raise ValueError("a partitioned check with a final state needs FinalState.split")
    observed_parts = split(final.observed) if split else None

    def final_ok_for(key: Hashable) -> Callable[[Any], bool] | None:
        if final is None:
            return None
        if split is None:
            return lambda m: final.project(m) == final.observed
        return lambda m: split(final.project(m)).get(key) == observed_parts.get(key)

    orders: list[Operation] = []
    ends: list[_States] = []
    for key, part in parts.items():
        ok_final = final_ok_for(key)
        try:
            ok, order, end_states, complete = _search(
                part, start, fingerprint, copy, ok_final, deadline, every_end
            )
        except _Budget:
            return Verdict(None, ops, partitions=len(parts), seconds=time.monotonic() - t0)
        if not ok:
            state, refused = _refusals(part, order, start, fingerprint, copy)
            shown = None
            if final is not None and (complete or not refused):
                model = next(iter(state.models.values()))
                mine = final.project(model)
                theirs = final.observed
                if split is not None:
                    mine, theirs = split(mine).get(key), observed_parts.get(key)
                shown = (mine, theirs)
            anywhere = (
                _dead_ends(part, start, fingerprint, copy) if len(part) <= DEAD_ENDS_UP_TO else ()
            )
            in_end_order = _refused_in_end_order(part, start, fingerprint, copy)
            return Verdict(
                False,
                ops,
                tuple(part[i] for i in order),
                tuple(part),
                key,
                tuple((op, why) for op, why, _ in refused),
                shown,
                next_answers=tuple(raw for _, _, raw in refused),
                refused_anywhere=anywhere,
                refused_in_end_order=in_end_order,
                partitions=len(parts),
                seconds=time.monotonic() - t0,
            )
        orders += [part[i] for i in order]
        ends.append(end_states)
    if split is not None:  # rows no operation touched must be as they started
        for model in start.models.values():
            mine = split(final.project(model))
            untouched = (set(mine) | set(observed_parts)) - set(parts)
            bad = [k for k in sorted(untouched, key=repr) if mine.get(k) != observed_parts.get(k)]
            if not bad:
                break
        else:
            k = bad[0]
            return Verdict(
                False,
                ops,
                (),
                (),
                k,
                (),
                (mine.get(k), observed_parts.get(k)),
                partitions=len(parts),
                seconds=time.monotonic() - t0,
            )
    if len(ends) == 1:
        final_states = tuple(ends[0].models.values())
    else:  # independent parts: replay the parts' orders one after another
        state = start
        for op in orders:
            state = _step(state, op, fingerprint, copy) or state
        final_states = tuple(state.models.values())
    return Verdict(
        True,
        ops,
        tuple(orders),
        partitions=len(parts),
        final_states=final_states,
        seconds=time.monotonic() - t0,
    )
