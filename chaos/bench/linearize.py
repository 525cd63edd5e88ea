"""The linearizability checker's figure: seconds to check a 1,000-operation history.

A random concurrent history of the outbox model, linearizable by construction, checked with
its final rows by :func:`knownstate.chaos.linearize.check` (not partitioned: a claim reads every
row). What the figure says is how long a long history takes to judge, with a structural copy of
the model or its own deepcopy ``copy()``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from ..linearize import FinalState, Operation, check


@dataclass
class BenchResult:
    operations: int
    clients: int
    seconds: float
    ok: bool | None
    partitions: int
    what: str

    def report(self) -> str:
        return (
            f"linearizability: {self.operations} operations, {self.clients} clients, "
            f"{self.partitions} part(s), {self.what}: {self.seconds:.2f} s "
            f"({({True: 'linearizable', False: 'NOT linearizable'}).get(self.ok, '?')})"
        )


def outbox_history(
    n_ops: int = 1000, clients: int = 3, seed: int = 0
) -> tuple[list[Operation], Any, FinalState]:
    """A random concurrent history of the outbox model (linearizable by construction: each
    operation takes effect at a random instant between its call and its return), with its
    initial model and final rows. Every operation kind of the outbox, reaper included."""
    from knownstate.model.contract import Won
    from knownstate.model.outbox import Config, OutboxModel

    rng = random.Random(seed)
    truth = OutboxModel(Config(lease=300))
    initial = truth.copy()
    held: dict[str, list] = {f"c{i}": [] for i in range(clients)}
    in_flight: dict[str, dict] = {}
    history: list[Operation] = []
    t = 0
    next_id = 1
    draining = False

    def pick(client: str) -> tuple[str, Callable[[Any], Any]]:
        nonlocal next_id
        mine = held[client]
        roll = rng.random()
        if roll < 0.25:
            i = next_id
            next_id += 1
            return f"enqueue({i})", lambda m: m.enqueue(i)
        if roll < 0.5 or not mine:
            b = rng.randint(1, 2)
            return f"claim({b})", lambda m: m.claim(b)
        if roll < 0.6:
            return "reclaim_stale()", lambda m: m.reclaim_stale()
        c = mine.pop(rng.randrange(len(mine)))
        kind = rng.choice(["complete", "fail", "extend"])
        if kind == "complete":
            return f"complete({c.id}, {c.attempt})", lambda m: m.complete(c)
        if kind == "fail":
            return f"fail({c.id}, {c.attempt})", lambda m: m.fail(c, False)
        mine.append(c)
        return f"extend_lease({c.id}, {c.attempt})", lambda m: m.extend_lease(c)

    while len(history) < n_ops or in_flight:  # clock ticks count as operations
        t += 1
        draining = draining or rng.random() < 0.02
        if draining and not in_flight:
            draining = False
            # Time passes, at rest as a check's clock jump does: leases lapse, backoffs end.
            # (A jump overlapping operations that stamp leases leaves orders the outcomes do not
            # tell apart until the final rows: checking those per block keeps that small.)
            truth.advance(60)
            history.append(Operation("clock", "advance(60)", lambda m: m.advance(60), t, t, None))
            continue
        client = f"c{rng.randrange(clients)}"
        f = in_flight.get(client)
        if f is None:
            if draining or len(history) + len(in_flight) >= n_ops:
                continue
            label, apply = pick(client)
            in_flight[client] = {"label": label, "apply": apply, "call": t, "done": False}
        elif not f["done"]:
            out = f["apply"](truth)
            f.update(done=True, out=out)
            if f["label"].startswith("claim") and isinstance(out, Won):
                held[client].extend(out.value)
        else:
            del in_flight[client]
            history.append(Operation(client, f["label"], f["apply"], f["call"], t, f["out"]))
    final = FinalState(truth.state(), lambda m: m.state())
    return history, initial, final


def _outbox_copy(model: Any) -> Any:
    """A structural copy of an OutboxModel (its rows are frozen values): what its deepcopy-
    based ``copy()`` costs is most of the check's time on a long history."""
    other = object.__new__(type(model))
    other.__dict__.update(model.__dict__)
    other.deliveries, other.received = dict(model.deliveries), dict(model.received)
    other.transitions = []
    return other


def bench(
    n_ops: int = 1000, clients: int = 3, seed: int = 0, model_copy: bool = False
) -> BenchResult:
    """Seconds to check a random ``n_ops``-operation outbox history (not partitioned: a claim
    reads every row), final rows included. ``model_copy``: copy states with the model's own
    ``copy()`` (a deepcopy) instead of a structural copy. For ``knownstate bench``."""
    history, initial, final = outbox_history(n_ops, clients, seed)
    verdict = check(
        history,
        initial,
        final=final,
        copy=(lambda m: m.copy()) if model_copy else _outbox_copy,
        fingerprint=lambda m: (m.now, m.state(), m._next_id),
    )
    what = "outbox model, final rows, " + (
        "its deepcopy copy()" if model_copy else "structural copy"
    )
    return BenchResult(len(history), clients, verdict.seconds, verdict.ok, verdict.partitions, what)
