"""The branch reset's model-versus-implementation check.

Who acts. Two *pollers* (``w0``, ``w1``) run the worker loop: ``start`` a queued run (claim it
and create its external operation, once) and ``poll`` running ones. The *reaper* (``w2``) is the
dbops-reaper job, a process of its own with its own application clock: it only runs ``reap``.
Anyone may ``request`` a reset (with an idempotency key: a new one, the branch's last one again,
or a key another branch already used) and ``cancel`` one. The check itself decides when an
external operation succeeds or fails at the operations API, and when time passes.

Faults are rules too: the base's (:mod:`knownstate.chaos.faults`), paced by this kind's
:class:`FaultPolicy` — a toxic or a cut on any one link (every process has its own link to
PostgreSQL, and each poller its own link to the operations-API stand-in), a fault at a poller's
COMMIT in its very next turn (it dies just before; the reply or the request is lost; the
database server crashes with the transaction open), the stand-in losing its answer, a poller
stalling past the lease, a database clock jump that must move nothing — and two of this kind's
own: the stand-in answering 503, and an **application clock skew** of one process.

The stand-in is part of the observation: the model predicts its operations and the create
requests it acted on per run, so a second creation is seen at once, and the create-once
invariant (``external_creations <= 1``) is checked after every step.

Clocks, and the skew bound every live run a reap ends or a poll refuses is judged against, are
:mod:`.branch_reset_clocks`.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from knownstate.impl import branch_reset as impl
from knownstate.impl import loops
from knownstate.model import branch_reset as model
from knownstate.model.branch_reset import ExternalOp, ExternalState, ExternalStatus, Status
from knownstate.model.contract import LostRace, Rejected, Repeat, Won, Write

from .. import effects, rows
from ..blocks import against, raced
from ..check import QUANTUM, FaultPolicy, KindCheck, Action, needs
from ..interleave import ScheduledCalls
from ..history import Audit
from ..judge import Judging, RunRow
from ..opsapi import OpsApi
from ..soakkinds import Producer, SoakKind, queue_view, recording, ts
from .branch_reset_clocks import LEASE, MARGIN, POLLERS, REAPER, SKEW_BOUND, SKEWS, Clocks

BRANCHES = ("a", "b")
TERMINAL = model.TERMINAL


class BranchResetCheck(Clocks, KindCheck):
    kind = "branch-reset"
    contract = model.CONTRACT
    schema = impl.SCHEMA
    n_workers = 3  # w0, w1: pollers; w2: the reaper job
    policy = FaultPolicy(
        gap=2,
        heal_after=6,
        crash_between_steps=False,
        db_clock_moves_model=False,
        commit_faults=("commit-reply-lost", "commit-request-lost", "worker-death", "db-crash"),
        stall=LEASE + QUANTUM,
        stall_clock="app",
        reply_lost=True,
    )
    own_invariants = {"skew-bound": SKEW_BOUND}
    lease = LEASE
    margin = MARGIN
    store_class = impl.BranchResetStore
    queries: dict[str, str] | None = None  # the mutant catalogue replaces some
    http_timeout = 1.0
    required_events = (
        "lost race",
        "fence refusal",
        "poll of an operation in flight",
        "reap",
        "idempotent repeat answered",
        "skew within bound",
        "skew past bound (known deviation)",
        "worker died before commit",
        "indeterminate commit",
        "indeterminate resolved: committed",
        "indeterminate resolved: not committed",
        "connection lost",
        "external call failed",
        "create retried, one creation",
        "lease refusal",
        "one in flight refused",
        "key reused refused",
        "reaped live run under skew past bound (known deviation)",
        "live run spared by a reaper ahead within bound",
        needs("concurrent block", "concurrency"),
        needs("lock wait in a block", "concurrency"),
        # every pair of operations that can touch one row (a key, a run), raced on one
        *raced(
            ("request", "request"),
            ("start", "start"),
            ("poll", "poll"),
            ("cancel", "cancel"),
            ("cancel", "poll"),
            ("cancel", "reap"),
            ("poll", "reap"),
        ),
    )

    # -- hooks ----------------------------------------------------------------------------
    def reset_example(self) -> None:
        self.ops = self.env.stand_in("branch-reset-ops", OpsApi)
        self.ops.reset()
        self.stores = []
        for w in self.workers:
            url = ""
            if w.index in POLLERS:
                w.ops_link = self.env.api.link(
                    f"branch-reset-{w.name}-ops", self.ops.host, self.ops.port
                )
                w.links = [w.link, w.ops_link]
                url = f"http://{w.ops_link.host}:{w.ops_link.port}"
            store = self.store_class(
                w.name,
                url,
                self._app_clock(w.name),
                lease_seconds=self.lease,
                http_timeout=self.http_timeout,
                queries=self.queries,
            )
            # in a concurrent block each call to the API is a step of the schedule
            store.api = ScheduledCalls(store.api, lambda w=w: w.conn, "operations API")
            self.stores.append(store)
        self.last_key: dict[str, str] = {}
        self.key_serial = itertools.count(1)
        # run -> (lease_until, stamped at, stamper's skew)
        self.stamps: dict[str, tuple[int, int, int]] = {}
        self.retried_creates: set[str] = set()
        self.skews = 0
        self.race_keys = 1  # the key every poller's request would use in a concurrent block

    def new_model(self) -> model.BranchResetModel:
        return model.BranchResetModel(self.lease)

    @staticmethod
    def _external(state: ExternalState) -> tuple:
        # The key an implementation sends is its own business; the contract is what the API did:
        # which operations exist (for which run, in which status) and the create requests it
        # acted on.
        ops = tuple(
            sorted((op.op_id, op.run_id, op.branch, op.status.value) for op in state.ops.values())
        )
        return ops, tuple(sorted(state.create_requests.items()))

    def observe_model(self, m: model.BranchResetModel):
        return tuple(sorted(m.rows().items())), self._external(m.external_state())

    def observe_impl(self):
        rows = impl.project(self.ws.admin(), self._app_seconds)
        return tuple(sorted(rows.items())), self._external(self.ops.snapshot())

    def views(self, observation):
        rows, (ops, requests) = observation
        ext = ExternalState(
            ops={
                i: ExternalOp(i, run, branch, "", ExternalStatus(status))
                for i, run, branch, status in ops
            },
            create_requests=dict(requests),
        )
        return model.views(dict(rows), ext)

    def observed(self, m: model.BranchResetModel) -> None:
        for run_id, n in m.create_requests.items():
            if n > 1 and run_id not in self.retried_creates:
                self.retried_creates.add(run_id)
                self.event("create retried, one creation")
        for run_id, r in m.runs.items():
            if r.status is Status.RUNNING and self.stamps.get(run_id, (None,))[0] != r.lease_until:
                self.stamps[run_id] = (r.lease_until, m.now, r.lease_until - self.lease - m.now)

    def clock_matters(self) -> bool:
        """Time passing matters while a lease is held (a running run)."""
        return bool(self._runs(Status.RUNNING))

    # -- helpers ----------------------------------------------------------------------------
    def _runs(self, *statuses: Status) -> list[str]:
        return sorted(
            r for r, run in self.model.runs.items() if not statuses or run.status in statuses
        )

    def _record(self, writes=(), repeats=()) -> None:
        """Record a step's guarded writes and repeat requests: the invariants judge them."""
        self.writes.extend(writes)
        self.repeats.extend(repeats)

    # -- operations -------------------------------------------------------------------------
    @initialize(skew=st.sampled_from((0,) + tuple(s for s in SKEWS if s)))
    def seed_work(self, skew: int) -> None:
        """Every example starts with a reset requested on each branch, so work flows from the first
        step, and often with the reaper's clock already skewed (either side of the bound). (One
        rule is one step for the invariants: a run takes at most one transition in it.)"""
        if skew:
            self.fault_app_clock_skew(REAPER, skew)
        self.request(0, "a", "new")
        self.request(1, "b", "new")

    @rule()
    def idle(self) -> None:
        """A moment in which nobody acts. Hypothesis orders rules by their number of arguments,
        then by name, and shrinking moves each step towards the first valid rule: with this one
        there, a step the shrinker cannot delete becomes a silent no-op instead of an unrelated
        fault in the counterexample."""

    @precondition(lambda self: len(self.model.runs) < 8)
    @rule(
        w=st.sampled_from(POLLERS),
        branch=st.sampled_from(BRANCHES),
        key=st.sampled_from(["new", "repeat", "new", "other branch's"]),
    )
    def request(self, w: int, branch: str, key: str) -> None:
        """A reset requested with an idempotency key: a new key, the branch's last key again (a
        client retry), or the last key of the other branch (a client bug the API refuses)."""
        other = BRANCHES[1 - BRANCHES.index(branch)]
        k = {"repeat": self.last_key.get(branch), "other branch's": self.last_key.get(other)}.get(
            key
        )
        if k is None:
            k = f"{branch}-k{next(self.key_serial)}"
            self.last_key[branch] = k
        self.do(w, self._request(w, branch, k))

    # -- the operations, each written once: the rules and the blocks draw from these ------------
    def _judged(self, w: int, name: str, run_id: str, model_op, write: bool = True) -> tuple:
        """A guarded write on run ``run_id``: the model's and the store's operation, the store's
        recording its Write (``write``: a write on a run past queued) and Repeat (on a terminal
        run) for the invariants. In a block the linearization judges instead (the model has not
        run)."""
        run = self.model.runs[run_id]
        expected: dict[str, Any] = {}

        def judged_model_op(m):
            expected["out"] = out = model_op(m)
            return out

        def impl(conn):
            got = getattr(self.stores[w], name)(conn, run_id)
            if "out" in expected:
                token = model.GENERATION[run.status] if name == "start" else 1
                writes = (
                    []
                    if not write or (run.status is Status.QUEUED and name != "start")
                    else [
                        Write(run_id, token, isinstance(got, Won), isinstance(expected["out"], Won))
                    ]
                )
                repeats = [Repeat(run_id, isinstance(got, Won))] if run.status in TERMINAL else []
                self._record(writes, repeats)
            return got

        return judged_model_op, impl

    def _request(self, w: int, branch: str, k: str) -> Action:
        """A reset requested under idempotency key ``k``."""
        existing = next((r for r in self.model.runs.values() if r.idempotency_key == k), None)

        def impl_op(conn):
            got = self.stores[w].request(conn, branch, k)
            if existing is not None and existing.status in TERMINAL and existing.branch == branch:
                self._record(
                    repeats=[Repeat(existing.run_id, reexecuted=got != Won(existing.run_id))]
                )
            return got

        def after(got) -> None:
            if existing is not None and got == Won(existing.run_id):
                self.event("idempotent repeat answered")
                if existing.status in TERMINAL:
                    self.event("idempotent repeat answered from a terminal run")
            elif got == Rejected(model.IN_FLIGHT_REASON):
                self.event("one in flight refused")
            elif got == Rejected(model.KEY_REUSED):
                self.event("key reused refused")

        return Action(
            "request",
            f"request({branch}, key={k})",
            lambda m: m.request(branch, k),
            impl_op,
            after=after,
            guarantee="claim",
            runs=frozenset({("key", k)}),
        )

    def _start(self, w: int, run_id: str) -> Action:
        """A poller takes a run: claims it and creates its external operation, once. Whatever
        failed, the API may have acted on the create before it (the POST precedes COMMIT)."""
        run, name = self.model.runs[run_id], self.workers[w].name
        model_op, impl_op = self._judged(w, "start", run_id, lambda m: m.start(run_id, name))
        return Action(
            "start",
            f"start({run_id})",
            model_op,
            impl_op,
            calls_out=True,
            external_maybe=lambda m: m.external_create(run_id, run.branch),
            runs=frozenset({run_id}),
        )

    def _poll(self, w: int, run_id: str) -> Action:
        """A poller polls a run's operation: records what it saw, ends the run or extends the
        lease."""
        run, name = self.model.runs[run_id], self.workers[w].name
        live = self._live(run_id)
        model_op, impl_op = self._judged(w, "poll", run_id, lambda m: m.poll(run_id, name), False)

        def after(got) -> None:
            if got == Won(Status.RUNNING.value):
                self.event("poll of an operation in flight")
            elif isinstance(got, Won):
                self.event("poll saw the operation end")
            elif got == LostRace(model.LEASE_LAPSED):
                self.event("lease refusal")
                lives = self._live_met(name, run_id, live)
                if None not in lives:
                    self._judge_skew(run_id, name, lives, "poll refused")
                    self.event("poll refused live run under skew past bound (known deviation)")
            elif isinstance(got, LostRace) and run.status in TERMINAL:
                self.event("fence refusal")

        return Action(
            "poll",
            f"poll({run_id})",
            model_op,
            impl_op,
            after=after,
            calls_out=True,
            guarantee="lease-fence",
            fence=lambda: (run_id, 1, isinstance(self.model.copy().poll(run_id, name), Won)),
            runs=frozenset({run_id}),
        )

    def _cancel(self, w: int, run_id: str) -> Action:
        """Someone cancels a run (through a poller's connection). The operation is left alone."""
        run = self.model.runs[run_id]
        model_op, impl_op = self._judged(w, "cancel", run_id, lambda m: m.cancel(run_id))

        def after(got) -> None:
            if isinstance(got, LostRace) and run.status in TERMINAL:
                self.event("fence refusal")

        return Action(
            "cancel",
            f"cancel({run_id})",
            model_op,
            impl_op,
            after=after,
            guarantee="conditional-transition",
            runs=frozenset({run_id}),
        )

    def _reap(self) -> Action:
        """The dbops-reaper job: its application clock judges every running run's lease. Every
        live run it ends or spares is judged against the skew bound."""
        name = self.workers[REAPER].name
        live = {r: lv for r in self._runs(Status.RUNNING) if (lv := self._live(r)) is not None}

        def after(got) -> None:
            if not isinstance(got, Won):
                return
            self.event("reap", len(got.value))
            for run_id in got.value:
                lives = self._live_met(name, run_id, live.get(run_id))
                if None not in lives:
                    self._judge_skew(run_id, name, lives, "reaped")
                    self.event("reaped live run under skew past bound (known deviation)")
            for run_id, lv in sorted(live.items()):
                if run_id not in got.value and self._skew(name) > lv[1]:
                    self.event("live run spared by a reaper ahead within bound")

        return Action(
            "reap",
            "reap()",
            lambda m: m.reap(name),
            lambda c: self.stores[REAPER].reap(c),
            after=after,
            guarantee="lease",
            runs=frozenset(self._runs(Status.RUNNING)),
        )

    def _past_queued(self, running: int = 1) -> list[str]:
        """What a poll or a cancel acts on: running runs (``running`` times as often), then terminal
        ones (fence refusals), then queued ones (the guard on running refuses them too)."""
        if not self._runs(Status.RUNNING, *TERMINAL):
            return []
        return (
            self._runs(Status.RUNNING) * running + self._runs(*TERMINAL) + self._runs(Status.QUEUED)
        )

    def _ended(self) -> list[str]:
        """Running runs whose operation ended at the API: polling one is the poll that makes
        progress."""
        m = self.model
        return [
            r
            for r in self._runs(Status.RUNNING)
            if m.ops[m.runs[r].external_op_id].status is not ExternalStatus.IN_PROGRESS
        ]

    def _next_work(self) -> list[tuple[str, str]]:
        """A worker loop's next turn: start a queued run, or poll a running one."""
        return (
            [("start", r) for r in self._runs(Status.QUEUED)]
            + [("poll", r) for r in self._runs(Status.RUNNING)]
            + [("poll", r) for r in self._ended()] * 2
        )

    @precondition(lambda self: self._next_work())
    @rule(w=st.sampled_from(POLLERS), data=st.data())
    def worker_loop(self, w: int, data) -> None:
        """One turn of a poller's loop: start a queued run or poll a running one. (The start and
        poll rules act on any run, lost races included; this rule keeps work flowing.)"""
        op, run_id = rows.row(data, self._next_work(), "work")
        self.do(w, (self._start if op == "start" else self._poll)(w, run_id))

    @precondition(lambda self: self.model.runs)
    @rule(w=st.sampled_from(POLLERS), data=st.data(), against=against("start"))
    def start(self, w: int, data, against: str | None) -> None:
        """A poller takes a run: claims it and creates its external operation, once. Maybe raced
        at once against another poller taking it (:meth:`race_on`)."""
        run_id = rows.row(data, self._runs(Status.QUEUED) * 3 + self._runs(), "run")
        if self.race_on(data, run_id, "start", against):
            return
        self.do(w, self._start(w, run_id))

    @precondition(lambda self: self._past_queued())
    @rule(w=st.sampled_from(POLLERS), data=st.data(), against=against("poll", "reap"))
    def poll(self, w: int, data, against: str | None) -> None:
        """A poller polls a run's operation: records what it saw, ends the run or extends the
        lease. Maybe raced at once against another poller's poll or the reaper: these pairs
        (and start's, raced by :meth:`start`), met otherwise only by blocks aimed at pairs at
        random, were among the requirements a run met last at 5 of seeds 1-6."""
        runs = self._ended() * 4 + self._past_queued(running=4)
        run_id = rows.row(data, runs, "run")
        if self.race_on(data, run_id, "poll", against):
            return
        self.do(w, self._poll(w, run_id))

    @precondition(lambda self: self._past_queued())
    @rule(w=st.sampled_from(POLLERS), data=st.data(), against=against("reap", "poll", "cancel"))
    def cancel(self, w: int, data, against: str | None) -> None:
        """Someone cancels a run (through a poller's connection). The operation is left alone.
        A running run's cancel is maybe raced at once (:meth:`race_on`) against the reaper, a
        poll or another cancel: those races decided how many examples a run needed (171, 415
        and 329 at seeds 1 to 3), since a cancel is what ends the state they need."""
        run_id = rows.row(data, self._past_queued(), "run")
        if self.race_on(data, run_id, "cancel", against):
            return
        self.do(w, self._cancel(w, run_id))

    @precondition(lambda self: self._runs(Status.RUNNING))
    @rule()
    def reap(self) -> None:
        """The dbops-reaper job: its application clock judges every running run's lease. Every
        live run it ends or spares is judged against the skew bound."""
        self.do(REAPER, self._reap())

    def _in_progress(self) -> list[str]:
        ops = self.model.ops
        running = {r.external_op_id for r in self.model.runs.values() if r.status is Status.RUNNING}
        live = sorted(i for i, op in ops.items() if op.status is ExternalStatus.IN_PROGRESS)
        return [i for i in live if i in running] * 4 + live

    @precondition(lambda self: self._in_progress())
    @rule(data=st.data())
    def operation_succeeds(self, data) -> None:
        """The check decides: an external operation succeeds at the API."""
        self._finish(data, ok=True)

    @precondition(lambda self: self._in_progress())
    @rule(data=st.data())
    def operation_fails(self, data) -> None:
        """The check decides: an external operation fails at the API."""
        self._finish(data, ok=False)

    def _finish(self, data, ok: bool) -> None:
        op_id = rows.row(data, self._in_progress(), "operation")
        for c in self.candidates:
            c.model.external_finish(op_id, ok)
        self.ops.finish(op_id, ok)
        self.log(f"operation {op_id} {'succeeds' if ok else 'fails'} at the API")

    @precondition(lambda self: self.clock_matters())
    @rule(seconds=st.sampled_from([QUANTUM, 2 * QUANTUM]))
    def time_passes(self, seconds: int) -> None:
        """Real time passes, within the lease: every application clock moves."""
        self.advance(seconds)
        self.log(f"time passes {seconds}s")

    # -- the fault policy's questions, and this kind's own faults --------------------------------
    def turns(self, w: int) -> list[tuple[str, str]]:
        """A poller's next turn: start a queued run, or poll a running one (the reaper has none)."""
        return self._next_work() if w in POLLERS else []

    def turn(self, w: int, data, due: frozenset = frozenset()) -> None:
        work = self.turns(w)
        starts = [x for x in work if x[0] == "start"]  # a start's outcome is always observable
        op, run_id = rows.row(data, starts or work, "work")
        self.do(w, (self._start if op == "start" else self._poll)(w, run_id))

    def leases(self) -> list[int]:
        """Any poller may poll any running run: each of them can stall past its lease."""
        return list(POLLERS) if self._runs(Status.RUNNING) else []

    # -- concurrent blocks ---------------------------------------------------------------------
    def offers(self, w: int) -> list[Action]:
        """What a process can start together with the others: a poller requests a reset (with a
        key every poller would use now: two requests with one key at once), starts a queued run
        (its call to the operations API a step of the schedule), polls or cancels a running run;
        the reaper reaps."""
        running = self._runs(Status.RUNNING)
        if w == REAPER:
            return [self._reap()] if running else []
        key = f"k{self.race_keys}"
        # two requests with one new key race only where both may create a run: on branches with
        # nothing in flight (a branch never reset before when the usual two are busy)
        busy = {r.branch for r in self.model.runs.values() if r.status in model.IN_FLIGHT}
        free = [b for b in BRANCHES if b not in busy] + [f"{b}{self.race_keys}" for b in "cd"]
        out = [
            replace(a, after=self._requested(a.after, branch, key))
            for branch in (free[:2] if len(self.model.runs) < 8 else ())
            for a in [self._request(w, branch, key)]
        ]
        out += [self._start(w, run_id) for run_id in self._runs(Status.QUEUED)]
        for run_id in running:
            out += [self._poll(w, run_id), self._cancel(w, run_id)]
        return out

    def _requested(self, then, branch: str, key: str):
        """After a raced request: the next block races a new key."""

        def after(got) -> None:
            then(got)
            if isinstance(got, Won):
                self.last_key[branch] = key
                self.race_keys += 1

        return after

    def meanwhile(self, w: int, data, retake: bool = False) -> None:
        """While the poller is frozen the reaper job may run (with ``retake``: runs) on its own
        clock."""
        if retake or data.draw(st.booleans(), label="reaper runs meanwhile"):
            self.do(REAPER, self._reap())

    @precondition(lambda self: self.ops.pending_failures == 0 and self._next_work())
    @rule(data=st.data(), twice=st.booleans())
    def fault_stand_in_503(self, data, twice: bool) -> None:
        """The operations API answers 503 without acting, to the next request or the next two
        (whoever makes them); a poller takes its turn at once."""
        n = 2 if twice else 1
        self.ops.fail_next(n)
        self.fault(
            "stand-in-refuses", f"operations API answers the next {n} request(s) 503", pace=False
        )
        self.turn(rows.row(data, POLLERS, "poller"), data)


# ---------------------------------------------------------------------------------------
# The soak binding: what a soak runs, and how its judge reads the rows.
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

    description = model.DESCRIPTION

    def __init__(self) -> None:
        from ..soakparts import RecordingOpsApi

        self.stand_in = RecordingOpsApi

    def judging(self, config: dict) -> Judging:
        contract = BranchResetCheck.contract

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
        from ..soakparts import Finisher

        return Finisher(stand_in, seed)

    def store(self, spec: dict, log, check: type):
        p = spec["params"]
        return recording(check.store_class, log)(
            spec["name"],
            spec.get("url") or "",
            log.app_clock,
            lease_seconds=p["lease"],
            http_timeout=p["http_timeout"],
            queries=getattr(check, "queries", None),
        )

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        p = spec["params"]
        if spec["role"] == "reaper":
            return loops.Periodic(connect, store.reap, stop, idle=p["reap_every"])
        return impl.ResetPoller(connect, store, stop, idle=p["poll_every"])

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


CHECK = BranchResetCheck
SOAK = ResetSoak

from .branch_reset_mutants import MUTANTS, RACES  # noqa: E402, F401  (the kind's catalogue)
