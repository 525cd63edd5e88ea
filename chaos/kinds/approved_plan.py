"""The approved plan's model-versus-implementation check.

Rules are the executor's life: a plan proposed, revised, approved, rejected or expired; the
claim (``mark_executing``) by one of two workers; ``run_step`` and ``heartbeat`` by the worker
holding the claim, with the claim token it holds in memory; a read that heals a stale run
lazily; a repeated execute request on a terminal run; a compensating run. Faults are the
base's (:mod:`knownstate.chaos.faults`), paced by the kind's :class:`FaultPolicy`: a holder's
next step meets a COMMIT fault (the worker dies before it, its request or its reply is lost),
and a holder stalls past its heartbeat: the database clock moves by heartbeat + one quantum
while the worker holds an executing run. If somebody reads the run meanwhile, the read heals
it, and the worker's next step must be refused by the lockExecuting fence.

A worker keeps its claims in memory. When only its connection is lost it reconnects and
retries the step it was running, not knowing whether that step committed: the step's identity
(its position in the frozen payload) makes the retry safe, and this is where a step counted by
calls goes wrong. When the worker dies it forgets everything, and its run stays executing until
a read finds the heartbeat stale.

Each fenced write (a step, a heartbeat) is judged twice: its outcome against the model's, and
as a :class:`~knownstate.model.contract.Write` — was the writer still the owner, and did the
database let it write? Each repeat request the model answers as terminal is recorded as a
:class:`~knownstate.model.contract.Repeat`, re-executed when the run's receipts or ledger rows
changed under it. A violation of either is reported as the invariant it breaks, and so is a
database state that no possible model state matches when that state itself breaks one (an
effect without its receipt).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, replace

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from knownstate.impl import approved_plan as impl
from knownstate.model import approved_plan as model
from knownstate.model.approved_plan import Status
from knownstate.model.contract import LostRace, Repeat, Won

from .. import rows
from ..blocks import against, frozen_against_take_back, raced
from ..check import QUANTUM, FaultPolicy, KindCheck, Action, Worker, WorkerDied, needs
from ..history import Audit
from ..judge import Judging, RunRow, StepRow
from ..soakkinds import (
    Producer,
    SoakKind,
    next_step_refused,
    receipts_in_order,
    recording,
    steps_view,
    ts,
)

# The demo domain's steps a plan is drawn from: credits always succeed; the debit only when the
# account holds enough (not before a credit); "fail" never does. Credits first, so a plan shrinks
# towards one that runs, and most steps are credits, so most runs get past their first step.
STEPS = (
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "credit", "account": "b", "amount": 3},
    {"op": "credit", "account": "a", "amount": 5},
    {"op": "credit", "account": "b", "amount": 3},
    {"op": "debit", "account": "a", "amount": 4},
    {"op": "fail"},
)


def plans() -> st.SearchStrategy[tuple[dict, ...]]:
    """Plans of one to four steps, the length drawn uniformly (lists would mostly be short)."""
    return (
        st.integers(1, 4)
        .flatmap(lambda n: st.lists(st.sampled_from(STEPS), min_size=n, max_size=n))
        .map(tuple)
    )


def show(steps) -> str:
    """A plan, compactly, for the trace: ``[credit a 5, fail]``."""
    return "[" + ", ".join(" ".join(str(v) for v in s.values()) for s in steps) + "]"


@dataclass
class Claim:
    """A claim a worker holds in memory: the run, its token, and the step it believes is next."""

    pid: int
    token: int
    next: int = 0
    stalled: bool = False  # the worker stalled past its heartbeat while holding it


assert model.HEARTBEAT_S % QUANTUM == 0, "every duration the check uses is a multiple of QUANTUM"

FINISHED = {Status.EXECUTED, Status.FAILED}  # the runs that can have committed steps to compensate
OPEN = {Status.PENDING, Status.APPROVED, Status.EXECUTING}
OWNER_WRITES = ("heartbeat", "run_step")  # what only the claim's holder writes, fenced by it


class ApprovedPlanCheck(KindCheck):
    kind = "approved-plan"
    contract = model.CONTRACT
    schema = impl.SCHEMA
    n_workers = 2
    heartbeat_s = model.HEARTBEAT_S  # 2 * QUANTUM
    policy = FaultPolicy(gap=3, heal_after=2, stall=model.HEARTBEAT_S + QUANTUM)
    store_class = impl.ApprovedPlanStore
    queries: dict[str, str] | None = None  # the mutant catalogue replaces some
    required_events = (  # a heal, and the fence it arms, need a heartbeat to lapse
        "lost race",
        needs("fence refusal", "time-shift"),
        needs("lazy heal", "time-shift"),
        "step answered from its receipt",
        "repeat answered from receipts",
        "compensation run",
        "worker died before commit",
        "connection lost",
        "indeterminate commit",
        "indeterminate resolved: committed",
        "indeterminate resolved: not committed",
        "fence refusal: run_step (no longer claimed)",
        "fence refusal: heartbeat (no longer claimed)",
        needs("concurrent block", "concurrency"),
        needs("lock wait in a block", "concurrency"),
        # an owner's write frozen past its lease while a read heals its run
        *frozen_against_take_back(*OWNER_WRITES),
        # every pair of operations that can touch one run, raced on one: a pending run (review,
        # expiry), an approved one (claim, expiry), an executing one (steps, heartbeat, reads,
        # expiry), a finished one (repeats, compensations)
        *raced(
            *itertools.combinations_with_replacement(("approve", "expire", "reject", "revise"), 2),
            ("expire", "mark_executing"),
            ("mark_executing", "mark_executing"),
            ("expire", "read"),
            ("expire", "run_step"),
            *itertools.combinations_with_replacement(("read", "run_step"), 2),
            ("expire", "heartbeat"),
            ("heartbeat", "read"),
            ("heartbeat", "run_step"),
            *itertools.combinations_with_replacement(("compensate", "repeat"), 2),
        ),
    )

    # -- hooks ----------------------------------------------------------------------------
    def reset_example(self) -> None:
        # One store per worker: a worker is a process with its own executor object.
        self.stores = [self.new_store() for _ in self.workers]
        self.held: list[dict[int, Claim]] = [{} for _ in self.workers]
        self.seen: dict[int, tuple] = {}  # proposal -> what its last read saw
        self.repeated: set[int] = set()

    def new_store(self) -> impl.ApprovedPlanStore:
        return self.store_class(self.heartbeat_s, self.queries)

    def new_model(self) -> model.ApprovedPlanModel:
        return model.ApprovedPlanModel(self.heartbeat_s)

    def observe_model(self, m: model.ApprovedPlanModel) -> model.PlanState:
        return m.state()

    def observe_impl(self) -> model.PlanState:
        return impl.project(self.ws.admin(), self.to_model_time)

    def views(self, observation: model.PlanState):
        return model.views(observation)

    def observed(self, m: model.ApprovedPlanModel) -> None:
        for pid, _source, event, _target in m.transitions:
            if event == "mark_interrupted_if_stale":
                self.event("lazy heal")
            elif (
                event in ("step_ok", "last_step_ok", "step_failed")
                and m.proposal(pid).compensates is not None
            ):
                self.event("compensation run")

    def clock_matters(self) -> bool:
        """Only a run's heartbeat reads the clock. A jump matters while a run nobody holds (its
        owner died) is executing and not yet stale: the jump lets the next read heal it. A held
        run meets the clock through a stall."""
        held = {pid for h in self.held for pid in h}
        return any(
            p.status is Status.EXECUTING
            and p.proposal_id not in held
            and self.model.now - p.heartbeat_at < self.heartbeat_s
            for p in self._proposals()
        )

    def lost(self, worker: Worker, error: BaseException) -> None:
        """A worker that died forgets everything; one that only lost its connection reconnects and
        goes on with the claims it holds, retrying the step it was running: it does not know
        whether that step committed, and the step's identity (its position) makes the retry safe."""
        if isinstance(error, WorkerDied):
            self.forget(worker)

    def forget(self, worker: Worker) -> None:
        """The worker died: its claims and its executor object are gone."""
        self.held[worker.index].clear()
        self.stores[worker.index] = self.new_store()

    # -- helpers ------------------------------------------------------------------------------
    def _proposals(self) -> tuple[model.Proposal, ...]:
        return self.model.state().proposals

    def _with_status(self, statuses) -> list[int]:
        return [p.proposal_id for p in self._proposals() if p.status in statuses]

    def _pick(self, data, prefer) -> int:
        """A proposal: two times in three one in a status where the operation can win, else one
        where it cannot (a lost race or a refusal, which the contract must get right too); drawn
        by its name (:meth:`name_run`), so that shrinking the steps before leaves it on that
        proposal (:mod:`..rows`)."""
        preferred = self._with_status(prefer)
        others = [p.proposal_id for p in self._proposals() if p.proposal_id not in preferred]
        return rows.one_of_classes(
            data, (preferred, preferred, others), "proposal", name=self.row_name
        )

    def _claims(self, executing_only: bool = False) -> list[tuple[int, int]]:
        executing = set(self._with_status({Status.EXECUTING}))
        return [
            (w, pid)
            for w, held in enumerate(self.held)
            for pid in sorted(held)
            if not executing_only or pid in executing
        ]

    GUARANTEE = {"mark_executing": "claim", "read": "lease", "revise": "stable-step-identity"}
    """What an operation's outcome is, of the contract: the claim (who executes), the lease (a
    read heals a run whose heartbeat is stale, and only such a run), the frozen payload whose
    positions are the steps' identities (a revision is refused once the plan is approved)."""

    # -- the operations, each written once: the rules below and the blocks draw from these -------
    def _simple(self, w: int, name: str, *args, shown: str | None = None) -> Action:
        """An operation on a plan by worker ``w``: the model's and the store's method of that
        name, its outcome what :data:`GUARANTEE` says (the kind's others add to it)."""
        return Action(
            name,
            f"{name}({shown if shown is not None else ', '.join(map(str, args))})",
            lambda m: getattr(m, name)(*args),
            lambda c: getattr(self.stores[w], name)(c, *args),
            guarantee=self.GUARANTEE.get(name),
            runs=frozenset(a for a in args[:1] if isinstance(a, int)),
        )

    def _mark_executing(self, w: int, pid: int) -> Action:
        """The claim. The winner holds the token in memory; another worker loses the race."""

        def after(got) -> None:
            if isinstance(got, Won):
                self.held[w][pid] = Claim(pid, got.value)

        return replace(self._simple(w, "mark_executing", pid), after=after)

    def _run_step(self, w: int, holder: int, pid: int, i: int) -> Action:
        """Step ``i`` of run ``pid`` under the token ``holder`` holds, by worker ``w`` (another
        worker than the holder: the same step request delivered twice). A step's outcome is the
        receipt of the step asked for, by its position."""
        claim = self.held[holder][pid]
        token, done = claim.token, len(self.model.proposal(pid).receipts)
        twice = " (the same request again)" if holder != w else ""

        def after(got) -> None:
            if self.held[holder].get(pid) is not claim:
                return
            if isinstance(got, Won):
                if i < done:
                    self.event("step answered from its receipt")
                claim.next = max(claim.next, i + 1)
                if self.candidates[0].model.proposal(pid).status is not Status.EXECUTING:
                    self.held[holder].pop(pid, None)  # the run ended: nothing left to hold
            self._wrote(holder, claim, got)

        return Action(
            "run_step",
            f"run_step({pid}, step={i}, token={token}){twice}",
            lambda m: m.run_step(pid, i, token),
            lambda c: self.stores[w].run_step(c, pid, i, token),
            after=after,
            fence=lambda: self._owner(claim),
            guarantee="stable-step-identity",
            runs=frozenset({pid}),
        )

    def _heartbeat(self, w: int, pid: int) -> Action:
        claim = self.held[w][pid]
        return Action(
            "heartbeat",
            f"heartbeat({pid}, token={claim.token})",
            lambda m: m.heartbeat(pid, claim.token),
            lambda c: self.stores[w].heartbeat(c, pid, claim.token),
            after=lambda got: self._wrote(w, claim, got),
            fence=lambda: self._owner(claim),
            guarantee="lease-fence",
            runs=frozenset({pid}),
        )

    def _wrote(self, w: int, claim: Claim, got) -> None:
        """After a fenced write by the holder of ``claim``: refused, it lets go of the run."""
        if isinstance(got, LostRace):
            self.event("fence refusal")
            self.held[w].pop(claim.pid, None)
        elif isinstance(got, Won) and claim.stalled:
            self.event("stalled owner wrote before any read")
            claim.stalled = False

    def _read(self, w: int, pid: int) -> Action:
        """A reader of an executing run: it heals the run first if its heartbeat is stale
        (markInterruptedIfStale), then reports it."""

        def after(got) -> None:
            self.seen[pid] = self._seen_key(self.candidates[0].model.proposal(pid))

        return replace(self._simple(w, "read", pid), after=after)

    def _owner(self, claim: Claim) -> tuple[int, int, bool]:
        """A write by the claim's holder: whether the model says it still owns the run
        (executing under its token: lockExecuting's verdict)."""
        p = self.model.proposal(claim.pid)
        return (
            claim.pid,
            claim.token,
            model.fence("write", p.status, p.generation, claim.token) is None,
        )

    def _record_of(self, pid: int) -> tuple:
        """What a repeat request must not change: the run's receipts and its effects."""
        receipts = self.ws.query(
            "select step_index, ok, detail from agent_proposal_step "
            "where proposal_id = %s order by step_index",
            (pid,),
        )
        effects = self.ws.query("select count(*) from demo_ledger where proposal_id = %s", (pid,))
        return tuple(receipts), effects[0][0]

    # -- seeding -------------------------------------------------------------------------------
    @initialize(
        first=plans(),
        more=st.lists(plans(), max_size=1),
        stage=st.sampled_from(("executing", "executing", "approved", "pending", "executed")),
        names=st.tuples(rows.NAME, rows.NAME),
    )
    def seed_work(self, first, more, stage: str, names: tuple[int, int]) -> None:
        """Every example starts with a plan already approved or claimed by w0 (as drawn), so
        execution starts at once, or one in five with it run to its end (a finished run to
        repeat, compensate and race: :meth:`compensate`). Maybe a second one pending. The
        invariants compare consecutive states, so each operation here is checked on its own."""
        pid = self._propose(0, first, names[0])
        if stage != "pending":
            self.do(0, self._simple(0, "approve", pid))
        if stage in ("executing", "executed"):
            self.do(0, self._mark_executing(0, pid))
        while stage == "executed" and pid in self.held[0]:  # every step, to the end
            if self.model.proposal(pid).status is not Status.EXECUTING:
                break
            self._execute(0, pid, "next")
        for steps in more:
            self._propose(0, steps, names[1])

    # -- operations ----------------------------------------------------------------------------
    # Few rules, each drawing which operation of its family to run: Hypothesis picks uniformly
    # among the rules whose precondition holds, so a long chain (propose, approve, claim, steps,
    # compensate, ...) is reached more often with fewer rules. Preconditions keep a rule off
    # while it could only repeat itself. propose or review is always possible, so an example
    # never runs out of rules.
    @precondition(lambda self: len(self._with_status({Status.PENDING, Status.APPROVED})) < 3)
    @rule(w=st.integers(0, 1), steps=plans(), name=rows.NAME)
    def propose(self, w: int, steps, name: int) -> None:
        self._propose(w, steps, name)

    def _propose(self, w: int, steps, name: int) -> int | None:
        """A plan proposed by worker ``w``, named ``name`` (:meth:`name_run`: its id is the
        database's serial): the new proposal's id, None when it failed on a fault."""
        got = self.do(w, self._simple(w, "propose", steps, shown=show(steps)))
        if isinstance(got, Won):
            self.name_run(got.value, name)
            return got.value
        return None

    @precondition(lambda self: self._with_status({Status.PENDING, Status.APPROVED}))
    @rule(
        w=st.integers(0, 1),
        data=st.data(),
        op=st.sampled_from(("approve", "approve", "revise", "reject", "expire")),
        against=against("approve", "revise", "reject", "expire"),
    )
    def review(self, w: int, data, op: str, against: str | None) -> None:
        """A person decides on a plan: approve it (which freezes its payload), revise its steps
        while it is pending, or reject it; or the expiry sweeper expires it. The sweeper races the
        claim, so it is drawn for any open plan, executing ones included (a lost race). Maybe
        raced at once against another review of the same plan or the sweeper: with compensations
        and a heartbeat's refusal reached on purpose, the pairs of reviews were the last a run
        waited for (among the rarest as a run stopped at 15 of 20 seeds, 5 since)."""
        pid = self._pick(data, OPEN if op == "expire" else {Status.PENDING})
        if self.race_on(data, pid, op, against):
            return
        if op == "revise":
            steps = data.draw(plans(), label="steps")
            self.do(w, self._simple(w, "revise", pid, steps, shown=f"{pid}, {show(steps)}"))
        else:
            self.do(w, self._simple(w, op, pid))

    # A rule that leaves the state a pair of operations needs (a claim, a compensation), or that
    # is drawn only when it can see something new (a read), races it at once, drawn (``against``,
    # :meth:`race_on`): the last pairs a run waited for were these (read × read at 8 of 20
    # seeds, compensate × repeat at 3 of 3), met otherwise by blocks aimed at pairs at random.
    @precondition(lambda self: self._with_status({Status.APPROVED}))
    @rule(w=st.integers(0, 1), data=st.data(), against=against("mark_executing", "expire"))
    def mark_executing(self, w: int, data, against: str | None) -> None:
        pid = self._pick(data, {Status.APPROVED})
        if self.race_on(data, pid, "mark_executing", against):
            return
        self.do(w, self._mark_executing(w, pid))

    @precondition(lambda self: self._claims())
    @rule(
        data=st.data(),
        action=st.sampled_from(("next", "next", "again", "skip", "heartbeat", "heartbeat")),
        against=against("run_step", "read", "expire"),
    )
    def execute(self, data, action: str, against: str | None) -> None:
        """The claim's holder runs the step it believes is next (after a lost connection: the one it
        was running, which may have committed), asks again for the one before (answered from its
        receipt, never re-applied), asks for one too far (refused), or renews its heartbeat. A
        holder refused by the fence lets go of the run. Its next step (or heartbeat) maybe raced
        against the same step (the request delivered twice), a read or the sweeper. A heartbeat
        is drawn one time in three: at one in five, its pairs (heartbeat × run_step, expire ×
        heartbeat) were the requirements a run met last at 3 of seeds 1-5."""
        w, pid = rows.row(
            data,
            self._claims(),
            "worker, proposal",
            name=lambda c: f"w{c[0]} {self.row_name(c[1])}",
        )
        op = {"next": "run_step", "heartbeat": "heartbeat"}.get(action)
        if op and self.race_on(data, pid, op, against):
            return
        self._execute(w, pid, action)

    def _execute(self, w: int, pid: int, action: str) -> None:
        if action == "heartbeat":
            self.do(w, self._heartbeat(w, pid))
        else:
            i = self.held[w][pid].next + {"next": 0, "again": -1, "skip": 1}[action]
            self.do(w, self._run_step(w, w, pid, i))

    # A read or a repeat is drawn only when it can see something new: a read of an executing run
    # whose heartbeat, receipts or clock moved since it was last read; a repeat of a terminal run
    # not repeated yet. Otherwise Hypothesis, which likes to repeat what it drew, fills examples
    # with reads that observe nothing.
    def _unread(self) -> list[int]:
        return [
            p.proposal_id
            for p in self._proposals()
            if p.status is Status.EXECUTING and self.seen.get(p.proposal_id) != self._seen_key(p)
        ]

    def _seen_key(self, p: model.Proposal) -> tuple:
        return (self.model.now, p.heartbeat_at, len(p.receipts))

    @precondition(lambda self: self._unread())
    @rule(w=st.integers(0, 1), data=st.data(), against=against("read", "run_step", "expire"))
    def read(self, w: int, data, against: str | None) -> None:
        pid = rows.row(data, self._unread(), "proposal", name=self.row_name)
        if self.race_on(data, pid, "read", against):
            return
        self.do(w, self._read(w, pid))

    def _unrepeated(self) -> list[int]:
        return [pid for pid in self._with_status(model.TERMINAL) if pid not in self.repeated]

    @precondition(lambda self: self._unrepeated())
    @rule(w=st.integers(0, 1), data=st.data())
    def repeat(self, w: int, data) -> None:
        """The execute request arrives again. It heals a stale run too, and a terminal run answers
        from its receipts. A repeat the model answers as terminal is recorded as a Repeat,
        re-executed if the run's receipts or effects changed under it."""
        pid = rows.row(data, self._unrepeated(), "proposal", name=self.row_name)
        self.repeated.add(pid)
        label = f"repeat(w{w}, {pid})"

        def judged(conn):
            before = self._record_of(pid)
            got = self.stores[w].repeat(conn, pid)
            if isinstance(got, Won):
                self.repeats.append(Repeat(str(pid), reexecuted=self._record_of(pid) != before))
            return got

        got = self.apply(self.workers[w], label, lambda m: m.repeat(pid), judged)
        if isinstance(got, Won) and got.value.receipts:
            self.event("repeat answered from receipts")

    def _compensable(self) -> list[int]:
        """Finished runs with a committed step and no compensation yet."""
        done = {p.compensates for p in self._proposals()}
        return [
            p.proposal_id
            for p in self._proposals()
            if p.status in FINISHED and any(r.ok for r in p.receipts) and p.proposal_id not in done
        ]

    @precondition(lambda self: self._compensable())
    @rule(w=st.integers(0, 1), data=st.data(), against=against("repeat", "compensate"))
    def compensate(self, w: int, data, against: str | None) -> None:
        """Propose the run that undoes a finished run's committed steps: it is approved, claimed and
        executed like any plan, with its own receipts. Drawn for a run that has none yet, or
        any run (the existing compensation is found; a run with nothing to undo is refused).
        On one that has none yet, maybe raced against a repeat or another compensation."""
        compensable = self._compensable()
        every = [p.proposal_id for p in self._proposals()]
        pid = rows.one_of_classes(
            data, (compensable, compensable, every), "proposal", name=self.row_name
        )
        if pid in compensable and self.race_on(data, pid, "compensate", against):
            return
        self.do(w, self._simple(w, "compensate", pid))

    def _unclaimed_compensations(self) -> list[int]:
        return [
            p.proposal_id
            for p in self._proposals()
            if p.compensates is not None and p.status in (Status.PENDING, Status.APPROVED)
        ]

    @precondition(lambda self: self._unclaimed_compensations())
    @rule(w=st.integers(0, 1), data=st.data())
    def run_compensation(self, w: int, data) -> None:
        """A compensation taken through by one worker: approved, claimed, its first step run,
        each an operation of its own (a fault may strike at each; the chain stops at the first
        that fails on one). Reached on purpose, as the outbox's mixed batch is: a compensation
        run takes a finished run, its compensation, an approval, a claim and a step, and was
        among the rarest requirements as a run stopped at 9 of 20 seeds (up to 291 examples)."""
        pid = rows.row(data, self._unclaimed_compensations(), "compensation", name=self.row_name)
        if self.model.proposal(pid).status is Status.PENDING:
            if self.do(w, self._simple(w, "approve", pid)) is None:
                return
        if self.model.proposal(pid).status is Status.APPROVED:
            if self.do(w, self._mark_executing(w, pid)) is None:
                return
        if pid in self.held[w] and self.model.proposal(pid).status is Status.EXECUTING:
            self._execute(w, pid, "next")

    # -- the fault policy's questions -----------------------------------------------------------
    def turns(self, w: int) -> list[int]:
        """A holder's next turn: a step (or a heartbeat) of a run it holds that is executing."""
        return [pid for x, pid in self._claims(executing_only=True) if x == w]

    def turn(self, w: int, data, due: frozenset = frozenset()) -> None:
        pid = rows.row(data, sorted(due) or self.turns(w), "proposal", name=self.row_name)
        self._execute(w, pid, data.draw(st.sampled_from(("next", "heartbeat")), label="action"))

    def next_write(self, w: int, data, frozen: bool = False) -> frozenset:
        """The run its next step or heartbeat is for, drawn before it stalls: it makes that
        write on resuming even when the read meanwhile ended the run (its heartbeat lapsed), the
        refusal the stall is for. (Drawn after, among the runs still executing, it made none:
        the heartbeat's refusal of a run nobody holds was then met only by the ``execute`` rule,
        one action in five, and was among the rarest as a run stopped at 12 of 20 seeds.)"""
        return frozenset({rows.row(data, self.turns(w), "proposal", name=self.row_name)})

    def leases(self) -> list[int]:
        return sorted({w for w, _ in self._claims(executing_only=True)})

    # -- concurrent blocks ---------------------------------------------------------------------
    def offers(self, w: int) -> list[Action]:
        """What worker ``w`` can start together with the other: every operation of the kind, on
        every plan it can act on; also the step the other worker holds, with its token (the same
        step request delivered twice)."""
        pending = self._with_status({Status.PENDING})
        out = (
            [self._simple(w, "propose", STEPS[:1], shown=show(STEPS[:1]))]
            if len(pending) < 2
            else []
        )
        for pid in pending:
            out += [self._simple(w, "approve", pid), self._simple(w, "reject", pid)]
            out.append(
                self._simple(w, "revise", pid, STEPS[1:2], shown=f"{pid}, {show(STEPS[1:2])}")
            )
        out += [self._simple(w, "expire", pid) for pid in self._with_status(OPEN)]
        out += [self._mark_executing(w, pid) for pid in self._with_status({Status.APPROVED})]
        for holder, pid in self._claims(executing_only=True):
            out.append(self._run_step(w, holder, pid, self.held[holder][pid].next))
            if holder == w:
                out.append(self._heartbeat(w, pid))
        out += [self._read(w, pid) for pid in self._with_status({Status.EXECUTING})]
        out += [self._simple(w, "repeat", pid) for pid in self._with_status(model.TERMINAL)]
        return out + [self._simple(w, "compensate", pid) for pid in self._compensable()]

    def meanwhile(self, w: int, data, retake: bool = False) -> None:
        """The stalled worker's runs are marked stalled; the other worker may read one of them
        (with ``retake``: does), which heals it (its heartbeat is stale): the stalled worker's
        next write must then be refused by the fence. Without a read, its next write lands."""
        for pid in self.turns(w):
            self.held[w][pid].stalled = True
        if retake or data.draw(st.booleans(), label="read meanwhile"):
            pid = rows.row(data, self.turns(w), "proposal read", name=self.row_name)
            self.do(1 - w, self._read(1 - w, pid))


# ---------------------------------------------------------------------------------------
# The soak binding: what a soak runs, and how its judge reads the rows.
# ---------------------------------------------------------------------------------------


SOAK_WEIGHTS = (6, 6, 6, 6, 4, 1)
"""How often a soak's plan takes each of :data:`STEPS`: mostly credits, a step that fails rarely."""


class PlanSoak(SoakKind):
    name = "approved-plan"
    params = {"heartbeat_s": 3, "pace": 0.08, "idle": 0.1, "read_every": 0.3, "rate": 4.0}
    lease = 3.0
    nudge = 3 + 1
    run_tables = ("agent_proposal",)

    description = model.DESCRIPTION

    def judging(self, config: dict) -> Judging:
        contract, heartbeat_s = ApprovedPlanCheck.contract, config["heartbeat_s"]

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

        return self._judging(
            contract,
            row=row,
            view=steps_view,
            owner_writes=frozenset(OWNER_WRITES),
            heartbeats=frozenset({"heartbeat"}),
            take_backs=frozenset({"read", "repeat", "compensate"}),
            creations=frozenset({"propose"}),
            done="executed",
            token_noun="token",
            extras=(next_step_refused, receipts_in_order),
        )

    def store(self, spec: dict, log, check: type):
        cls = recording(check.store_class, log)
        return cls(spec["params"]["heartbeat_s"], getattr(check, "queries", None))

    def loop(self, spec: dict, store, connect, stop: threading.Event, log):
        p = spec["params"]
        if spec["role"] == "reaper":
            return impl.PlanReader(connect, store, stop, idle=p["read_every"])
        return impl.PlanExecutor(connect, store, stop, idle=p["idle"], pace=p["pace"])

    def produce(self, producer: Producer) -> None:
        rng, store, pending = producer.rng, producer.store, producer.state.setdefault("left", [])
        roll = rng.random()
        if pending and roll < 0.05:
            store.expire(producer.conn(), pending.pop(0))
            return
        steps = rng.choices(STEPS, SOAK_WEIGHTS, k=rng.randint(2, 5))
        out = store.propose(producer.conn(), steps)
        if not isinstance(out, Won):
            return
        if roll < 0.10:
            pending.append(out.value)  # left pending, to expire later
        elif roll < 0.15:
            store.reject(producer.conn(), out.value)
        else:
            store.approve(producer.conn(), out.value)


CHECK = ApprovedPlanCheck
SOAK = PlanSoak

from .approved_plan_mutants import MUTANTS, RACES  # noqa: E402, F401  (the kind's catalogue)
