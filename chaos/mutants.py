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

from .check import KindCheck


@dataclass(frozen=True)
class Mutant:
    name: str
    kind: str
    invariant: str  # the invariant it breaks (a key of contract.INVARIANTS, or the kind's own name)
    description: str
    apply: Callable[[type[KindCheck]], type[KindCheck]]

    def machine(self, check: type[KindCheck]) -> type[KindCheck]:
        return self.apply(check)


class CatalogueDrift(RuntimeError):
    """A mutant no longer applies: the reference SQL it edits changed. Update the catalogue."""


def sql_edit(queries: dict[str, str], name: str, old: str, new: str) -> dict[str, str]:
    """A copy of ``queries`` with ``old`` replaced by ``new`` in query ``name``. Raises when ``old``
    is not there, so a mutant never silently turns into the reference."""
    text = queries[name]
    if old not in text:
        raise CatalogueDrift(f"mutant edit of query {name!r}: {old!r} not found")
    return {**queries, name: text.replace(old, new)}


def with_attrs(**attrs) -> Callable[[type[KindCheck]], type[KindCheck]]:
    """Apply a mutant by overriding class attributes of the check (a store class, a query dict)."""
    def apply(check: type[KindCheck]) -> type[KindCheck]:
        return type(f"{check.__name__}Mutant", (check,), dict(attrs))
    return apply
