"""A kind's soak binding: what a soak of it runs, and how its judge reads its rows.

A soak (:mod:`knownstate.chaos.soak`) and its judge (:mod:`knownstate.chaos.judge`) are the same
for every kind; what differs is data and a few small functions: one :class:`SoakKind` subclass
per kind, in the kind's check module as ``SOAK`` (:mod:`knownstate.chaos.kinds`; the outbox's
in :mod:`knownstate.chaos.kinds.outbox` is the worked example). A described kind (a check built by
:func:`knownstate.chaos.generic.kind`) gets its binding from its description and its adapter
(:mod:`knownstate.chaos.soakgeneric`).

How the judge reads a kind: each committed row version as a run (:class:`~.judge.RunRow`: key,
status, fence token, lease) or as a step's receipt or effect (:class:`~.judge.StepRow`); a run as
the contract's :class:`~knownstate.model.contract.RunView`; which operations write as the run's
owner, take a run back, create one.
"""

from __future__ import annotations

import random
import threading
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any, Callable

import psycopg

from knownstate.impl import errors
from knownstate.model.contract import Contract, RunView, StepView
from knownstate.model.describe import RunKind

from .history import Audit
from .judge import Judging, Replay, RunRow, StepRow


def ts(value: Any) -> float | None:
    """A timestamp from a row (ISO text from to_jsonb, a datetime, or epoch seconds)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value)).timestamp()


def queue_view(contract: Contract):
    """A queued run's view: its status and fence token (the claimed attempt; without one,
    whether it is owned). Its single step is judged with its external effect (:mod:`.effects`)."""

    def view(row: RunRow, counts: Counter) -> RunView:
        token = row.token if isinstance(row.token, int) else int(row.status in contract.owned)
        return RunView(run_id=row.key, status=row.status, fence_token=token)

    return view


def steps_view(row: RunRow, counts: Counter) -> RunView:
    """A run of several steps' view: its status and fence token, each step's receipts, failed
    receipts and effects as its rows counted them, and the steps its payload has (the run row's
    ``extra["steps"]``)."""
    ids = sorted({step for step, _ in counts}, key=int)
    return RunView(
        run_id=row.key,
        status=row.status,
        fence_token=row.token,
        steps={
            s: StepView(
                receipts=counts[(s, "receipt")],
                effects=counts[(s, "effect")],
                failed=counts[(s, "failed")],
            )
            for s in ids
        },
        valid_step_ids=frozenset(str(i) for i in range(row.extra.get("steps", 0))),
    )


def next_step_refused(r: Replay) -> None:
    """A judge's extra for a run of several steps (:func:`steps_view`), a step being its
    position in the frozen payload: a write asked for the next step (its ``step_index``; as
    many receipts committed as its index, all by its own worker's earlier operations: only the
    run's holder writes them, one operation after another) is never refused."""
    receipts: dict[str, list] = defaultdict(list)
    for a in r.h.audit:
        read = r.k.row(a, False)
        if isinstance(read, StepRow) and read.what != "effect" and a.op == "INSERT":
            if a.ref in r.ops:
                receipts[read.run].append(r.ops[a.ref])
    for o in r.h.ops:
        asked = o.args.get("step_index")
        if o.out != "rejected" or type(asked) is not int:
            continue
        for run in o.runs:
            done = sum(1 for w in receipts.get(run, []) if w.inc == o.inc and w.t0 < o.t0)
            row = r.rows.get(run)
            if row is not None and asked == done < row.extra.get("steps", 0):
                r.finding(
                    "stable-step-identity",
                    f"{o.inc} {o.name}({run}, step {asked}) was refused ({o.value}), but "
                    f"step {asked} was the next of its payload ({done} receipt(s) before it)",
                    run,
                    t=o.t1 if o.t1 is not None else o.t0,
                    ref=o.ref,
                )


def receipts_in_order(r: Replay) -> None:
    """A judge's extra for a run of several steps (:func:`steps_view`): its receipts are a
    prefix of its payload; a run done has every one, each ok."""
    for run, row in r.rows.items():
        counts = r.steps[run]
        got = sorted(
            {int(s) for (s, what), n in counts.items() if n and what in ("receipt", "failed")}
        )
        if got != list(range(len(got))):
            r.finding(
                "stable-step-identity",
                f"run {run} has receipts for steps {got}: not a prefix of its payload",
                run,
            )
        ok = sum(1 for (s, what), n in counts.items() if n and what == "receipt")
        if row.status == r.k.done and (ok != row.extra.get("steps") or len(got) != ok):
            r.finding(
                "receipt-with-effect",
                f"run {run} is {row.status} with {ok} ok receipt(s) for "
                f"{row.extra.get('steps')} step(s)",
                run,
            )


# ---------------------------------------------------------------------------------------
# The binding.
# ---------------------------------------------------------------------------------------


class SoakKind:
    """A kind's soak binding. A subclass sets the class attributes and implements
    :meth:`judging`, :meth:`store`, :meth:`loop` and :meth:`produce`."""

    name: str = ""
    description: RunKind
    params: dict = {}
    """What its processes are configured with (leases and backoffs of a few seconds)."""
    stand_in: Callable[[], Any] | None = None
    """The external side (a recording stand-in of :mod:`.soakparts`), or None."""
    refusals: tuple[int, ...] = (503,)
    """The answers a stand-in refusal of the nemesis gives."""
    lease: float = 3.0
    """Seconds a stall must outlast."""
    nudge: float = 0.0
    """Database-clock seconds that let every lease lapse and every backoff come due (0: the
    lease is in application time; the quiet period waits for real time instead)."""
    writes_bound: int = 0
    """The most writes its loop makes under one lease before its last (0: no bound)."""
    run_tables: tuple[str, ...] = ()
    """The tables whose rows are the runs, keyed by ``id`` (what :meth:`current` reads)."""

    # -- the judge ------------------------------------------------------------------------------
    def judging(self, config: dict) -> Judging:
        raise NotImplementedError

    def _judging(self, contract: Contract, **kw) -> Judging:
        d = self.description
        return Judging(
            contract=contract, fence=d.fence.kind, app_clock_lease=d.app_clock_lease, **kw
        )

    def max_attempts(self) -> int | None:
        """The attempts a run is given in a soak (None: no limit the soak knows)."""
        return self.params.get("max_attempts")

    def claimed_again(self, row: RunRow) -> bool:
        """Whether the run of ``row``, taken back by the reaper, can be claimed again: not when
        the description's reaper ends a run whose attempts are spent (``reclaim_dead``) and the
        row's token is the attempt that spends them. A hold that waits for another owner aims
        only at runs that can have one (a held run the reaper ends instead leaves its stale
        owner's write nothing to land on)."""
        d, limit = self.description, self.max_attempts()
        counted = d.retry is not None and d.retry.counts == "claims"
        if not counted or d.retry.taken_back != "unchanged" or d.fence.kind != "attempt":
            return True
        spent = "reclaim_dead" in d.events() and limit is not None
        return not (spent and isinstance(row.token, int) and row.token >= limit)

    def claimable(self) -> frozenset[str]:
        """The statuses a claim takes a run from: a run in one was asked for."""
        owned = set(self.description.owned)
        return frozenset(s for s, _, t in self.description.transitions if t in owned) - owned

    def expected(self) -> tuple[str, ...]:
        """What a soak should see happen (printed when it did not; it does not fail)."""
        d, out = self.description, ["lost race or fence refusal"]
        if d.lease is not None:
            out.insert(0, "lapsed lease taken back")
        if d.external == "at-least-once":
            out.append("duplicate delivery")
        if d.external == "create-once-then-poll":
            out.append("create retried, one creation")
        return tuple(out)

    def versions(self, conn: psycopg.Connection, audits: list[Audit]) -> dict:
        """Each change's old and new row as the judge reads them: (audit id, "old" | "new") ->
        a RunRow or a StepRow."""
        row, out = self._reader(), {}
        for a in audits:
            for side, old in (("old", True), ("new", False)):
                read = row(a, old)
                if read is not None:
                    out[(a.id, side)] = read
        return out

    def current(self, conn: psycopg.Connection, keys=None) -> dict[str, RunRow]:
        """Every run as it is now (or those of ``keys``), as the judge reads it."""
        row, out = self._reader(), {}
        where = "TRUE" if keys is None else "t.id::text = ANY(%(keys)s)"
        for table in self.run_tables:
            query = f"SELECT to_jsonb(t) FROM {table} t WHERE {where}"
            for (raw,) in conn.execute(query, {"keys": list(keys or ())}).fetchall():
                read = row(Audit(0, table, "INSERT", None, None, raw, 0.0), False)
                if isinstance(read, RunRow):
                    out[read.key] = read
        return out

    def _reader(self):
        if "_row" not in self.__dict__:
            self._row = self.judging(self.params).row
        return self._row

    def prepare(self, env, ws) -> None:
        """Before the processes start (a described kind reads its adapter)."""

    def annotate(self, conn: psycopg.Connection, audits: list[Audit]) -> None:
        """Before judging: anything the judge reads of the changes from the database (a
        described kind: each row as its adapter reads it)."""

    def background(self, stand_in, seed: int):
        """What drives the external side while the soak runs (None: nothing), with ``start``,
        ``stop`` and ``hurry`` (finish what is pending at once, for the quiet period)."""
        return None

    # -- the processes (called in the worker process) -------------------------------------------
    def store(self, spec: dict, log, check: type) -> Any:
        raise NotImplementedError

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        raise NotImplementedError

    def produce(self, producer: "Producer") -> None:
        raise NotImplementedError


def recording(store_class: type, log):
    """``store_class`` with every operation logged (the soak worker's recording store)."""
    from .soakworker import recording

    return recording(store_class, log)


class Producer:
    """Creates work at ``params["rate"]`` per second (exponential gaps drawn from the seed),
    one :meth:`SoakKind.produce` at a time, through the recording store."""

    def __init__(self, kind: SoakKind, spec: dict, store, connect, stop: threading.Event):
        self.kind, self.spec, self.store, self.connect, self.stop = kind, spec, store, connect, stop
        self.rng = random.Random(f"{spec['seed']}:{spec['name']}:{spec['inc']}")
        self.p = spec["params"]
        self._conn: psycopg.Connection | None = None
        self.serial = 0
        self.state: dict[str, Any] = {}  # what a kind's producer keeps between two calls

    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            with errors.boundary("connect"):
                self._conn = self.connect()
        return self._conn

    def key(self) -> int:
        """A new run key, unique across incarnations."""
        self.serial += 1
        return self.spec["inc"] * 1_000_000 + self.serial

    def run(self) -> None:
        while not self.stop.wait(self.rng.expovariate(self.p["rate"])):
            try:
                self.kind.produce(self)
            except errors.KnownstateError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
        if self._conn is not None:
            self._conn.close()
