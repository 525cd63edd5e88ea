"""The transactions engine: the check of a durable run kind.

How a check works
-----------------

A check is a Hypothesis :class:`RuleBasedStateMachine` whose rules are the kind's operations
*and* faults. Each operation is applied to the pure model and to the real implementation
(through a worker's own Toxiproxy link to a real PostgreSQL, :mod:`.harness`); the outcomes
must be equal. After every step the database rows are projected into the model's shape and
must equal the model, and the contract's invariants must hold.

Indeterminate outcomes are first-class. When a fault cuts a connection while COMMIT is in
flight, nobody can know whether the transaction landed. The check then keeps an explicit set
of :class:`Candidate` states — with and without the COMMIT, with and without an external call
that may have acted — and lets the next observation (read on a separate, unfaulted connection)
decide. It never assumes lost and never assumes done.

Faults are rules too (:mod:`.faults`): the base owns every one of them; a kind sets a
:class:`~.faults.FaultPolicy` (data: when faults may fire) and answers a few hooks.

What every engine shares — the life cycle of an example, the faults, the trace, coverage and
the one door every failure goes through (:meth:`~.engine.Engine.fail`, which judges first) —
is :class:`~.engine.Engine`, whose docstring lists every hook a kind gives, with when it is
called and its default. Concurrent blocks (:mod:`.blocks`) and runs directed by coverage
(:mod:`.runner`) have modules of their own; the replay engine, this one's sibling, is
:mod:`.replay`.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, ClassVar

import psycopg
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from knownstate.impl.errors import (
    ClientError,
    CommitIndeterminate,
    ConnectionLost,
    ExternalCallFailed,
    TransactionAborted,
    first_line,
    is_connection_error,
)
from knownstate.model.contract import (
    LostRace,
    Repeat,
    RunView,
    Violation,
    Won,
    Write,
    check_invariants,
)

from . import rows, timings
from .engine import Engine
from .faults import FaultPolicy, toxics
from .harness import QUANTUM, Env, EnvironmentFault, Stats, Worker, WorkerDied, watch
from .runner import (
    BATCH,
    PROFILES,
    SHRINKS,
    CheckResult,
    GateDatabase,
    Profile,
    Requirement,
    RunState,
    SaveOnly,
    batch_seed,
    build_machine,
    needs,
    run_check,
)
from .linearize import UNKNOWN
from .rows import row_names
from .steps import Action, Candidate, Failure, broken_by, diff, fmt, part_way

__all__ = [
    "BATCH",
    "SHRINKS",
    "GateDatabase",
    "Action",
    "RunState",
    "SaveOnly",
    "batch_seed",
    "broken_by",
    "build_machine",
    "diff",
    "fmt",
    "needs",
    "QUANTUM",
    "Candidate",
    "CheckResult",
    "Env",
    "EnvironmentFault",
    "Failure",
    "FaultPolicy",
    "KindCheck",
    "PROFILES",
    "Profile",
    "Requirement",
    "Stats",
    "Worker",
    "WorkerDied",
    "run_check",
    "toxics",
]


class KindCheck(Engine):
    """The transactions engine: base of every durable run kind's check. Subclasses set the class
    attributes and implement the hooks (:mod:`.engine` lists them)."""

    lock_wait_breaks: ClassVar[str | None] = None
    """The invariant a worker's wait on another worker's lock breaks in this kind (None: such a
    wait is reported as a failure without naming one)."""

    operations: ClassVar[tuple[str, ...]] = ()
    """The kind's operations, by name: the engine makes one rule for each (:meth:`act`), drawing
    among the :class:`~.steps.Action` of that name the workers have now (:meth:`actions`)."""

    # -- hooks for the kind ----------------------------------------------------------------
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for op in cls.__dict__.get("operations", ()):
            setattr(cls, f"op_{op}", _rule_for(op))

    def actions(self, w: int) -> list[Action]:
        """Everything worker ``w`` can do now, each operation once (default: nothing). The same
        list gives the rules, the concurrent blocks and the faults' turns."""
        return []

    def views(self, observation: Any) -> dict[str, RunView]:
        raise NotImplementedError

    def kind_violations(self, real: Any) -> list[Violation]:
        """The kind's own named properties (``own_invariants``), judged on the real state."""
        return []

    def difference_breaks(self, expected: Any, real: Any) -> tuple[str, ...]:
        """What the real state's difference from ``expected`` (both observed) breaks, where the
        rows alone show it (default: nothing): a block whose every outcome is explained but
        whose rows no order ends in is named by it."""
        return ()

    def observed(self, model: Any) -> None:
        """Called after each step once the database agreed with ``model``: count events."""

    def forget(self, worker: Worker) -> None:
        """The worker died: drop everything it held in memory."""

    def lost(self, worker: Worker, error: BaseException) -> None:
        """An operation of ``worker`` failed on a fault (``error``: a lost connection, a death
        before COMMIT, an external call unanswered). Default: nothing (``apply``'s ``on_error``
        says what the operation loses)."""

    # -- life cycle -------------------------------------------------------------------------
    def begin_example(self) -> None:
        self.writes: list[Write] = []
        self.repeats: list[Repeat] = []
        self._indeterminate = False
        self._if_landed: tuple[str, ...] = ()
        self._unobserved = False
        self.prev_views = self.views(self.observe_model(self.model)) if self.contract else {}

    # -- the step ----------------------------------------------------------------------------
    def start_step(self, n: int = 1) -> None:
        """Every operation on the implementation (a block: ``n`` of them at once) starts here.
        A step before it in the same rule is judged first, since each is judged on its own (the
        possible states of two unobserved steps are not kept); links faulted long enough heal;
        the step is counted."""
        if self._unobserved:
            self.model_agrees()
        self._unobserved = True
        self._age_faults()
        self.begin_step(n)

    # -- the judge ---------------------------------------------------------------------------
    def judged(self, real: Any) -> list[Violation]:
        """:meth:`judge` on the real state (read now when ``real`` is None); when it cannot be
        read, what the step did (its writes and repeats) against the contract."""
        try:
            if real is None:
                real = self.observe_impl()
            return self.judge(real)
        except Failure:
            raise
        except Exception:
            # The state cannot be read (a part is failing): judge what the step did.
            return (
                check_invariants(self.contract, {}, {}, self.writes, self.repeats)
                if self.contract
                else []
            )

    def judge(self, real: Any) -> list[Violation]:
        """Every invariant on the real state after this step (no side effect). After a concurrent
        block a run may have taken several transitions, each already judged against the model's
        table by the linearization: the views are then compared with themselves (every state
        invariant, no transition)."""
        out: list[Violation] = []
        if self.contract is not None:
            now = self.views(real)
            before = now if getattr(self, "_after_block", False) else self.prev_views
            out += check_invariants(self.contract, before, now, self.writes, self.repeats)
        return out + self.kind_violations(real)

    # -- the step ----------------------------------------------------------------------------
    _doable: dict[str, list[tuple[int, Action]]] | None = None

    def doable(self, op: str) -> list[tuple[int, Action]]:
        """Every ``(worker, action)`` of operation ``op`` now. Hypothesis asks it of every
        operation's rule before each step (its precondition), so every worker's actions are
        listed once per state: kept until the state may change, i.e. until the chosen rule
        starts (:meth:`act` takes them) or the step's invariants run (:meth:`model_agrees`)."""
        if self._doable is None:
            self._doable = {}
            for w in self.workers:
                for a in self.actions(w.index):
                    self._doable.setdefault(a.op, []).append((w.index, a))
        return self._doable.get(op, [])

    def act(self, data, op: str) -> Any:
        """The rule of operation ``op``: one of its actions now, by one of the workers that have
        it (an unlikely one, expected to lose, one time in three), done as a step."""
        pairs, self._doable = self.doable(op), None
        likely = [p for p in pairs if p[1].likely]
        rest = [p for p in pairs if not p[1].likely]
        # the row drawn by its name, so that shrinking the steps before leaves it on that row
        w, action = rows.one_of_classes(
            data,
            (likely, likely, rest),
            op,
            name=lambda p: f"w{p[0]} {row_names(p[1], self.row_name)}",
        )
        return self.do(w, action)

    def do(self, w: int, action: Action) -> Any:
        """Worker ``w`` does ``action`` as a step of its own (:meth:`apply`, or the action's own
        ``run``); what it remembers follows the answer (``after``)."""
        if action.run is not None:
            return action.run()
        worker = self.workers[w]
        with self.external_call(worker) if action.calls_out else contextlib.nullcontext():
            got = self.apply(
                worker,
                action.shown(worker.name),
                action.model_op,
                action.impl_op,
                on_error=action.on_error,
                external_maybe=action.external_maybe,
                fenced=action.fence,
                guarantee=action.breaks,
                parts=action.parts,
            )
        if got is not None and action.after is not None:
            action.after(got)
        return got

    def apply(
        self,
        worker: Worker | None,
        label: str,
        model_op: Callable[[Any], Any],
        impl_op: Callable[[psycopg.Connection], Any],
        *,
        on_error: Callable[[], None] | None = None,
        external_maybe: Callable[[Any], None] | None = None,
        fenced: tuple[Any, int, bool] | Callable[[], tuple[Any, int, bool]] | None = None,
        guarantee: str | Callable[[Any], tuple[str, ...]] | None = None,
        parts: tuple[Callable[[Any], Any], ...] = (),
    ) -> Any:
        """Apply one operation to the model and to the implementation, and compare outcomes.

        Returns the implementation's outcome, or None when the operation failed on a fault; then
        the model keeps every possible state — both when COMMIT was in flight, and, with
        ``external_maybe``, each of those with and without the external side having acted — and
        the next observation decides. States the rows cannot tell apart (a heartbeat's lease on
        a worker that holds no run) are all kept: the operation is applied to each, and its
        answer keeps those that expect it (an answer that says nothing, ``UNKNOWN``, keeps all).
        With ``fenced=(run_id, token, owner)`` the operation is a write by an owner (``owner``:
        whether the model says the writer still owns the run): judged as a :class:`Write` — did
        the database let it write? — before the outcomes are compared. With ``guarantee``
        (``claim``, ``lease``), the operation's outcome *is* that guarantee of the contract
        (which runs a claim takes, which runs a reaper takes back): an outcome that differs from
        the model's breaks it (a function of that outcome: what it breaks). With ``parts``
        (:attr:`.steps.Action.parts`) it is several transactions: a failure may have left any
        of them landed. Every operation is judged on its own: a second operation in one rule
        first has the one before it observed."""
        self.start_step()
        self.env.ensure_alive()
        bases = [c.model for c in self.candidates]  # more than one where the rows cannot tell
        trials = [b.copy() for b in bases]
        with timings.span("check"):
            expecteds = [model_op(t) for t in trials]
        expected = expecteds[0]
        struck_before, self._struck = self._struck, False
        faulted = worker is not None and worker.faulted()
        others = [w for w in self.workers if w is not worker]
        seen = None
        try:
            conn = worker.connection() if worker else self.ws.admin()
            with watch(self.env, worker, others) if worker else contextlib.nullcontext() as seen:
                with timings.span("impl"):
                    got = impl_op(conn)
        except CommitIndeterminate:
            self.log(f"{label} -> indeterminate (the connection died during {self.commit_point})")
            self.event("indeterminate commit")
            self._lost_connection(worker, on_error)
            self._indeterminate = True
            # rows that neither state explains break what its outcome guarantees (a reaper's
            # take-back part-way: lease); where the model refuses it, also its fence: had it
            # committed, it would have changed nothing, so such rows are its write landing
            self._if_landed = broken_by(
                expected,
                Won(None) if isinstance(expected, LostRace) else None,
                fenced is not None,
                guarantee,
            )
            self.candidates = self._with_external(
                [
                    Candidate(m, committed=landed)
                    for b, t in zip(bases, trials)
                    for m, landed in ((b, False), (t, True))
                ]
                + [Candidate(m, part_way=True) for m in part_way(bases, parts)],
                external_maybe,
            )
            return None
        except (ConnectionLost, WorkerDied, ExternalCallFailed, psycopg.OperationalError) as e:
            if isinstance(e, psycopg.Error) and not is_connection_error(e):
                self._lost_connection(worker, on_error)
                self.fail(
                    f"{label}: the server refused a statement the model accepts: "
                    f"{e.sqlstate} {first_line(e)}"
                )
            really = (
                faulted
                or self._struck
                or struck_before
                or worker is None
                or isinstance(e, (WorkerDied, ExternalCallFailed))
                or worker.conn is None
                or worker.conn.closed
                or worker.conn.broken
            )
            name = {
                WorkerDied: "worker died before commit",
                ExternalCallFailed: "external call failed",
            }.get(type(e), "connection lost")
            self.log(f"{label} -> {type(e).__name__}")
            if not really:
                self._lost_connection(worker, on_error)
                self.fail(
                    f"{label}: the implementation reported a lost connection ({e}) on a "
                    "healthy link, with its connection still open: a client-side error "
                    "reported as a network failure"
                )
            self.event(name)
            self._lost_connection(worker, on_error, e)
            # of several transactions, any may have landed, all of them too
            states = [Candidate(m) for m in bases + (trials if parts else [])]
            states += [Candidate(m, part_way=True) for m in part_way(bases, parts)]
            self.candidates = self._with_external(states, external_maybe)
            return None
        except TransactionAborted as e:
            self._lost_connection(worker, on_error)
            if seen is not None and seen.blocked_by:
                who = ", ".join(seen.blocked_by)
                problem = (
                    f"{label}: waited on a lock held by {who}'s open transaction (seen "
                    "by the server: pg_blocking_pids), and was cancelled"
                )
                self.fail(
                    problem,
                    [Violation(self.lock_wait_breaks, problem)] if self.lock_wait_breaks else None,
                )
            if seen is not None and seen.hung:
                self.fail(
                    f"{label}: ran for more than a minute without waiting on any lock "
                    "(a hung statement), and was cancelled"
                )
            self.fail(f"{label}: the server refused a statement the model accepts: {e.detail}")
        except ClientError as e:
            self._lost_connection(worker, on_error)
            self.fail(f"{label}: the driver refused the implementation's call: {e.detail}")
        except psycopg.Error as e:
            self._lost_connection(worker, on_error)
            self.fail(
                f"{label}: the implementation raised {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
        # the states whose answer this is (a call that says nothing, UNKNOWN, is each one's)
        alive = [i for i, e in enumerate(expecteds) if got is UNKNOWN or e == got] or [0]
        # the fence judges the write on a state it came from
        self.model, trial, expected = bases[alive[0]], trials[alive[0]], expecteds[alive[0]]
        got = expected if got is UNKNOWN else got
        self.log(f"{label} -> {fmt(got)}")
        if fenced is not None and isinstance(got, (Won, LostRace)):
            run_id, token, owner = fenced() if callable(fenced) else fenced
            self.writes.append(
                Write(str(run_id), token, accepted=isinstance(got, Won), owner_current=owner)
            )
            if not owner and isinstance(got, LostRace) and got == expected:
                # a refusal only where the write was refused: a fence that lets a stale write
                # land (id only, unless terminal) shows no refusal, whatever the model predicted
                self._count_refusal(label, str(run_id))
        if got != expected:
            self.fail(
                f"{label}: implementation answered {fmt(got)}, the model expects {fmt(expected)}",
                otherwise=broken_by(expected, got, fenced is not None, guarantee),
            )
        if isinstance(got, LostRace):
            self.event("lost race")
        self.model = trial
        self.candidates = [Candidate(trials[i]) for i in alive]
        return got

    def _count_refusal(self, label: str, run_id: str) -> None:
        """A stale owner's write refused, counted by operation and by why the writer is stale:
        another owner holds the run now, or nobody does (it was reclaimed, or it ended). A kind
        can require each (``fence refusal: complete (re-claimed)``, ...), so a run reaches every
        fenced write in both situations, where a write without its fence, or without its
        status guard, shows."""
        view = self.prev_views.get(run_id)
        owned = (
            view is not None and self.contract is not None and view.status in self.contract.owned
        )
        self.event(
            f"fence refusal: {label.split('(')[0]} "
            f"({'re-claimed' if owned else 'no longer claimed'})"
        )

    def maybe(self, *candidates: Candidate) -> None:
        """After a step whose outcome nobody knows (an answer lost), the possible states."""
        self.candidates = list(candidates)

    @staticmethod
    def _with_external(
        cands: list[Candidate], external_maybe: Callable[[Any], None] | None
    ) -> list[Candidate]:
        if external_maybe is None:
            return cands
        out = [replace(c, external=False) for c in cands]
        for c in cands:
            acted = c.model.copy()
            external_maybe(acted)
            out.append(replace(c, model=acted, external=True))
        return out

    def _lost_connection(
        self,
        worker: Worker | None,
        on_error: Callable[[], None] | None,
        error: BaseException | None = None,
    ) -> None:
        cleanup, self._fault_cleanup = self._fault_cleanup, None
        if cleanup is not None:
            cleanup()
        if worker is not None:
            worker.abandon()
            if error is not None:
                self.lost(worker, error)
        if on_error is not None:
            on_error()

    @invariant()
    @timings.timed("check")
    def model_agrees(self) -> None:
        """Projected rows equal one possible model state (narrowing indeterminate outcomes),
        and the invariants hold."""
        self._doable = None
        if not hasattr(self, "candidates"):
            return
        self._unobserved = False
        self.clock_runs()
        real = self.observe_impl()
        matching = [c for c in self.candidates if self.observe_model(c.model) == real]
        if not matching:
            expected = self.observe_model(self.candidates[-1].model)
            more = len(self.candidates)
            self.fail(
                "the database disagrees with the model after this step:\n"
                + diff(expected, real)
                + (
                    ""
                    if more == 1
                    else f"\n(none of the {more} possible states after an indeterminate step "
                    "matched)"
                ),
                real=real,
                otherwise=self._if_landed if self._indeterminate else None,
            )
        chosen = matching[0]
        if (
            self._indeterminate
            and len({c.committed for c in matching}) == 1
            and chosen.committed is not None
        ):
            landed = "committed" if chosen.committed else "not committed"
            self.event(f"indeterminate resolved: {landed}")
            self.log(
                f"  (observed: the indeterminate step "
                f"{'committed' if chosen.committed else 'did not commit'})"
            )
        if all(c.part_way for c in matching):
            self.event("landed part-way")
            self.log("  (observed: some of its transactions landed, not all)")
        if chosen.external is not None and len({c.external for c in matching}) == 1:
            self.log(f"  (observed: the stand-in {'acted' if chosen.external else 'did not act'})")
        self._indeterminate = False
        violations = self.judge(real)
        self.stats.invariants_checked += len(self.named_invariants())
        if violations:
            self.fail("", violations)
        self.observed(chosen.model)
        for t in getattr(chosen.model, "transitions", []):
            self.stats.transitions[t[1:]] += 1
        self.model = chosen.model
        # every state the rows leave possible is kept, once each: a state they cannot show (a
        # worker's own lease while it holds no run) is decided by the answers that follow
        kept: dict[Any, Any] = {}
        for c in matching:
            kept.setdefault(self.fingerprint(c.model) if len(matching) > 1 else 0, c.model)
        self.candidates = [Candidate(m) for m in kept.values()]
        for m in kept.values():
            if hasattr(m, "transitions"):
                m.transitions.clear()
        if self.contract is not None:
            self.prev_views = self.views(real)
        self.writes, self.repeats = [], []
        self._after_block = False
        self.clock_stands()


def _rule_for(op: str):
    """The rule of operation ``op`` (see :meth:`KindCheck.act`)."""

    @precondition(lambda self: bool(self.doable(op)))
    @rule(data=st.data())
    def do_op(self, data) -> None:
        self.act(data, op)

    do_op.__name__ = do_op.__qualname__ = f"op_{op}"
    do_op.__doc__ = f"A worker does one of its {op} actions now."
    return do_op
