"""Where a run's time goes (``knownstate verify --timings``): seconds per category of work.

A :class:`Timings` collector is installed for one run (:func:`collecting`); the few places
where costly work happens open a :func:`span` of their category — the database crash and
restart, a call to Toxiproxy's API, a new connection, a wait for the server (a backend to go,
a lease to lapse), the reset between examples, the implementation's own call, a concurrent
block (its workers' operations, one statement at a time as its schedule says), the model and
the invariants. Spans nest and are exclusive: a connection opened inside the implementation's
call counts as ``connect``, not twice, and a crash inside a block as ``crash``. What is in no
span is Hypothesis itself (drawing, shrinking, running the rules) and the engine's
bookkeeping: ``hypothesis`` is the rest of the run's time, so the categories sum to it.

Only the thread that installed the collector records (the check's main thread); work on
other threads (a concurrent block's workers, the lock watch) shows as the main thread's wait
for it, in the span the main thread is in. Timings are reported only: nothing decides a
verdict by them. With no collector installed, a span costs one global read.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Iterator

CATEGORIES: dict[str, str] = {
    "crash": "database crash and restart",
    "toxiproxy": "Toxiproxy API calls",
    "connect": "new connections",
    "wait": "waits (backends to go, polls)",
    "reset": "reset between examples",
    "stand-in": "the check's calls to stand-ins",
    "impl": "the implementation's calls",
    "block": "concurrent blocks (scheduled)",
    "check": "model and invariant checks",
    "hypothesis": "Hypothesis and the engine (the rest)",
}
"""Every category, in the order printed; ``hypothesis`` is what no span covered."""


class Timings:
    """Exclusive seconds and span counts per category, on the thread that created it."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.calls = dict.fromkeys(CATEGORIES, 0)
        self.thread = threading.get_ident()
        self._stack: list[list] = []  # [category, start, seconds of spans inside it]

    def enter(self, category: str) -> None:
        self._stack.append([category, time.perf_counter(), 0.0])

    def exit(self) -> None:
        category, start, inner = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[category] += elapsed - inner
        self.calls[category] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    def as_dict(self, total: float, steps: int) -> dict:
        """The report: per category its seconds, share of ``total`` and spans; ``hypothesis``
        is ``total`` less every span; and steps per second."""
        spans = sum(s for c, s in self.seconds.items() if c != "hypothesis")
        seconds = {**self.seconds, "hypothesis": max(0.0, total - spans)}
        return {
            "seconds": round(total, 3),
            "steps_per_s": round(steps / total, 1) if total > 0 else 0.0,
            "categories": {
                c: {
                    "seconds": round(seconds[c], 3),
                    "share": round(seconds[c] / total, 4) if total > 0 else 0.0,
                    "calls": self.calls[c],
                }
                for c in CATEGORIES
            },
        }


_current: Timings | None = None


@contextlib.contextmanager
def collecting() -> Iterator[Timings]:
    """Install a collector for the block (one run of one kind); the one before it comes back
    after."""
    global _current
    before, _current = _current, Timings()
    try:
        yield _current
    finally:
        _current = before


@contextlib.contextmanager
def span(category: str) -> Iterator[None]:
    """Count the block's time under ``category`` (less the spans inside it)."""
    t = _current
    if t is None or threading.get_ident() != t.thread:
        yield
        return
    t.enter(category)
    try:
        yield
    finally:
        t.exit()


def table(report: dict) -> list[str]:
    """The printed table of :meth:`Timings.as_dict`'s report, one category a line."""
    lines = [
        f"  timings: {report['seconds']:.1f} s, {report['steps_per_s']:.1f} steps/s "
        "(seconds, share, spans)"
    ]
    rows = sorted(report["categories"].items(), key=lambda kv: -kv[1]["seconds"])
    for c, row in rows:
        calls = "" if c == "hypothesis" else f" {row['calls']:>8}"
        lines.append(
            f"    {CATEGORIES[c]:<38} {row['seconds']:>8.2f} s {row['share'] * 100:>5.1f} %{calls}"
        )
    return lines


def timed(category: str):
    """A decorator: every call of the function is a span of ``category``."""

    def wrap(fn):
        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            with span(category):
                return fn(*args, **kwargs)

        return timed_fn

    return wrap
