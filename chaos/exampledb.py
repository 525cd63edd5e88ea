"""The example database a run keeps: Hypothesis's, saving only genuine failures
(:class:`GateDatabase`), or keeping new ones without handing any out (:class:`SaveOnly`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hypothesis.database import ExampleDatabase

if TYPE_CHECKING:
    from .runner import RunState


class Wrapped(ExampleDatabase):
    """Hands every call to the database it wraps; the ones below change what they must."""

    def __init__(self, inner: ExampleDatabase):
        super().__init__()
        self.inner = inner

    def fetch(self, key: bytes):
        return self.inner.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(src, dest, value)

    def add_listener(self, f) -> None:  # pragma: no cover - no live listeners here
        pass

    def remove_listener(self, f) -> None:  # pragma: no cover
        pass


class GateDatabase(Wrapped):
    """Hypothesis's example database, keeping only genuine failures: an example stopped by the
    run (coverage reached, environment fault) is never saved as one. Replayed first next time."""

    def __init__(self, inner: ExampleDatabase, run: RunState):
        super().__init__(inner)
        self.run = run

    def save(self, key: bytes, value: bytes) -> None:
        if self.run.allow_save and not key.endswith(b".pareto"):
            self.inner.save(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if self.run.allow_save or dest.startswith(src):
            self.inner.move(src, dest, value)


class SaveOnly(Wrapped):
    """An example database that keeps new failures but hands none out for replay: for the
    batches after the first (the stored examples were replayed there) and for measurements."""

    def fetch(self, key: bytes):
        return iter(())
