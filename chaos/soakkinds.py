"""Each kind's soak binding: what a soak of it runs, and how its judge reads its rows.

A soak (:mod:`knownstate.chaos.soak`) and its judge (:mod:`knownstate.chaos.judge`) are the same
for every kind; what differs is data and a few small functions, and they live here, one
:class:`SoakKind` per kind, found through the kind's registry entry
(:mod:`knownstate.chaos.kinds`). A described kind (a check built by
:func:`knownstate.chaos.generic.kind`) gets its binding from its description and its adapter
(:mod:`knownstate.chaos.soakgeneric`).

How the judge reads a kind: each committed row version as a run (:class:`~.judge.RunRow`: key,
status, fence token, lease) or as a step's receipt or effect (:class:`~.judge.StepRow`); a run as
the contract's :class:`~knownstate.model.contract.RunView`; which operations write as the run's
owner, take a run back, create one.
"""

from __future__ import annotations

import http.client
import random
import threading
from collections import Counter, defaultdict
from datetime import datetime
from functools import partial
from typing import Any, Callable

import psycopg

from knownstate.impl import errors
from knownstate.model.contract import Contract, RunView, StepView, Won
from knownstate.model.describe import RunKind

from . import effects
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


def _contract(name: str) -> Contract:
    from . import kinds

    return kinds.check(name).contract


def _built_in(name: str) -> RunKind:
    from . import kinds

    return next(d for d in kinds.described() if d.name == name)


def _recording(store_class: type, log):
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


# ---------------------------------------------------------------------------------------
# The outbox.
# ---------------------------------------------------------------------------------------


class OutboxSoak(SoakKind):
    name = "outbox"
    params = {
        "lease": 3,
        "backoff_base": 1,
        "backoff_cap": 4,
        "max_attempts": 4,
        "batch": 10,
        "idle": 0.05,
        "http_timeout": 2.0,
        "reap_every": 0.5,
        "rate": 25.0,
    }
    refusals = (503, 503, 422)
    lease = 3.0
    nudge = 3 + 4 + 1
    writes_bound = 1
    run_tables = ("outbox_delivery",)

    def __init__(self) -> None:
        from .soakparts import RecordingSink

        self.description = _built_in(self.name)
        self.stand_in = RecordingSink

    def judging(self, config: dict) -> Judging:
        contract = _contract(self.name)

        def row(a: Audit, old: bool) -> RunRow | None:
            r = a.old if old else a.new
            if a.table != "outbox_delivery" or r is None:
                return None
            return RunRow(str(r["id"]), r["status"], r["attempts"], ts(r.get("lease_until")))

        return self._judging(
            contract,
            row=row,
            view=queue_view(contract),
            owner_writes=frozenset({"complete", "fail", "record_batch", "extend_lease"}),
            heartbeats=frozenset({"extend_lease"}),
            take_backs=frozenset({"reclaim_stale"}),
            creations=frozenset({"enqueue"}),
            done="sent",
            extras=(effects.at_least_once,),
        )

    def store(self, spec: dict, log, check: type):
        from knownstate.model.outbox import Config

        p = spec["params"]
        config = Config(p["lease"], p["backoff_base"], p["backoff_cap"], p["max_attempts"])
        return _recording(check.store_class, log)(config, getattr(check, "queries", None))

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        """The reaper, or the outbox's reference loop unchanged, with a send that logs."""
        from knownstate.impl import loops, outbox

        p = spec["params"]
        if spec["role"] == "reaper":
            return loops.Periodic(
                connect, store.reclaim_stale, stop, idle=p["reap_every"], autocommit=True
            )
        send = partial(_logged_send, spec, log)
        return outbox.OutboxWorker(connect, store, send, stop, batch=p["batch"], idle=p["idle"])

    def produce(self, producer: Producer) -> None:
        state = producer.state
        delivery = state.pop("again", None) or producer.key()
        try:
            producer.store.enqueue(producer.conn(), delivery, {"to": f"user{delivery}"})
        except (errors.CommitIndeterminate, errors.ConnectionLost):
            state["again"] = delivery  # enqueue it again: a duplicate id is refused, never doubled
            raise
        except errors.TransactionAborted:
            pass  # the earlier, indeterminate enqueue of this id had landed


def _logged_send(spec: dict, log, claim, payload) -> str:
    """The soak's send: ``send_to_sink``, logged. It lets a reply cut mid-body escape as
    ``http.client``'s own error; here that is ExternalCallFailed, like every other lost reply."""
    from knownstate.impl.outbox import send_to_sink

    serial = log.begin("send", {str(claim.id): claim.attempt}, {})
    log.current = log.ref(serial)
    try:
        result = send_to_sink(spec["url"], claim, payload, timeout=spec["params"]["http_timeout"])
    except (errors.ExternalCallFailed, http.client.HTTPException) as e:
        log.end(serial, "ext-failed", detail=str(e)[:200])
        raise errors.ExternalCallFailed(f"sink: {e}") from None
    finally:
        log.current = None
    log.end(serial, result)
    return result


# ---------------------------------------------------------------------------------------
# The approved plan.
# ---------------------------------------------------------------------------------------

PLAN_STEPS = (
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "credit", "account": "b", "amount": 3},
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "debit", "account": "a", "amount": 4},
    {"op": "debit", "account": "b", "amount": 9},
    {"op": "fail"},
)
PLAN_WEIGHTS = (6, 6, 6, 3, 1, 1)


class PlanSoak(SoakKind):
    name = "approved-plan"
    params = {"heartbeat_s": 3, "pace": 0.08, "idle": 0.1, "read_every": 0.3, "rate": 4.0}
    lease = 3.0
    nudge = 3 + 1
    run_tables = ("agent_proposal",)

    def __init__(self) -> None:
        self.description = _built_in(self.name)

    def judging(self, config: dict) -> Judging:
        contract, heartbeat_s = _contract(self.name), config["heartbeat_s"]

        def row(a: Audit, old: bool) -> RunRow | StepRow | None:
            r = a.old if old else a.new
            if r is None:
                return None
            if a.table == "agent_proposal":
                beat = ts(r.get("heartbeat_at"))
                lease = None if beat is None else beat + heartbeat_s
                steps = {"steps": len(r.get("steps") or ())}
                return RunRow(str(r["id"]), r["status"], r["generation"], lease, steps)
            if a.table == "agent_proposal_step":
                what = "receipt" if r["ok"] else "failed"
                return StepRow(str(r["proposal_id"]), str(r["step_index"]), what)
            if a.table == "demo_ledger":
                return StepRow(str(r["proposal_id"]), str(r["step_index"]), "effect")
            return None

        def view(row: RunRow, counts: Counter) -> RunView:
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

        return self._judging(
            contract,
            row=row,
            view=view,
            owner_writes=frozenset({"run_step", "heartbeat"}),
            heartbeats=frozenset({"heartbeat"}),
            take_backs=frozenset({"read", "repeat", "compensate"}),
            creations=frozenset({"propose"}),
            done="executed",
            token_noun="token",
            extras=(_next_step_refused, _receipts_in_order),
        )

    def store(self, spec: dict, log, check: type):
        cls = _recording(check.store_class, log)
        return cls(spec["params"]["heartbeat_s"], getattr(check, "queries", None))

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        from knownstate.impl import approved_plan

        p = spec["params"]
        if spec["role"] == "reaper":
            return approved_plan.PlanReader(connect, store, stop, idle=p["read_every"])
        return approved_plan.PlanExecutor(connect, store, stop, idle=p["idle"], pace=p["pace"])

    def produce(self, producer: Producer) -> None:
        rng, store, pending = producer.rng, producer.store, producer.state.setdefault("left", [])
        roll = rng.random()
        if pending and roll < 0.05:
            store.expire(producer.conn(), pending.pop(0))
            return
        steps = rng.choices(PLAN_STEPS, PLAN_WEIGHTS, k=rng.randint(2, 5))
        out = store.propose(producer.conn(), steps)
        if not isinstance(out, Won):
            return
        if roll < 0.10:
            pending.append(out.value)  # left pending, to expire later
        elif roll < 0.15:
            store.reject(producer.conn(), out.value)
        else:
            store.approve(producer.conn(), out.value)


def _next_step_refused(r: Replay) -> None:
    """A step is its position in the frozen payload: a run_step asked for the next step (as
    many receipts committed as its index, all by its own executor's earlier operations: only
    the holder of the run's token writes them, one operation after another) is never refused."""
    receipts: dict[str, list] = defaultdict(list)
    for a in r.h.audit:
        if a.table == "agent_proposal_step" and a.op == "INSERT" and a.ref in r.ops:
            receipts[str(a.row["proposal_id"])].append(r.ops[a.ref])
    for o in r.h.ops:
        asked = o.args.get("step_index")
        if o.name != "run_step" or o.out != "rejected" or type(asked) is not int:
            continue
        for run in o.runs:
            done = sum(1 for w in receipts.get(run, []) if w.inc == o.inc and w.t0 < o.t0)
            row = r.rows.get(run)
            if row is not None and asked == done < row.extra.get("steps", 0):
                r.finding(
                    "stable-step-identity",
                    f"{o.inc} run_step({run}, step {asked}) was refused ({o.value}), but "
                    f"step {asked} was the next of its payload ({done} receipt(s) before it)",
                    run,
                    t=o.t1 if o.t1 is not None else o.t0,
                    ref=o.ref,
                )


def _receipts_in_order(r: Replay) -> None:
    """Receipts are a prefix of the payload; an executed plan has every one, each ok."""
    for run, row in r.rows.items():
        counts = r.steps[run]
        got = sorted(
            {int(s) for (s, what), n in counts.items() if n and what in ("receipt", "failed")}
        )
        if got != list(range(len(got))):
            r.finding(
                "stable-step-identity",
                f"plan {run} has receipts for steps {got}: not a prefix of its payload",
                run,
            )
        ok = sum(1 for (s, what), n in counts.items() if n and what == "receipt")
        if row.status == r.k.done and (ok != row.extra.get("steps") or len(got) != ok):
            r.finding(
                "receipt-with-effect",
                f"plan {run} is {row.status} with {ok} ok receipt(s) for "
                f"{row.extra.get('steps')} step(s)",
                run,
            )


# ---------------------------------------------------------------------------------------
# The branch reset.
# ---------------------------------------------------------------------------------------


class ResetSoak(SoakKind):
    name = "branch-reset"
    params = {
        "lease": 4,
        "http_timeout": 1.0,
        "poll_every": 0.3,
        "reap_every": 0.5,
        "rate": 2.0,
        "branches": 6,
    }
    lease = 4.0
    run_tables = ("branch_reset",)

    def __init__(self) -> None:
        from .soakparts import RecordingOpsApi

        self.description = _built_in(self.name)
        self.stand_in = RecordingOpsApi

    def judging(self, config: dict) -> Judging:
        contract = _contract(self.name)

        def row(a: Audit, old: bool) -> RunRow | None:
            r = a.old if old else a.new
            if a.table != "branch_reset" or r is None:
                return None
            extra = {"op_id": r.get("external_op_id")}
            lease = ts(r.get("lease_until"))
            return RunRow(str(r["id"]), r["status"], r.get("claimed_by"), lease, extra)

        return self._judging(
            contract,
            row=row,
            view=queue_view(contract),
            owner_writes=frozenset({"poll"}),
            take_backs=frozenset({"reap"}),
            creations=frozenset({"request"}),
            done="succeeded",
            token_noun="owner",
            extras=(effects.create_once,),
        )

    def background(self, stand_in, seed: int):
        """The operations API finishes what was created, after a delay drawn from the seed."""
        from .soakparts import Finisher

        return Finisher(stand_in, seed)

    def store(self, spec: dict, log, check: type):
        p = spec["params"]
        return _recording(check.store_class, log)(
            spec["name"],
            spec.get("url") or "",
            log.app_clock,
            lease_seconds=p["lease"],
            http_timeout=p["http_timeout"],
            queries=getattr(check, "queries", None),
        )

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        from knownstate.impl import branch_reset, loops

        p = spec["params"]
        if spec["role"] == "reaper":
            return loops.Periodic(connect, store.reap, stop, idle=p["reap_every"])
        return branch_reset.ResetPoller(connect, store, stop, idle=p["poll_every"])

    def produce(self, producer: Producer) -> None:
        rng, store, last = producer.rng, producer.store, producer.state.setdefault("last", {})
        branch = f"b{rng.randrange(producer.p['branches'])}"
        roll = rng.random()
        if branch in last and roll < 0.05:
            store.cancel(producer.conn(), last[branch][1])
            return
        if branch in last and roll < 0.15:
            key = last[branch][0]  # the same request again: answered with the same run
        else:
            producer.serial += 1
            key = f"{branch}:{producer.spec['name']}.{producer.spec['inc']}:{producer.serial}"
        out = store.request(producer.conn(), branch, key)
        if isinstance(out, Won):
            last[branch] = (key, out.value)
