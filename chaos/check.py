"""The transaction engine every run kind's check is built from.

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

Concurrent blocks
-----------------

Rules run one operation at a time, which reaches many races but never two transactions that
overlap on a row. The base's ``concurrently`` rule starts two or three operations of different
workers together (each kind says what its workers can do now: :meth:`KindCheck.offers`), each
on its own thread and its own proxied connection, the implementation's code unchanged. Every
statement and COMMIT waits at a gate, and a schedule drawn from the example decides who runs
next (:mod:`.interleave`); a statement that waits on another worker's lock is seen by the
server. A fault may strike inside the block (a link cut, the database crashing while a lock is
held). The outcomes are judged by linearizability against the model (:mod:`.linearize`): some
order of the operations must explain every outcome and the rows read afterwards.

Judge first, through one door
-----------------------------

Every failure goes through :meth:`KindCheck.fail`. It first judges the real state by the
contract's invariants (and the kind's own named properties): when one is broken, the failure
names it; otherwise it shows the difference from the model. A mutant counts as caught only
when the failure names the invariant the mutant declares.

Runs directed by coverage
-------------------------

A check counts what it *observed* — transitions of the kind's table, lost races, fence
rejections, reaps, indeterminate commits and how they resolved, duplicates — not only what it
injected. A profile runs until every required transition and event was observed a few times
and a minimum number of examples ran (:class:`Profile`); only when its budget runs out first is
the run vacuous, naming what is missing. Requirements that need what this database cannot do
(a crash of a server the harness does not own) are *not covered on this database*, never
vacuous. (Hypothesis's ``target()`` was tried for steering and left out: its optimisation pass
and pareto front took more than half of a run's time and reached nothing coverage did not.)
Failing examples are kept in an example database and replayed first on later runs.

A kind plugs in by subclassing :class:`KindCheck`: ``new_model()``, ``observe_model()``,
``observe_impl()``, ``views()``, its operation rules (which call :meth:`KindCheck.apply`), the
events it requires and its fault policy.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NoReturn

import psycopg
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import seed as hyp_seed
from hypothesis.database import ExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, invariant

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
    INVARIANTS,
    Contract,
    LostRace,
    Repeat,
    RunView,
    Violation,
    Won,
    Write,
    check_invariants,
)

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from . import interleave, linearize, tools
from .faults import FaultPolicy, FaultRules, toxics
from .interleave import Op, SchedulerEnvironmentError
from .toxi import Link
from .harness import (
    QUANTUM,
    Env,
    EnvironmentFault,
    SchemaRefused,
    Stats,
    Worker,
    WorkerDied,
    Workspace,
    watch,
)

__all__ = [
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


class Failure(AssertionError):
    """The implementation broke the contract: the message says how, ``invariants`` names the
    invariants it broke (empty when the failure is a difference from the model only)."""

    def __init__(self, message: str, invariants: tuple[str, ...] = ()):
        super().__init__(message)
        self.invariants = invariants


@dataclass
class Candidate:
    """One possible state of the world after an indeterminate step."""

    model: Any
    committed: bool | None = None  # for a COMMIT whose answer was lost: whether it landed here
    external: bool | None = None  # for a call whose answer was lost: whether the stand-in acted


@dataclass(frozen=True)
class Offer:
    """An operation a worker can start now, for a concurrent block: what it does to the model and
    to the implementation, what the kind remembers of its outcome (``after``), and what its
    outcome is of the contract (``guarantee``, as in :meth:`KindCheck.apply`)."""

    label: str
    model_op: Callable[[Any], Any]
    impl_op: Callable[[psycopg.Connection], Any]
    after: Callable[[Any], None] | None = None
    guarantee: str | None = None
    among_others: Callable[[Any, Any], Any] | None = None
    """For an operation whose correct outcomes are several when others run at once (a SKIP
    LOCKED claim may skip rows another transaction holds): the model operation given what the
    implementation answered, which accepts it when it is one of them."""
    runs: frozenset = frozenset()
    """The runs it may write (a fenced write: its run; a claim: the due runs; the reaper: the
    runs whose lease lapsed), so a block can aim at a run two workers contest."""
    fenced: bool = False
    """A write by an owner, which the contract refuses once the writer lost the run."""
    once_freed: frozenset = frozenset()
    """Of its ``runs``, those it can write only once another operation freed them (a claim of
    a row whose lease lapsed: after the reaper took it back). A worker frozen inside its write
    on such a run sees the others act in that order (:meth:`_Blocks._frozen`)."""


def broken_by(expected: Any, got: Any, fenced: bool, guarantee: str | None) -> tuple[str, ...]:
    """What an outcome that differs from the model's breaks, besides what the state shows: the
    guarantee the operation's outcome is (which runs a claim or a reaper takes, which step a
    step is, a payload approval froze), if it is one; and when a write the contract refuses
    went through, or one it lets win was refused, also the fence (a write by an owner) or the
    conditional transition (any other: exactly one caller wins, and it is this one)."""
    own = (guarantee,) if guarantee else ()
    if {type(expected), type(got)} == {LostRace, Won}:
        return (("lease-fence",) if fenced else ("conditional-transition",)) + own
    return own


@dataclass(frozen=True)
class Requirement:
    """Something a run must observe: a transition of the table or an event, and what the
    database must be able to do for it to be reachable at all (``Env.capabilities()``:
    ``time-shift``, ``db-clock``, ``db-crash``)."""

    label: str
    what: str = "event"
    needs: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.what} {self.label}" if self.what == "transition" else self.label


def needs(label: str, *capabilities: str) -> Requirement:
    """A required event reachable only where the database can do ``capabilities``."""
    return Requirement(label, "event", frozenset(capabilities))


# ---------------------------------------------------------------------------------------
# Profiles: how long a run goes on.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """A run goes on until every requirement was observed ``times_each`` times and at least
    ``min_examples`` examples ran; it stops early (vacuous) when ``max_examples`` ran or
    ``budget_s`` seconds passed first."""

    name: str
    min_examples: int
    max_examples: int
    steps: int
    times_each: int
    budget_s: float
    description: str


PROFILES = {
    "ci": Profile(
        "ci",
        25,
        3000,
        30,
        3,
        240.0,
        "until every required transition and event was seen 3 times (25 examples at "
        "least, 4 minutes at most per kind)",
    ),
    "deep": Profile(
        "deep",
        1000,
        100000,
        80,
        20,
        3600.0,
        "nightly depth: 1,000 examples at least and every requirement seen 20 "
        "times (an hour at most per kind)",
    ),
}


# ---------------------------------------------------------------------------------------
# The state of one run of one kind (shared by its examples).
# ---------------------------------------------------------------------------------------


@dataclass
class RunState:
    profile: Profile
    requirements: tuple[Requirement, ...]
    capabilities: frozenset[str]
    fixed_examples: int | None = None  # --examples: exactly this many, no coverage stop
    progress: Callable[["RunState"], None] | None = None
    stats: Stats = field(default_factory=Stats)
    failures: list[tuple[str, tuple[str, ...], list[str]]] = field(default_factory=list)
    last_trace: list[str] = field(default_factory=list)
    all_traces: list[list[str]] | None = None
    started: float = field(default_factory=time.monotonic)
    stopped: str = ""
    batch: int = 0
    allow_save: bool = False

    def count(self, r: Requirement) -> int:
        if r.what == "transition":
            return sum(
                n for (s, e, t), n in self.stats.transitions.items() if f"{s} -{e}-> {t}" == r.label
            )
        return self.stats.events.get(r.label, 0)

    def reachable(self) -> list[Requirement]:
        return [r for r in self.requirements if r.needs <= self.capabilities]

    def not_covered(self) -> list[Requirement]:
        return [r for r in self.requirements if not r.needs <= self.capabilities]

    def missing(self, times: int = 1) -> list[Requirement]:
        return [r for r in self.reachable() if self.count(r) < times]

    def goal_met(self) -> str | None:
        """Between two batches: why the run stops now (None: it goes on)."""
        examples = self.stats.examples
        p = self.profile
        if self.fixed_examples is not None:
            return f"{examples} examples ran, as asked"
        if examples >= p.min_examples and not self.missing(p.times_each):
            return f"every requirement observed {p.times_each}+ times after {examples} examples"
        if examples >= p.max_examples:
            return f"the profile's {p.max_examples} examples ran"
        if time.monotonic() - self.started > p.budget_s:
            return f"the profile's budget of {p.budget_s:.0f} s was spent after {examples} examples"
        return None


class GateDatabase(ExampleDatabase):
    """Hypothesis's example database, keeping only genuine failures: an example stopped by the
    run (coverage reached, environment fault) is never saved as one. Replayed first next time."""

    def __init__(self, inner: ExampleDatabase, run: RunState):
        super().__init__()
        self.inner, self.run = inner, run

    def save(self, key: bytes, value: bytes) -> None:
        if self.run.allow_save and not key.endswith(b".pareto"):
            self.inner.save(key, value)

    def fetch(self, key: bytes):
        return self.inner.fetch(key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if self.run.allow_save or dest.startswith(src):
            self.inner.move(src, dest, value)

    def add_listener(self, f) -> None:  # pragma: no cover - no live listeners here
        pass

    def remove_listener(self, f) -> None:  # pragma: no cover
        pass


class SaveOnly(ExampleDatabase):
    """An example database that keeps new failures but hands none out for replay: for the
    batches after the first (the stored examples were replayed there) and for measurements."""

    def __init__(self, inner: ExampleDatabase):
        super().__init__()
        self.inner = inner

    def fetch(self, key: bytes):
        return iter(())

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(src, dest, value)


# ---------------------------------------------------------------------------------------
# The generic state machine.
# ---------------------------------------------------------------------------------------


class _Blocks:
    """The base's concurrent-block rule (mixed into KindCheck; see the module docstring)."""

    def offers(self, w: int) -> list[Offer]:
        """What worker ``w`` can start now in a concurrent block (default: nothing)."""
        return []

    def fingerprint(self, model: Any) -> Any:
        """A hashable value equal for model states that act the same (the search's cache key)."""
        return linearize.default_fingerprint(model)

    def _able(self) -> list[Worker]:
        return [w for w in self.workers if self.offers(w.index)]

    def _may_block(self) -> bool:
        return (
            "concurrency" in self.run.capabilities
            and len(self.candidates) == 1
            and len(self._able()) >= 2
            and all(w.clean() for w in self.workers)
        )

    def _contested(self) -> dict[Any, list[Worker]]:
        """Runs that two workers or more can write now (each with an offer naming the run)."""
        by_run: dict[Any, set[int]] = {}
        for w in self.workers:
            for o in self.offers(w.index):
                for run in o.runs:
                    by_run.setdefault(run, set()).add(w.index)
        return {
            run: [self.workers[i] for i in sorted(ws)]
            for run, ws in sorted(by_run.items(), key=lambda kv: repr(kv[0]))
            if len(ws) > 1
        }

    @precondition(lambda self: self._may_block())
    @rule(data=st.data(), aim=st.booleans())
    def concurrently(self, data, aim: bool) -> None:
        """Two or three workers start an operation each, together. Half the blocks aim at one run
        that several of them can write (where locks are waited on and fences meet)."""
        contested = self._contested() if aim else {}
        if contested:
            # a fenced write meeting another worker's write of its run is where locks are waited
            # on and fences meet: such runs twice as often as others (a key two requests race
            # for, a row two claims race for), which are never left out
            fenced = [
                run
                for run, able in contested.items()
                if any(o.fenced and run in o.runs for w in able for o in self.offers(w.index))
            ]
            run = data.draw(st.sampled_from(fenced + list(contested)), label="the run they contest")
            able = contested[run]
        else:
            run, able = None, self._able()
        n = data.draw(st.integers(2, min(3, len(able))), label="workers in the block")
        chosen = sorted(
            data.draw(
                st.lists(
                    st.sampled_from(able), min_size=n, max_size=n, unique_by=lambda w: w.index
                ),
                label="who",
            ),
            key=lambda w: w.index,
        )
        self._block(data, chosen, run)

    def race(self, data, w: int, frozen: bool = False, due: frozenset = frozenset()) -> bool:
        """Worker ``w`` (resuming from a stall) races the others on a run it can write: a block
        of its next write (a fenced one, on that run) and other workers' operations on the same
        run (the reaper taking it back, a new owner claiming or writing it), scheduled as any
        block's (:meth:`_schedule`). ``frozen``: it froze *inside* that write (:meth:`_frozen`:
        a pause between two statements of its transaction while every other worker on the run
        does a whole operation; the pause is the block's fault, no other strikes inside it).
        ``due``: the runs of the write it was about to make (empty: any it holds). False when no
        other worker can touch its runs."""
        mine = {run for o in self.offers(w) if o.fenced for run in o.runs}  # the runs it holds
        contested = {
            run: ws
            for run, ws in self._contested().items()
            if run in mine and any(x.index == w for x in ws)
        }
        contested = {run: ws for run, ws in contested.items() if run in due} or contested
        if (
            not contested
            or "concurrency" not in self.run.capabilities
            or not all(x.clean() for x in self.workers)
            or len(self.candidates) > 1
        ):
            return False
        run = data.draw(st.sampled_from(list(contested)), label="the run they race on")
        others = [x for x in contested[run] if x.index != w]
        if frozen:
            racers = others
        else:
            n = data.draw(st.integers(1, min(2, len(others))), label="how many race it")
            racers = data.draw(
                st.lists(
                    st.sampled_from(others), min_size=n, max_size=n, unique_by=lambda x: x.index
                ),
                label="who races it",
            )
        stalled = self.workers[w]
        writes = [o for o in self.offers(w) if o.fenced and run in o.runs]
        schedule = None
        if frozen:
            schedule = lambda data, names, offers: self._frozen(  # noqa: E731
                data,
                stalled.name,
                [n for n in names if n != stalled.name],
                [n for n in names if run in offers[n].once_freed],
            )
        self._block(
            data,
            sorted([stalled, *racers], key=lambda x: x.index),
            run,
            only={stalled.name: writes},
            schedule=schedule,
            faults=not frozen,
        )
        return True

    @staticmethod
    def _schedule(data, names: list[str]) -> Callable[[list[str]], str]:
        """The block's schedule, drawn as PCT draws it (Burckhardt et al., probabilistic
        concurrency testing): a priority order of the workers and up to two change points, steps
        after which the worker then on top drops to the bottom. The highest-priority worker that
        can run takes each step. A race of depth d (one read, then others' commits, then the
        write) needs d - 1 change points, so short draws reach it often, and the schedule shrinks
        towards running the workers one after another."""
        order = list(data.draw(st.permutations(names), label="priority"))
        changes = set(
            data.draw(
                st.lists(st.integers(1, 2 * len(names)), max_size=2, unique=True),
                label="priority changes after steps",
            )
        )
        step = 0

        def choose(options: list[str]) -> str:
            nonlocal step
            step += 1
            if step - 1 in changes:
                top = next(n for n in order if n in options)
                order.remove(top)
                order.append(top)
            return next(n for n in order if n in options)

        return choose

    @staticmethod
    def _frozen(
        data, stalled: str, others: list[str], later: list[str] = ()
    ) -> Callable[[list[str]], str]:
        """The schedule of a worker frozen inside its operation (a GC pause, a suspended VM,
        between two statements of its transaction, holding what it locked): it runs its first
        statements (after each one, whether it freezes there is drawn: after the first, three
        times in four), then the others run their whole operations one after another (one that
        waits on a lock the frozen worker holds steps aside), then it finishes. The others' order is
        drawn, except that those in ``later`` (which can write the run only once another
        operation freed it: a claim of a row whose lease lapsed) come after the rest. Shrinks
        towards never freezing: the stalled worker's whole write, then the others'."""
        drawn = data.draw(st.permutations(others), label="the others' order")
        order = sorted(drawn, key=lambda n: n in later)
        frozen = False

        def choose(options: list[str]) -> str:
            nonlocal frozen
            if not frozen and stalled in options:
                frozen = (
                    data.draw(
                        st.integers(0, 3), label=f"{stalled} freezes after this step (unless 0)"
                    )
                    > 0
                )
                return stalled
            return next((n for n in order if n in options), stalled)

        return choose

    def _unowned(self, model: Any, runs: frozenset) -> bool:
        """Whether, in ``model``, one of ``runs`` is in a status nobody owns it in."""
        views = self.views(self.observe_model(model)) if self.contract is not None else {}
        return any(
            str(r) in views and views[str(r)].status not in self.contract.owned for r in runs
        )

    def _ended_then_changed(self, states: tuple, real: Any) -> tuple[str, ...]:
        """``terminal-answers-from-receipts`` when a run is terminal in one of ``states`` (where
        an order of a block's operations stopped) and its record differs in the rows read after
        the block: whatever ran after that point changed a run that had ended. (The other
        transition invariants are not judged across a block: several legal moves in a row look
        like one the table does not have.)"""
        if self.contract is None or not states:
            return ()
        after = self.views(real)
        for m in states:
            ended = {
                r: v
                for r, v in self.views(self.observe_model(m)).items()
                if self.contract.is_terminal(v.status) and r in after
            }
            if any(
                v.invariant == "terminal-answers-from-receipts"
                for v in check_invariants(self.contract, ended, {r: after[r] for r in ended})
            ):
                return ("terminal-answers-from-receipts",)
        return ()

    def _block(
        self,
        data,
        chosen: list[Worker],
        run: Any,
        only: dict[str, list[Offer]] | None = None,
        schedule: Callable[..., Callable[[list[str]], str]] | None = None,
        faults: bool = True,
    ) -> None:
        """Run one block of ``chosen`` workers' operations (aimed at ``run`` when given; a worker
        named in ``only`` does one of those offers), scheduled by ``schedule(data, names,
        offers)`` (default: drawn as :meth:`_schedule` draws it); a fault may strike inside it
        unless ``faults`` is False."""

        def choices(w: Worker) -> list[Offer]:
            if only and only.get(w.name):
                return only[w.name]
            mine = self.offers(w.index)
            aimed = [o for o in mine if run in o.runs]
            return aimed or mine

        offers = {
            w.name: data.draw(st.sampled_from(choices(w)), label=f"{w.name} does") for w in chosen
        }
        self.start_step(len(chosen))
        for w in chosen:
            w.ready()  # a connection the server dropped (a crash) is replaced before the block
        ops = [Op(w.name, offers[w.name].label, w.conn, offers[w.name].impl_op) for w in chosen]
        struck: list[Link] = []
        # one block in three meets a fault, between two of its steps (most blocks must run to
        # their end: a race needs every operation in it to reach its writes)
        when = (
            data.draw(st.sampled_from([None, None, 1, 2, 3, 4]), label="a fault before step")
            if faults
            else None
        )
        steps = 0

        def between(block) -> None:
            nonlocal steps
            steps += 1
            if struck or steps != when:
                return
            fate = data.draw(
                st.sampled_from(
                    [f"cut {w.name}" for w in chosen] + (["crash"] if self._may_crash() else [])
                ),
                label="fault in the block",
            )
            if fate == "crash":
                self.crashes += 1
                struck.append(None)
                self.stats.faults["db-crash"] += 1
                block.fault(
                    "database crash (SIGKILL of the postmaster) and restart",
                    self.env.crash_and_restart,
                    lost=[w.name for w in chosen],
                )
            else:
                worker = next(w for w in chosen if w.name == fate.split()[1])
                struck.append(worker.link)
                self.stats.faults["link-down"] += 1
                block.fault(f"link down {worker.link.name}", worker.link.down, lost=[worker.name])

        names = [w.name for w in chosen]
        choose = (
            schedule(data, names, offers) if schedule is not None else self._schedule(data, names)
        )
        try:
            res = self.ws.scheduler().run(ops, choose, between=between)
        except SchedulerEnvironmentError as e:
            raise EnvironmentFault(f"a concurrent block could not run: {e}") from None
        for link in struck:
            if link is not None:
                self._toxi(link.clear)
        self.log("CONCURRENTLY " + " | ".join(f"{w.name} {offers[w.name].label}" for w in chosen))
        self.trace.extend(f"  {line}" for line in res.trace[1:])
        self.stats.events["concurrent block"] += 1
        self.event("lock wait in a block", res.waits)
        results = res.by_worker()
        for w in chosen:
            r = results[w.name]
            if r.sqlstate == "40P01":
                self.event("deadlock victim")
            elif r.sqlstate == "40001":
                self.event("serialization failure")
            if r.error is not None:
                self._lost_connection(w, None, r.error if not r.transient else None)

        def model_op(w: Worker) -> Callable[[Any], Any]:
            offer, r = offers[w.name], results[w.name]
            if offer.among_others is not None and r.error is None:
                return lambda m: offer.among_others(m, r.value)
            return offer.model_op

        # as in a sequential step, an operation that raised on a lost connection, a dead worker or
        # a failed external call committed nothing (a COMMIT in flight is indeterminate)
        history = interleave.history(
            res,
            {w.name: model_op(w) for w in chosen},
            no_effect=(ConnectionLost, WorkerDied, ExternalCallFailed),
        )
        self._after_block = True  # a run may have moved twice: the linearization judges moves
        real = self.observe_impl()
        verdict = linearize.check(
            history,
            [c.model for c in self.candidates],
            fingerprint=self.fingerprint,
            final=linearize.FinalState(real, self.observe_model),
        )
        if not verdict.ok:
            named: tuple[str, ...] = ()
            refused = verdict.refused_anywhere or tuple(
                (op, answers, ())
                for (op, _), answers in zip(verdict.next_refused, verdict.next_answers)
            )
            for op, answers, states in refused:
                offer = offers[op.client]
                for answer in answers or (None,):
                    named += broken_by(answer, op.output, offer.fenced, offer.guarantee)
                if (
                    offer.fenced
                    and isinstance(op.output, Won)
                    and any(self._unowned(m, offer.runs) for m in states)
                ):
                    # a stale owner's write landed on a run nobody holds: no status guard
                    named += ("conditional-transition",)
                named += self._ended_then_changed(states, real)
            self.fail(
                "\n".join(verdict.explain()),
                real=real,
                otherwise=named or ("conditional-transition",),
            )
        self.candidates = [Candidate(m) for m in verdict.final_states]
        if any(op.ret is None for op in history):
            self.event("indeterminate commit in a block")
        for w in chosen:
            r = results[w.name]
            if r.error is None:
                if isinstance(r.value, LostRace):
                    self.event("lost race")
                if offers[w.name].after is not None:
                    offers[w.name].after(r.value)


class KindCheck(FaultRules, _Blocks, RuleBasedStateMachine):
    """Base of every kind's check. Subclasses set the class attributes and implement the hooks."""

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
    lock_wait_breaks: ClassVar[str | None] = None
    """The invariant a worker's wait on another worker's lock breaks in this kind (None: such a
    wait is reported as a failure without naming one)."""

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

    def new_model(self) -> Any:
        raise NotImplementedError

    def observe_model(self, model: Any) -> Any:
        """The model's observable state, in the same shape observe_impl() returns."""
        raise NotImplementedError

    def observe_impl(self) -> Any:
        """Read the real state (rows, stand-in records) on the check's own connections."""
        raise NotImplementedError

    def views(self, observation: Any) -> dict[str, RunView]:
        raise NotImplementedError

    def kind_violations(self, real: Any) -> list[Violation]:
        """The kind's own named properties (``own_invariants``), judged on the real state."""
        return []

    def reset_example(self) -> None:
        """Reset the kind's stand-ins between examples (tables and toxics are reset here)."""

    def observed(self, model: Any) -> None:
        """Called after each step once the database agreed with ``model``: count events."""

    def forget(self, worker: Worker) -> None:
        """The worker died: drop everything it held in memory."""

    def lost(self, worker: Worker, error: BaseException) -> None:
        """An operation of ``worker`` failed on a fault (``error``: a lost connection, a death
        before COMMIT, an external call unanswered). Default: nothing (``apply``'s ``on_error``
        says what the operation loses)."""

    # -- life cycle -------------------------------------------------------------------------
    def __init__(self) -> None:
        super().__init__()
        run = type(self).run
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
        self.writes: list[Write] = []
        self.repeats: list[Repeat] = []
        self._indeterminate = False
        self._if_landed: tuple[str, ...] = ()
        self._unobserved = False
        self._struck = False
        self.prev_views = self.views(self.observe_model(self.model)) if self.contract else {}
        run.stats.examples += 1
        if run.progress is not None:
            run.progress(run)

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
        """A database timestamp as model seconds since the example started."""
        seconds = (ts - self.t0).total_seconds() + getattr(self.env.clock, "shifted", 0)
        q = round(seconds / QUANTUM) * QUANTUM
        if abs(seconds - q) >= QUANTUM / 2 - 5:
            raise EnvironmentFault(
                f"an example ran {time.monotonic() - self.started:.0f} s, longer than the clock "
                f"tolerance ({QUANTUM / 2 - 5:.0f} s): the machine is too slow or too loaded"
            )
        return int(q)

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
        self.stats.steps += n

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
        judged = violations is None
        if judged:
            violations = self._judge_safely(real)
        names = list(dict.fromkeys((otherwise,) if isinstance(otherwise, str) else otherwise or ()))
        extra = [n for n in names if n not in {v.invariant for v in violations}] if judged else []
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
        self.run.failures.append((message, names, list(self.trace)))
        self.run.allow_save = True
        raise Failure(message, names)

    def _judge_safely(self, real: Any) -> list[Violation]:
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
        guarantee: str | None = None,
    ) -> Any:
        """Apply one operation to the model and to the implementation, and compare outcomes.

        Returns the implementation's outcome, or None when the operation failed on a fault; then
        the model keeps every possible state — both when COMMIT was in flight, and, with
        ``external_maybe``, each of those with and without the external side having acted — and
        the next observation decides. With ``fenced=(run_id, token, owner)`` the operation is a
        write by an owner (``owner``: whether the model says the writer still owns the run):
        judged as a :class:`Write` — did the database let it write? — before the outcomes are
        compared. With ``guarantee`` (``claim``, ``lease``), the operation's outcome *is* that
        guarantee of the contract (which runs a claim takes, which runs a reaper takes back): an
        outcome that differs from the model's breaks it. Every operation is judged on its own: a
        second operation in one rule first has the one before it observed."""
        self.start_step()
        self.env.ensure_alive()
        base = self.model
        trial = base.copy()
        expected = model_op(trial)
        struck_before, self._struck = self._struck, False
        faulted = worker is not None and worker.faulted()
        others = [w for w in self.workers if w is not worker]
        seen = None
        try:
            conn = worker.connection() if worker else self.ws.admin()
            with watch(self.env, worker, others) if worker else contextlib.nullcontext() as seen:
                got = impl_op(conn)
        except CommitIndeterminate:
            self.log(f"{label} -> indeterminate (the connection died during COMMIT)")
            self.event("indeterminate commit")
            self._lost_connection(worker, on_error)
            self._indeterminate = True
            # the model refuses it: had it committed, it would have changed nothing; rows that
            # neither state explains are then its refused write landing
            self._if_landed = (
                broken_by(expected, Won(None), fenced is not None, guarantee)
                if isinstance(expected, LostRace)
                else ()
            )
            self.candidates = self._with_external(
                [Candidate(base, committed=False), Candidate(trial, committed=True)], external_maybe
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
            self.candidates = self._with_external([Candidate(base)], external_maybe)
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
        self.log(f"{label} -> {fmt(got)}")
        if fenced is not None and isinstance(got, (Won, LostRace)):
            run_id, token, owner = fenced() if callable(fenced) else fenced
            self.writes.append(
                Write(str(run_id), token, accepted=isinstance(got, Won), owner_current=owner)
            )
            if not owner and got == expected:
                self._count_refusal(label, str(run_id))
        if got != expected:
            self.fail(
                f"{label}: implementation answered {fmt(got)}, the model expects {fmt(expected)}",
                otherwise=broken_by(expected, got, fenced is not None, guarantee),
            )
        if isinstance(got, LostRace):
            self.event("lost race")
        self.model = trial
        self.candidates = [Candidate(trial)]
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
        out = [Candidate(c.model, c.committed, external=False) for c in cands]
        for c in cands:
            acted = c.model.copy()
            external_maybe(acted)
            out.append(Candidate(acted, c.committed, external=True))
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
    def model_agrees(self) -> None:
        """Projected rows equal one possible model state (narrowing indeterminate outcomes),
        and the invariants hold."""
        if not hasattr(self, "candidates"):
            return
        self._unobserved = False
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
        if self._indeterminate and len({c.committed for c in matching}) == 1:
            landed = "committed" if chosen.committed else "not committed"
            self.event(f"indeterminate resolved: {landed}")
            self.log(
                f"  (observed: the indeterminate step "
                f"{'committed' if chosen.committed else 'did not commit'})"
            )
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
        if hasattr(chosen.model, "transitions"):
            chosen.model.transitions.clear()
        self.model = chosen.model
        self.candidates = [Candidate(chosen.model)]
        if self.contract is not None:
            self.prev_views = self.views(real)
        self.writes, self.repeats = [], []
        self._after_block = False


def fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:297] + "..."


def diff(expected: Any, real: Any) -> str:
    if isinstance(expected, tuple) and isinstance(real, tuple):
        lines = []
        for i in range(max(len(expected), len(real))):
            e = expected[i] if i < len(expected) else "(absent)"
            r = real[i] if i < len(real) else "(absent)"
            if e != r:
                lines.append(f"  model:    {fmt(e)}\n  database: {fmt(r)}")
        if lines:
            return "\n".join(lines)
    return f"  model:    {fmt(expected)}\n  database: {fmt(real)}"


# ---------------------------------------------------------------------------------------
# Running a check.
# ---------------------------------------------------------------------------------------


@dataclass
class CheckResult:
    kind: str
    seed: int
    examples: int
    steps: int
    seconds: float
    stats: Stats
    profile: str = "ci"
    failure: str | None = None
    invariants: tuple[str, ...] = ()
    counterexample: list[str] = field(default_factory=list)
    vacuous: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)
    stopped: str = ""
    batch: int = 0

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.vacuous

    @property
    def status(self) -> str:
        return "passed" if self.passed else ("FAILED" if self.failure else "VACUOUS")

    @property
    def counterexample_steps(self) -> int:
        return sum(1 for line in self.counterexample if not line.startswith("  "))


def build_machine(
    machine: type[KindCheck], env: Env, seed: int, run: RunState, ws: Workspace
) -> type[KindCheck]:
    cls = type(machine.__name__, (machine,), {"env": env, "ws": ws, "run": run})
    return hyp_seed(seed)(cls)


SHRINKS = 1000
"""Replays at most to shrink a failure (``--shrinks``): a count, so the same seed gives the same
counterexample on any machine, whatever its load. (At 500, 4 of the outbox catalogue's 70 runs
at seeds 836747..836751 stopped above 15 steps; a larger budget only goes on from where a
smaller one stopped.)"""

BATCH = 20
"""Examples per batch. Hypothesis runs a batch; between batches the run checks its goal. Batch
``i`` of seed ``s`` always runs the same examples, so a failure replays from its batch alone."""


def batch_seed(seed: int, batch: int) -> int:
    if batch == 0:
        return seed
    digest = hashlib.sha256(f"knownstate:{seed}:{batch}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@contextlib.contextmanager
def shrink_budget(replays: int):
    """Bound shrinking by a count of replays (Hypothesis's own bounds are 500 successful shrinks
    and five minutes): deterministic, whatever the machine's load. Time never stops a shrink
    here. Past the budget the smallest failing example found so far is the counterexample."""
    from hypothesis.internal.conjecture import engine

    runner = engine.ConjectureRunner
    original = runner.test_function

    def counted(self, data):
        try:
            return original(self, data)
        finally:
            if self.finish_shrinking_deadline is not None:
                self._knownstate_replays = getattr(self, "_knownstate_replays", 0) + 1
                if self._knownstate_replays >= replays:
                    self.exit_with(engine.ExitReason.max_shrinks)

    old = engine.MAX_SHRINKING_SECONDS
    runner.test_function, engine.MAX_SHRINKING_SECONDS = counted, 10**9
    try:
        yield
    finally:
        runner.test_function, engine.MAX_SHRINKING_SECONDS = original, old


def run_check(
    machine: type[KindCheck],
    env: Env,
    *,
    seed: int,
    profile: str | Profile = "ci",
    examples: int | None = None,
    steps: int | None = None,
    require_all: bool = True,
    progress: Callable[[RunState], None] | None = None,
    shrinks: int = SHRINKS,
    database: ExampleDatabase | None = None,
    database_key: str | None = None,
    traces: list[list[str]] | None = None,
    start_batch: int = 0,
) -> CheckResult:
    """Run one kind's check against the real parts. ``examples`` fixes the number of examples
    (one batch, no coverage stop); otherwise the profile directs the run, batch after batch from
    ``start_batch``. Raises EnvironmentFault when a real part dies, carrying what the run had
    done so far in its ``partial`` (a CheckResult; ``stopped`` says why)."""
    prof = PROFILES[profile] if isinstance(profile, str) else profile
    run = RunState(
        prof,
        machine.requirements(),
        env.capabilities(),
        fixed_examples=examples,
        progress=progress,
        all_traces=traces,
    )
    try:
        ws = env.workspace(machine.kind, machine.schema)
    except SchemaRefused as e:
        return _result(machine, env, seed, run, prof, str(e), (), [])
    failure: str | None = None
    invariants: tuple[str, ...] = ()
    trace: list[str] = []
    run.batch = start_batch
    with shrink_budget(shrinks), contextlib.closing(ws):
        while True:
            cls = build_machine(machine, env, batch_seed(seed, run.batch), run, ws)
            db = None  # stored examples are replayed in the first batch; all batches save
            if database is not None:
                db = GateDatabase(database if run.batch == start_batch else SaveOnly(database), run)
            conf = settings(
                max_examples=examples or BATCH,
                stateful_step_count=steps or prof.steps,
                deadline=None,
                database=db,
                suppress_health_check=list(HealthCheck),
                verbosity=Verbosity.quiet,
                report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
            )
            test = get_state_machine_test(cls, settings=conf)
            key = database_key or f"knownstate:{machine.kind}"
            test.hypothesis.inner_test._hypothesis_internal_add_digest = key.encode()
            try:
                test()
            except EnvironmentFault as e:
                raise _interrupted(e, machine, env, seed, run, prof)
            except Exception as e:  # the check failed: the last run is Hypothesis's shrunk replay
                problem = env.health()
                if problem:
                    raise _interrupted(
                        EnvironmentFault(problem), machine, env, seed, run, prof
                    ) from None
                failure, invariants, trace = _failure_of(e, run)
                run.stopped = f"a failure in batch {run.batch}"
                break
            run.stopped = run.goal_met() or ""
            if run.stopped:
                break
            run.batch += 1
    problem = env.health()
    if problem:
        raise _interrupted(EnvironmentFault(problem), machine, env, seed, run, prof)
    result = _result(machine, env, seed, run, prof, failure, invariants, trace)
    if failure is None and require_all:
        result.vacuous = [
            f"{r.what} '{r.label}' (seen {run.count(r)} times)"
            if run.count(r)
            else f"{r.what} '{r.label}'"
            for r in run.missing(1)
        ]
    return result


def _interrupted(
    e: EnvironmentFault, machine: type[KindCheck], env: Env, seed: int, run: RunState, prof: Profile
) -> EnvironmentFault:
    """``e``, carrying what the run had done when the environment failed (its ``partial``).
    When a part died, the fault names it, whatever symptom raised ``e`` (a refused connection,
    a Toxiproxy call unanswered)."""
    problem = env.health()
    if problem and str(e) != problem:
        e = EnvironmentFault(problem)
    run.stopped = f"the environment failed in batch {run.batch}: {e}"
    if e.partial is None:
        e.partial = _result(machine, env, seed, run, prof, None, (), [])
    return e


def _result(
    machine: type[KindCheck],
    env: Env,
    seed: int,
    run: RunState,
    prof: Profile,
    failure: str | None,
    invariants: tuple[str, ...],
    trace: list[str],
) -> CheckResult:
    return CheckResult(
        kind=machine.kind,
        seed=seed,
        examples=run.stats.examples,
        steps=run.stats.steps,
        seconds=time.monotonic() - run.started,
        stats=run.stats,
        profile=prof.name,
        failure=failure,
        invariants=invariants,
        counterexample=trace,
        batch=run.batch,
        unavailable=env.unavailable(),
        not_covered=[r.key for r in run.not_covered()],
        coverage={r.key: run.count(r) for r in run.reachable()},
        stopped=run.stopped,
    )


def _shortest(run: RunState) -> tuple[str, tuple[str, ...], list[str]]:
    message, names, trace = min(
        run.failures, key=lambda f: (len([l for l in f[2] if not l.startswith("  ")]), len(f[2]))
    )
    return message, names, trace


def _failure_of(e: BaseException, run: RunState) -> tuple[str, tuple[str, ...], list[str]]:
    if isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    if isinstance(e, Failure) and run.failures and run.failures[-1][0] == str(e):
        return run.failures[-1]
    if run.failures:  # a replay that did not reproduce exactly (Flaky): the shortest seen
        message, names, trace = _shortest(run)
        if not isinstance(e, Failure):
            message += "\n(shrinking stopped: a replay did not reproduce exactly)"
        return message, names, trace
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}{where}: {e}", (), list(run.last_trace)
