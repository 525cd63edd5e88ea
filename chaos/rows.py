"""Row draws that mean the same row whatever came before them.

A step draws which row it acts on (a run, a proposal, a worker) among those it can act on now.
Drawn as a place in that list (``st.sampled_from``), the draw depends on everything before it:
shrinking deletes an earlier step (one that approved or expired another run), the list changes,
and the same bytes now name another row, so the race the counterexample needed never happens and
the deletion is refused (approved-plan, compensate-outside-run-lock at seed 3 kept 12 steps;
complete-reads-attempt-first at seed 4, 13). A list of one option draws nothing at all, which
shifts every later draw onto other bytes.

Here a row is drawn by rendezvous hashing (Thaler & Ravishankar's highest random weight): one
wide number, always the same width; each option is scored by a hash of that number and the
option's *name* (what identifies the row whatever came before: its key, the worker's name, never
its place in a list); the highest score wins. Removing any other option never changes the pick;
adding one changes it only when the new one scores higher. Each option is as likely as the
others, or ``weight`` times as likely (weighted by tickets: an option of weight 2 is scored
twice, under two names).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")

WIDE = 2**32 - 1
"""The drawn number's range: wide, so that every option can win and Hypothesis's preference
for small numbers does not favour any."""

NAME = st.integers(0, WIDE)
"""A run's name, drawn by the step that creates it when the database keys the run (a serial
id, renumbered when shrinking deletes a step that created another run before it):
``Engine.name_run``."""


def score(n: int, name: str) -> int:
    """The rendezvous score of the option named ``name`` under the drawn number ``n``
    (deterministic across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(f"{n}\x1f{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(
    n: int,
    options: Sequence[T],
    name: Callable[[T], Any] = repr,
    weight: Callable[[T], int] = lambda _: 1,
) -> list[T]:
    """``options`` best first under the drawn number ``n``: by the best score of their tickets.
    Options of one name (two actions of one operation on one row: a step run next or again) are
    told apart by their place among those of that name."""
    seen: dict[str, int] = {}
    named = []
    for o in options:
        base = str(name(o))
        if " at 0x" in base:  # an address differs between processes: the seed would not replay
            raise ValueError(f"{base[:60]}...: a row's name must not depend on the process")
        seen[base] = seen.get(base, -1) + 1
        named.append(f"{base}~{seen[base]}" if seen[base] else base)

    def best(i: int) -> int:
        tickets = range(weight(options[i]))
        return max(score(n, f"{named[i]}#{t}" if t else named[i]) for t in tickets)

    order = sorted(range(len(options)), key=lambda i: (best(i), -i), reverse=True)
    return [options[i] for i in order]


def row_names(action, run_name: Callable[[Any], str] = repr) -> str:
    """What names an action whatever came before: its operation and its row when it touches one
    (not its label, whose arguments, an attempt or a token, depend on the steps before; the row
    by ``run_name``); its label when it touches several or none (a claim of the due runs, the
    reaper)."""
    if len(action.runs) == 1:
        return f"{action.op} {run_name(next(iter(action.runs)))}"
    return action.label


def row(
    data,
    options: Sequence[T],
    label: str,
    name: Callable[[T], Any] = repr,
    weight: Callable[[T], int] = lambda _: 1,
) -> T:
    """One of ``options`` (not empty), drawn so that the draw names the same option whatever
    came before (see the module's header). ``name``: what identifies an option across examples
    (its row's key); ``weight``: how many times as likely it is."""
    if not options:
        raise ValueError(f"no option to draw for {label!r}: the caller's precondition must hold")
    n = data.draw(st.integers(0, WIDE), label=label)
    return rank(n, options, name, weight)[0]


def rows(
    data, options: Sequence[T], least: int, most: int, label: str, name: Callable[[T], Any] = repr
) -> list[T]:
    """Between ``least`` and ``most`` of ``options`` (at most as many as there are), in their
    given order: how many drawn as a wide number too, then the best ranked under another (so
    removing an option not picked changes nothing)."""
    most = min(most, len(options))
    k = data.draw(st.integers(0, WIDE), label=f"{label}: how many")
    count = least + k % (most - least + 1) if most >= least else most
    n = data.draw(st.integers(0, WIDE), label=label)
    picked = {id(o) for o in rank(n, options, name)[:count]}
    return [o for o in options if id(o) in picked]


def one_of_classes(
    data, classes: Sequence[Sequence[T]], label: str, name: Callable[[T], Any] = repr
) -> T:
    """One option of one of ``classes`` (each class as likely as the others, an empty one
    skipped: the next non-empty one taken), the class drawn first as a wide number, the option
    in it by :func:`row` (the two-in-three preference of a draw for a row where the operation can
    win, kept while the row is named whatever came before)."""
    k = data.draw(st.integers(0, WIDE), label=f"{label}: which kind")
    for i in range(len(classes)):
        chosen = classes[(k + i) % len(classes)]
        if chosen:
            return row(data, chosen, label, name)
    raise ValueError(f"no option to draw for {label!r}: the caller's precondition must hold")
