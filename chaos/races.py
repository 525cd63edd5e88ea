"""What a kind declares of its races: read-then-write bugs only overlapping transactions show.

A kind lists, beside its mutants, its race mutants (:class:`RaceMutant`): an implementation
variant (:class:`Variant`: a store class, and a schema when the bug lies there) that is correct
one operation at a time and wrong when transactions overlap, and the :class:`Scenario` that
reaches the race (setup operations run one after another, an optional clock jump, then a block
of :class:`Call` started together). Each kind keeps its own in its mutants module, as
``RACES``; :mod:`.race_mutants` gathers them from the registry and runs scenarios on real parts,
and a race mutant joins its kind's catalogue as a :class:`~knownstate.chaos.mutants.Mutant` for
the engine's concurrent blocks (:meth:`RaceMutant.mutant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Hashable

import psycopg

from . import linearize
from .mutants import CatalogueDrift, Mutant, with_attrs

QUANTUM = 60
"""Model time is whole seconds; timestamps are read back to the nearest minute (exact while an
example lasts under half a minute), and every clock jump is a multiple of it."""


@dataclass(frozen=True)
class Call:
    """One operation: by ``worker``, on the model and on the implementation (a store)."""

    worker: str
    label: str
    model: Callable[[Any], Any]
    impl: Callable[[Any, psycopg.Connection], Any]

    @classmethod
    def alike(cls, worker: str, label: str, op: str, *args: Any) -> Call:
        """``op`` called alike on both sides: ``model.op(*args)``, ``store.op(conn, *args)``."""
        return cls(
            worker, label, lambda m: getattr(m, op)(*args), lambda s, c: getattr(s, op)(c, *args)
        )


@dataclass(frozen=True)
class Scenario:
    """Setup operations run one after another, a clock jump, then ``block`` started together."""

    name: str
    kind: str
    schema: str
    tables: tuple[str, ...]
    new_model: Callable[[], Any]
    new_store: Callable[[type, str, Any], Any]
    """``new_store(store_class, worker, stand_in)``: the stand-in is None without one."""
    project: Callable[[psycopg.Connection, Callable[[datetime], int]], Any]
    project_model: Callable[[Any], Any]
    block: tuple[Call, ...]
    setup: tuple[Call, ...] = ()
    jump: int = 0
    fingerprint: Callable[[Any], Hashable] = linearize.default_fingerprint
    reference_store: type | None = None
    stand_in: type | None = None
    """An external service the operations call (a class with ``start``, ``stop``, ``reset``):
    the rig runs one, reset before each example; each call to it is a step of the block."""

    @property
    def workers(self) -> list[str]:
        return sorted({c.worker for c in self.setup + self.block})


@dataclass(frozen=True)
class Variant:
    """An implementation: the reference, or a mutant's store class and schema."""

    name: str
    store_class: type | None = None
    schema: str | None = None


REFERENCE = Variant("reference")


def schema_edit(schema: str, old: str, new: str) -> str:
    """``schema`` with ``old`` replaced; the catalogue has drifted when ``old`` is not there."""
    if old not in schema:
        raise CatalogueDrift(f"race mutant edit of a schema: {old!r} not found")
    return schema.replace(old, new)


@dataclass(frozen=True)
class RaceMutant:
    """A bug only a concurrent block reveals, the scenario that reaches it, and why the
    sequential mode misses it."""

    name: str
    kind: str
    invariant: str
    description: str
    variant: Variant
    scenario: Scenario
    sequential_misses: str

    def mutant(self) -> Mutant:
        """The mutant for the kind's check (``store_class``, and ``schema`` when edited)."""
        attrs: dict[str, Any] = {"store_class": self.variant.store_class}
        if self.variant.schema is not None:
            attrs["schema"] = self.variant.schema
        return Mutant(self.name, self.kind, self.invariant, self.description, with_attrs(**attrs))
