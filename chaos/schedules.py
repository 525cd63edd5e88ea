"""How a concurrent block's schedule is drawn (:mod:`.blocks`): which parked worker runs its next
statement, each time every worker has come to rest (:mod:`.interleave`). Two draws: :func:`pct`,
a priority order with change points (a block of any operations, or one aimed at a pair),
:func:`frozen`, a worker frozen inside its write while the others run whole operations, and
:func:`preempted_once`, one worker preempted after a drawn statement (the document server's
blocks, whose coverage counts the points each operation was preempted at)."""

from __future__ import annotations

from typing import Callable

from hypothesis import strategies as st

WHOLE_CALL = "CALL "
"""How the step of an operation that is one external call begins (``CALL POST /runs/3``): its
only step, so its last, where a block aimed at a pair must preempt it as before a COMMIT."""


def _last_step(label: str | None) -> bool:
    """Whether a worker parked before ``label`` ends its operation with it (COMMIT, ROLLBACK,
    or the one step of an external call made as a whole operation)."""
    text = label or ""
    return text.split(" (")[0] in ("COMMIT", "ROLLBACK") or text.startswith(WHOLE_CALL)


def pct(
    data, names: list[str], pending: Callable[[str], str | None] | None = None
) -> Callable[[list[str]], str]:
    """The block's schedule, drawn as PCT draws it (Burckhardt et al., probabilistic
    concurrency testing): a priority order of the workers and up to two change points, steps
    after which the worker then on top drops to the bottom. The highest-priority worker that
    can run takes each step. A race of depth d (one read, then others' commits, then the
    write) needs d - 1 change points, so short draws reach it often, and the schedule shrinks
    towards running the workers one after another.

    ``pending`` (a block aimed at a pair of operations on one row: the statement a worker is
    parked before) makes the pair race: exactly one change point (with two operations, one
    preemption of either reaches every race of depth 2; a second one mostly undoes the
    first, the preempted worker running again before the other read), drawn uniformly among
    the first 3 n steps (as a wide number: drawn as a step, it was mostly the first one,
    and a read three statements into the operation, as a get-or-create's, was rarely
    passed); it always comes before the first worker's COMMIT (or ROLLBACK): a
    change point drawn past it (an operation shorter than the draw) falls on it, so every
    statement of the operation, its last one included, is a point where it can be
    preempted, and the two operations always overlap. Shrinks towards the first worker's
    first step, then the other's whole operation."""
    interleaved = pending is not None
    order = list(data.draw(st.permutations(names), label="priority"))
    if interleaved:
        drawn = data.draw(st.integers(0, 2**16 - 1), label="priority change (drawn)")
        changes = {1 + drawn % (3 * len(names))}
    else:
        changes = set(
            data.draw(
                st.lists(st.integers(1, 2 * len(names)), max_size=2, unique=True),
                label="priority changes after steps",
            )
        )
    step = 0
    changed = False

    def choose(options: list[str]) -> str:
        nonlocal step, changed
        step += 1
        top = next(n for n in order if n in options)
        due = step - 1 in changes or (
            interleaved and not changed and len(options) > 1 and _last_step(pending(top))
        )
        if due:
            changed = True
            order.remove(top)
            order.append(top)
        return next(n for n in order if n in options)

    return choose


def frozen(
    data,
    stalled: str,
    others: list[str],
    later: list[str] = (),
    pending: Callable[[str], str | None] = lambda _: None,
    first: bool = False,
) -> Callable[[list[str]], str]:
    """The schedule of a worker frozen inside its operation (a GC pause, a suspended VM,
    between two statements of its transaction, holding what it locked): it runs its first
    statements (after each one but a BEGIN or SAVEPOINT, whether it freezes there is drawn:
    after the first, three times in four; frozen after a BEGIN it has read nothing, so it
    would only run after the others), then the others run their whole operations one after
    another (one that waits on a lock the frozen worker holds steps aside), then it finishes.
    The others' order is drawn, except that those in ``later`` (which can write the run only
    once another operation freed it: a claim of a row whose lease lapsed) come after the rest.
    ``first``: it freezes right after its first statement (a block aimed at its run taken
    back and claimed: the widest gap between what it read and what it writes). Shrinks
    towards never freezing: the stalled worker's whole write, then the others'."""
    drawn = data.draw(st.permutations(others), label="the others' order")
    order = sorted(drawn, key=lambda n: n in later)
    frozen = False

    def choose(options: list[str]) -> str:
        nonlocal frozen
        if not frozen and stalled in options:
            if (pending(stalled) or "").startswith(("BEGIN", "SAVEPOINT")):
                return stalled
            frozen = (
                first
                or data.draw(
                    st.integers(0, 3), label=f"{stalled} freezes after this step (unless 0)"
                )
                > 0
            )
            return stalled
        return next((n for n in order if n in options), stalled)

    return choose


PREEMPTION_POINTS = 4
"""How deep into an operation :func:`preempted_once` preempts it: after one of its first four
statements (the document server's longest operation has three, a mutant's four). A later
statement is not a point a block is required to preempt (CHESS bounds the same way)."""


def preempted_once(data, names: list[str], first: str | None = None) -> Callable[[list[str]], str]:
    """One preemption, as CHESS bounds them (Musuvathi and Qadeer): a worker (the first of a
    drawn order, or ``first``) runs its first k statements, the others then run their whole
    operations in the drawn order, then it ends; past its last statement they run one after
    another. Hypothesis favours the order given, so list first the operation with statements
    to preempt; k is drawn up to :data:`PREEMPTION_POINTS`, and Hypothesis favours 1 (an
    operation of two statements has only that point). Every bug one preemption reveals (a
    read, then another's whole write, then a write on what was read) is one draw away,
    whichever statement it needs: change points drawn as a list mostly were none (39 of 58
    blocks of saves on one version ran one after the other). Shrinks towards the order given,
    preempted after its first statement."""
    order = list(data.draw(st.permutations(names), label="who runs first, then the others' order"))
    if first is not None:
        order = [first] + [n for n in order if n != first]
    k = data.draw(st.integers(1, PREEMPTION_POINTS), label="preempted after statements")
    ran = 0

    def choose(options: list[str]) -> str:
        nonlocal ran
        if order[0] in options and ran < k:
            ran += 1
            return order[0]
        return next(n for n in order[1:] + order[:1] if n in options)

    return choose
