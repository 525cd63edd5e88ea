"""The base of the two engines a check is built from, and the one list of their hooks.

A check is a Hypothesis :class:`RuleBasedStateMachine` whose rules are a kind's operations *and*
faults, run against a pure model and the real implementation side by side. Two engines do the
stepping, siblings over :class:`Engine`:

- the **transactions engine**, :class:`~.check.KindCheck`: a durable run kind's workers each do
  one transaction per step on their own connection (:meth:`~.check.KindCheck.apply`), and
  concurrent blocks race several of them (:mod:`.blocks`);
- the **replay engine**, :class:`~.replay.ReplayCheck`: a client protocol's script runs on the
  real side while its exchanges are recorded, then is replayed on the model
  (:meth:`~.replay.ReplayCheck.play`).

What they share is here: the life cycle of an example (workers and their links, the workspace's
tables, the clock's origin), the fault rules (:mod:`.faults`, paced by the kind's
:class:`~.faults.FaultPolicy`), the trace and the counters, coverage (:meth:`Engine.requirements`),
and the one door every failure goes through (:meth:`Engine.fail`): it judges first, so a failure
names the invariant it breaks when it breaks one, and otherwise shows the difference.

The engine's hooks
------------------

A kind plugs in by subclassing one of the engines (a described queue needs none of this:
:func:`knownstate.chaos.generic.kind` builds the subclass). Everything a kind gives is listed
here, with when the engine reads it and what it is when the kind leaves it out (Porcupine's
``Model`` is the pattern: every hook a documented field). What the engine asks of the model
itself is :class:`~knownstate.model.contract.RunModel`. Engine: *both*, *T* (transactions,
:class:`~.check.KindCheck`) or *R* (replay, :class:`~.replay.ReplayCheck`).

==========================  ====  =====================================  ==========================
hook                        for   read / called                          default
==========================  ====  =====================================  ==========================
``kind``, ``schema``        both  once per run: the name, the SQL of a   required
                                  workspace
``new_model()``             both  each example: a fresh ``RunModel``     required
``observe_model(m)``,       both  after every step: the two must be      required
``observe_impl()``                equal
``contract``                both  every step: the invariants judge       None (no contract: only
                                  views of the rows against it           ``own_invariants``)
``table()``                 both  before each example: the transitions   ``contract.table``
                                  a run must observe
``required_events``         both  before each example: coverage          ``()`` (the table's
                                                                         transitions always are)
``own_invariants``          both  a failure: what else it may name       ``{}``
``policy``                  both  each step: when faults may fire        ``FaultPolicy()``
``commit_point``            both  a COMMIT fault: where it meets the     ``"COMMIT"``
                                  worker (``"statement"`` in autocommit)
``n_workers``,              both  each example: the workers and their    2, :class:`.harness.Worker`
``worker_class``                  connections
``reset_example()``         both  each example, after tables and links   nothing
``turns``, ``turn``,        both  the faults: who has work that          none: COMMIT faults,
``leases``, ``meanwhile``,        commits, who holds a live lease, what  stalls and lost replies
``next_write``                    the others do while it is frozen       never fire
                                  (:mod:`.faults`)
``clock_matters()``,        both  before a clock jump / a crash          True
``crash_matters()``
``stall_passes(seconds)``   both  a stall: its time passes on the        the database's clock
                                  clocks the kind's leases are judged    (``policy.stall_clock``)
                                  by                                     and ``advance``
``all_links()``             both  a link fault: every link it may act    every worker's links
                                  on (a kind without workers gives its
                                  clients' and servers')
``external_links(w)``       both  an external call's fault: the links    ``w``'s links but its
                                  of ``w``'s calls out                   database link
``judged(real)``            both  a failure given no violations: every   T: the contract's and
                                  invariant on the real state now        ``kind_violations``;
                                                                         R: ``[]``
``views(observation)``      T     after every step: the contract's       required with a contract
                                  kind-neutral views
``operations``,             T     each step: one rule per operation      ``()``, ``[]``: the kind
``actions(w)``                    name, drawing among worker ``w``'s     writes its own rules
                                  actions of that name
                                  (:class:`~.steps.Action`)
``offers(w)``               T     a concurrent block: what ``w`` may     its actions that are one
                                  race                                   transaction each
``fingerprint(m)``          T     a block's search: equal for equal      every attribute but its
                                  states                                 transition log
``kind_violations(real)``   T     after every step: the kind's own       ``[]``
                                  named properties
``difference_breaks``       T     a block no order of which ends in the  ``()``
                                  rows read after: what their difference
                                  from the closest order's breaks
``frozen_aim``              T     a stall frozen inside a write whose    None (each write as
                                  run is taken back and claimed: the     likely)
                                  write drawn twice as often as the
                                  others together
``lock_wait_breaks``        T     a wait on another worker's lock        None (a failure naming
                                                                         nothing)
``observed(m)``             T     after a step the rows agreed with      nothing
                                  ``m``
``forget(w)``,              T     a worker died / an operation failed    nothing
``lost(worker, error)``           on a fault
``recorder``,               R     each step: where the real wires        required
``real_side()``,                  record; the real clients; the model's
``model_side(m, deliver)``        clients, whose network is the
                                  recording
``lost(answer)``,           R     each exchange: the answer never        required
``may_change(request)``           arrived; the request changes state
``deliver_to_model(m, r)``  R     each exchange: the model's server's    required
                                  answer
``unanswered(why)``         R     following a diverged run: the answer   required
                                  to a request never made
``domain_errors``           R     a script's end: what it may raise as   ``()``
                                  an outcome
``landing_changes(a)``      R     a lost request landed: whether that    True
                                  changed anything
``compared(outcome)``       R     each step: the outcome as compared     the outcome
                                  with the model's
``judge(real, m, xs)``      R     after every step: the invariants on    ``[]``
                                  the real world
``counted(chosen)``         R     after a step matched a world: count    nothing
``after_step()``            R     after each script ran on the real      nothing
                                  side
``on_the_wire(request)``    R     each exchange: what model and          the whole request
                                  implementation must both send
``difference(e, r)``,       R     a failure, a trace line: how to show   short ``repr``
``describe(x)``,                  it
``describe_request(r)``
``not_applied(events)``     both  a run's end: why the check, a          ``""`` (it applied)
                                  mutant's, ran as the reference did
==========================  ====  =====================================  ==========================

Each engine has its own invariant, ``model_agrees``: after every step the real state equals one
possible model state, and the judge finds nothing.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any, ClassVar, Mapping, NoReturn

from hypothesis.stateful import RuleBasedStateMachine

from knownstate.model.contract import INVARIANTS, Contract, RunModel, Violation

from . import timings, tools
from .blocks import Blocks
from .faults import FaultPolicy, FaultRules
from .harness import QUANTUM, Env, EnvironmentFault, Stats, Worker, Workspace
from .runner import Requirement, RunState
from .steps import Candidate


class Engine(FaultRules, Blocks, RuleBasedStateMachine):
    """The base of both engines (see the module's table of hooks). The concurrent-block rule
    (:class:`~.blocks.Blocks`) is the transactions engine's, but it is on the base so that the
    replay engine keeps the rules it had when it subclassed the transactions engine: Hypothesis
    draws a step among all of a machine's rules, so one rule fewer would change what every
    recorded seed of the document session replays. Without workers (the replay engine has
    none) it never fires."""

    kind: ClassVar[str] = ""
    contract: ClassVar[Contract | None] = None
    schema: ClassVar[str] = ""
    n_workers: ClassVar[int] = 2
    required_events: ClassVar[tuple[str | Requirement, ...]] = ()
    policy: ClassVar[FaultPolicy] = FaultPolicy()
    own_invariants: ClassVar[dict[str, str]] = {}
    """Named properties the kind's check judges besides the contract's (name -> statement)."""
    worker_class: ClassVar[type[Worker]] = Worker
    """The workers' class: a kind whose implementation needs another connection (asyncio, a
    driver of its own) gives its own subclass (see :mod:`.adapter`)."""

    # Set per run by build_machine():
    env: ClassVar[Env]
    ws: ClassVar[Workspace]
    run: ClassVar[RunState]

    # -- hooks for the kind ----------------------------------------------------------------
    @classmethod
    def table(cls):
        """The transition table whose every row a run must observe."""
        return cls.contract.table

    @classmethod
    def named_invariants(cls) -> dict[str, str]:
        """Every invariant a failure of this kind can name."""
        return {**(INVARIANTS if cls.contract is not None else {}), **cls.own_invariants}

    @classmethod
    def requirements(cls) -> tuple[Requirement, ...]:
        rows = tuple(
            Requirement(f"{t.source} -{t.event}-> {t.target}", "transition")
            for t in cls.table().transitions
        )
        events = tuple(
            r if isinstance(r, Requirement) else Requirement(r) for r in cls.required_events
        )
        return rows + events

    def new_model(self) -> RunModel:
        raise NotImplementedError

    def observe_model(self, model: Any) -> Any:
        """The model's observable state, in the same shape observe_impl() returns."""
        raise NotImplementedError

    def observe_impl(self) -> Any:
        """Read the real state (rows, stand-in records) on the check's own connections."""
        raise NotImplementedError

    def reset_example(self) -> None:
        """Reset the kind's stand-ins between examples (tables and toxics are reset here)."""

    def judged(self, real: Any) -> list[Violation]:
        """Every invariant on the real state now (``real``: None when not read yet), for a
        failure that was not given its violations. Default: none."""
        return []

    @classmethod
    def not_applied(cls, events: Mapping[str, int]) -> str:
        """Why this check, a mutant's, ran as the reference did in a run that observed
        ``events`` (its edit found nothing to change): the mutant is then *not applicable*,
        neither caught nor missed. Default: "" (a mutant of the reference's code always
        applies)."""
        return ""

    # -- life cycle -------------------------------------------------------------------------
    @timings.timed("reset")
    def __init__(self) -> None:
        super().__init__()
        run = type(self).run
        run.stop_before_example()
        run.allow_save = False
        self._swarm_faults_only()
        self.trace: list[str] = []
        run.last_trace = self.trace
        if run.all_traces is not None:
            run.all_traces.append(self.trace)
        env = self.env
        env.ensure_alive()
        env.reset_faults()
        self.workers = self._workers()
        self.ws.truncate()
        self.t0 = self.ws.now()
        self.started = time.monotonic()
        self._reset_faults()
        self.reset_example()
        self.model = self.new_model()
        self.candidates = [Candidate(self.model)]
        self._struck = False
        self.run_names: dict[Any, str] = {}
        self.begin_example()
        run.stats.examples += 1
        if run.progress is not None:
            run.progress(run)

    def begin_example(self) -> None:
        """The engine's own state of a new example, once the model is made."""

    def row_name(self, run: Any) -> str:
        """What names run ``run`` whatever came before (:mod:`.rows`): its key, unless the kind
        named it when it created it (:meth:`name_run`)."""
        return self.run_names.get(run, repr(run))

    def name_run(self, run: Any, name: int) -> None:
        """Name a run the database keyed (a serial id) by a number its creating step drew: an
        id is renumbered when shrinking deletes a step that created a run before it, so a step
        drawn by id would act on another run and the deletion be refused (approved-plan,
        heartbeat-owner-read-first at seed 1 kept 16 steps)."""
        self.run_names[run] = f"#{name}"

    def _workers(self) -> list[Worker]:
        """The run's workers, kept from one example to the next with their connections when
        those still answer (each example resets their links; see ``Worker.ready``)."""
        kept = self.ws.workers
        if len(kept) != self.n_workers:
            for w in kept:
                w.close()
            kept[:] = [
                self.worker_class(self.env, self.ws, self.kind, i) for i in range(self.n_workers)
            ]
        for w in kept:
            w.links = [w.link]
            w.ready()
        return kept

    def _swarm_faults_only(self) -> None:
        """Hypothesis's swarm testing switches a random subset of rules off for each example. Let
        it vary the fault kinds the policy allows (``policy.swarm``) but never switch off an
        operation or another fault: no required event may depend on the luck of the switch.
        Uses Hypothesis internals defensively: if they change, swarm testing applies to every
        rule again."""
        rs = getattr(self, "_rules_strategy", None)
        needed = ("rules_strategy", "is_valid", "_enabled_rules_strategy", "_feature_flags")
        if rs is None or not all(hasattr(rs, a) for a in needed):
            return
        swarm = {f"fault_{k.replace('-', '_')}" for k in self.policy.swarm}

        def enabled(r) -> bool:
            name = r.function.__name__
            return rs.is_valid(r) and (name not in swarm or rs._feature_flags.is_enabled(name))

        rs._enabled_rules_strategy = rs.rules_strategy.filter(enabled)

    # -- time ---------------------------------------------------------------------------------
    def to_model_time(self, ts: dt.datetime) -> int:
        """A database timestamp as model seconds since the example started. The safety net: a
        timestamp too far from every quantum means the steps ran longer than the tolerance (the
        clock stands still between them: see :meth:`clock_stands`), which only a very slow or
        loaded machine does; that is the environment's failure, never a verdict."""
        clock = self.env.clock
        seconds = (ts - self.t0).total_seconds() + clock.shifted
        q = round(seconds / QUANTUM) * QUANTUM
        if abs(seconds - q) >= QUANTUM / 2 - 5:
            took = time.monotonic() - self.started
            raise EnvironmentFault(
                f"the steps of one example ran {took - clock.held_total:.0f} s of the database's "
                f"clock (the example {took:.0f} s), past the clock tolerance "
                f"({QUANTUM / 2 - 5:.0f} s): this machine is too slow or too loaded for the "
                "check; rerun it with less running beside it (the same seed gives the same run)"
            )
        return int(q)

    def clock_runs(self) -> None:
        """The database is about to be touched: its clock goes on from where it stood."""
        self.env.clock.release()

    def clock_stands(self) -> None:
        """A step and its observation are over: the database's clock stands still until the
        next :meth:`clock_runs`, so the time the checker, Hypothesis or a loaded machine take
        between steps never ages a lease (a no-op where the clock cannot stand still)."""
        self.env.clock.hold()

    def advance(self, seconds: int) -> None:
        """Every possible model state's clock moves (the database clock, or the app clocks)."""
        for c in self.candidates:
            c.model.advance(seconds)

    # -- the trace and the counters ------------------------------------------------------------
    def log(self, line: str) -> None:
        self.trace.append(line)

    def fault(self, kind: str, line: str, pace: bool = True) -> None:
        """Count and log a fault; with ``pace`` the next paced fault waits ``policy.gap``."""
        self.run.stats.faults[kind] += 1
        self._struck = True
        if pace:
            self.last_fault = self.op_count
        self.log(f"FAULT {line}")

    def event(self, name: str, n: int = 1) -> None:
        if n:
            self.run.stats.events[name] += n

    @property
    def stats(self) -> Stats:
        return self.run.stats

    def begin_step(self, n: int = 1) -> None:
        """Every step (a block: one per operation in it) starts here: counted, and stopped if a
        signal's interrupt was dropped."""
        tools.raise_if_interrupted()
        self.clock_runs()
        self.stats.steps += n

    # -- the door -------------------------------------------------------------------------------
    def fail(
        self,
        problem: str,
        violations: list[Violation] | None = None,
        real: Any = None,
        otherwise: str | tuple[str, ...] | None = None,
    ) -> NoReturn:
        """The one door every failure goes through. It judges first: the invariants on the real
        state (unless ``violations`` are given); a failure names those it finds, and shows
        ``problem`` (the difference from the model) after them. When the failing operation's
        outcome itself breaks a guarantee of the contract (``otherwise``: a refused write that
        went through breaks the conditional transition, a claim that took the wrong runs the
        claim), the failure names that too; with nothing else to name, the difference is shown
        alone. Several guarantees may be named where which one broke depends on the order the
        operations are read in (a concurrent block)."""
        self.env.ensure_alive()
        if violations is None:
            violations = self.judged(real)
        names = list(dict.fromkeys((otherwise,) if isinstance(otherwise, str) else otherwise or ()))
        extra = [n for n in names if n not in {v.invariant for v in violations}]
        if violations:
            message = "invariant violated: " + "; ".join(map(str, violations))
            if extra:
                message += f"; {', '.join(extra)}: the outcome below"
            if problem:
                message += "\n  (" + problem.replace("\n", "\n   ") + ")"
        elif extra:
            message = f"invariant violated: {', '.join(extra)}: {problem}"
        else:
            message = problem
        violations = violations + [Violation(n, problem) for n in extra]
        names = tuple(sorted({v.invariant for v in violations}))
        unknown = set(names) - set(self.named_invariants())
        if unknown:
            raise AssertionError(
                f"{type(self).__name__} judged invariant(s) {sorted(unknown)} "
                "that it does not declare: add them to own_invariants"
            )
        self.stats.saw_failure(message, names, self.trace)
        self.run.failed(message, names, self.trace)
