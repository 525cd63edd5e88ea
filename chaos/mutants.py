"""The mutant catalogue: small, realistic bugs applied to the reference implementation.

A gate that never fails proves nothing. Each mutant is a named bug in one run kind that breaks
one invariant of the seed; ``knownstate mutants`` runs the kind's check against each and
passes only when the reference passes and every mutant is caught. A mutant is applied by
subclassing the kind's check (so it swaps SQL text or an implementation class for that run
only); nothing in the reference implementation changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .engine import Engine


@dataclass(frozen=True)
class Mutant:
    """A named bug. It counts as caught only when the check fails naming ``invariant``.
    ``needs``: what the database must be able to do for the bug to show at all (capabilities
    of ``Env.capabilities()``, e.g. ``db-clock`` for a bug that reads the application's clock
    where the database's is meant: only a database clock that moves apart from the
    application's tells the two apart). Elsewhere it is not covered on this database."""

    name: str
    kind: str
    invariant: str  # the invariant it breaks: one the kind's check can name (named_invariants)
    description: str
    apply: Callable[[type[Engine]], type[Engine]]
    needs: tuple[str, ...] = ()

    def machine(self, check: type[Engine]) -> type[Engine]:
        return self.apply(check)

    def missing(self, capabilities: frozenset[str]) -> list[str]:
        """What this database cannot do that the mutant needs (empty: it can be caught here)."""
        return [c for c in self.needs if c not in capabilities]


def catalogue_problems(check: type[Engine], mutants: list[Mutant]) -> list[str]:
    """What is wrong with a kind's catalogue: a mutant declaring an invariant its check cannot
    name (it could never be caught), a mutant of another kind, two mutants with one name."""
    known = check.named_invariants()
    out = [
        f"mutant {m.name} declares invariant {m.invariant!r}, which the {check.kind} check "
        f"never names: choose from {', '.join(sorted(known))}"
        for m in mutants
        if m.invariant not in known
    ]
    out += [
        f"mutant {m.name} is listed under {check.kind} but says it is of {m.kind}"
        for m in mutants
        if m.kind != check.kind
    ]
    names = [m.name for m in mutants]
    out += [f"two mutants are named {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    return out


class CatalogueDrift(RuntimeError):
    """A mutant no longer applies: the reference SQL it edits changed. Update the catalogue."""


def sql_edit(queries: dict[str, str], name: str, old: str, new: str) -> dict[str, str]:
    """A copy of ``queries`` with ``old`` replaced by ``new`` in query ``name``. Raises when ``old``
    is not there, so a mutant never silently turns into the reference."""
    text = queries[name]
    if old not in text:
        raise CatalogueDrift(f"mutant edit of query {name!r}: {old!r} not found")
    return {**queries, name: text.replace(old, new)}


def with_attrs(**attrs) -> Callable[[type[Engine]], type[Engine]]:
    """Apply a mutant by overriding class attributes of the check (a store class, a query dict)."""

    def apply(check: type[Engine]) -> type[Engine]:
        return type(f"{check.__name__}Mutant", (check,), dict(attrs))

    return apply
