"""The model-versus-implementation machinery every run kind's check is built from.

How a check works
-----------------

A check is a Hypothesis :class:`RuleBasedStateMachine` whose rules are the kind's
operations *and* faults. Each operation is applied to the pure model and to the real
implementation (through a worker's own Toxiproxy link to a real PostgreSQL); the outcomes
must be equal. After every step the database rows are projected into the model's shape and
must equal the model, and the contract's six invariants must hold.

Indeterminate outcomes are first-class. When a fault cuts a connection while COMMIT is in
flight, nobody can know whether the transaction landed. The check then keeps *both* possible
model states and lets the next observation (the projection, read on a separate, unfaulted
connection) decide. It never assumes lost and never assumes done.

Faults are rules, drawn and shrunk with the operations: toxics on one worker's link (every
attribute drawn from the seed: Toxiproxy's own randomness cannot be seeded), a link taken
down, a database clock jump (libfaketime), a database crash and restart, a reply to COMMIT
lost, a COMMIT request lost, a worker that dies before COMMIT. A counterexample therefore shows
the fault schedule, minimal.

A check counts what it *observed* — transitions taken, lost races, fence rejections, reaps,
indeterminate commits and how they resolved, duplicates — not only what it injected. The CI
profile fails as vacuous when something the kind declares required was never observed.

A kind plugs in by subclassing :class:`KindCheck`: ``new_model()``, ``observe_model()``,
``observe_impl()``, ``views()``, its operation rules (which call :meth:`KindCheck.apply`),
and the events it requires.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import os
import socket
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

import psycopg
from hypothesis import HealthCheck, Phase, Verbosity, seed as hyp_seed, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from knownstate.impl.errors import (CommitIndeterminate, ConnectionLost, ExternalCallFailed, KnownstateError,
                                    TransactionAborted, is_connection_error)
from knownstate.model.contract import INVARIANTS, Contract, LostRace, Repeat, RunView, Write, check_invariants

from .cluster import ClusterError, PostgresCluster, Unavailable, open_database
from .toxi import Link, Toxic, ToxiproxyError, ToxiproxyServer

QUANTUM = 60
"""Model time is whole seconds, and every duration a check uses is a multiple of this. The
database clock keeps ticking in real time during an example; projecting its timestamps to the
nearest quantum is exact while an example lasts less than QUANTUM / 2 seconds of real time."""


class EnvironmentFault(BaseException):
    """The environment broke, not the code under test: a real part died or misbehaved.
    A BaseException so Hypothesis does not try to shrink it as a counterexample."""


class Mismatch(AssertionError):
    """The implementation disagreed with the model."""


def _record_mismatch(machine: "KindCheck", message: str) -> "Mismatch":
    type(machine).failures.append((message, list(machine.trace)))
    return Mismatch(message)


# ---------------------------------------------------------------------------------------
# The real parts of one verify run.
# ---------------------------------------------------------------------------------------


class Env:
    """Everything a run uses: the database, the Toxiproxy server, the stand-ins, the links.
    Started once per run; each example resets it (tables truncated, toxics removed, clock back)."""

    def __init__(self, db, toxiproxy: ToxiproxyServer):
        self.db = db
        self.toxiproxy = toxiproxy
        self.api = toxiproxy.client()
        self._admin: dict[str, psycopg.Connection] = {}
        self.stand_ins: dict[str, Any] = {}
        self._expect_down = False

    @classmethod
    @contextlib.contextmanager
    def open(cls, dsn: str | None = None):
        db = open_database(dsn)
        tp = ToxiproxyServer()
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(db)
                stack.enter_context(tp)
            except (ClusterError, ToxiproxyError, Unavailable, psycopg.Error) as e:
                raise EnvironmentFault(f"could not start the real parts: {e}") from None
            env = cls(db, tp)
            stack.callback(env.close)
            yield env

    def close(self) -> None:
        for conn in self._admin.values():
            with contextlib.suppress(Exception):
                conn.close()
        self._admin.clear()
        for s in self.stand_ins.values():
            with contextlib.suppress(Exception):
                s.stop()
        self.stand_ins.clear()

    # -- capabilities ----------------------------------------------------------------------
    @property
    def clock(self):
        return getattr(self.db, "clock", None)

    @property
    def can_crash(self) -> bool:
        return bool(getattr(self.db, "owns_server", False))

    def unavailable(self) -> list[str]:
        out = []
        if self.clock is None:
            out.append("db-clock-jump (the database is not one the harness owns, or libfaketime is missing)")
        if not self.can_crash:
            out.append("db-crash (the harness does not own the database server)")
        return out

    def stand_in(self, name: str, factory: Callable[[], Any]):
        if name not in self.stand_ins:
            self.stand_ins[name] = factory().start()
        return self.stand_ins[name]

    # -- databases ---------------------------------------------------------------------------
    def database(self, name: str, schema: str) -> str:
        """(Re)create database ``name`` with ``schema`` once per run."""
        stale = self._admin.pop(name, None)
        if stale is not None:
            stale.close()
        admin = self.admin("postgres")
        admin.execute(f"drop database if exists {name} with (force)")
        admin.execute(f"create database {name}")
        self.admin(name).execute(schema)
        return name

    def admin(self, dbname: str) -> psycopg.Connection:
        """The check's own connection, direct (never through a proxy): observations must not be faulted."""
        conn = self._admin.get(dbname)
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self.ensure_alive()
        try:
            conn = psycopg.connect(self.db.dsn(dbname), autocommit=True, connect_timeout=5,
                                   application_name="knownstate-observer")
        except psycopg.Error as e:
            raise EnvironmentFault(f"PostgreSQL at {self.db.host}:{self.db.port} is not answering: "
                                   f"{str(e).strip().splitlines()[0]}") from None
        self._admin[dbname] = conn
        return conn

    def query(self, dbname: str, sql: str, params: Any = None) -> list[tuple]:
        for attempt in (1, 2):
            try:
                cur = self.admin(dbname).execute(sql, params)
                return cur.fetchall() if cur.description else []
            except psycopg.Error as e:
                if not is_connection_error(e) or attempt == 2:
                    raise
                self._admin.pop(dbname, None)
        raise AssertionError("unreachable")

    def ensure_alive(self) -> None:
        if isinstance(self.db, PostgresCluster) and not self.db.running:
            raise EnvironmentFault(f"PostgreSQL ({self.db.describe()}) died, and not by an injected crash: was it "
                                   f"killed from outside? Server log tail:\n{self.db.log_tail()}")
        if not self.toxiproxy.running:
            raise EnvironmentFault("toxiproxy-server died: was it killed from outside? Nothing was left running.")

    def crash_and_restart(self) -> None:
        self.db.crash()
        for dbname in list(self._admin):
            self._admin.pop(dbname).close()
        self.db.restart()

    def now(self, dbname: str) -> dt.datetime:
        return self.query(dbname, "select now()")[0][0]

    def settle(self, dbname: str, application_name: str, grace_s: float = 2.0) -> None:
        """Wait until the server has let go of an abandoned connection's backend, so a transaction
        that lingers server-side cannot hold row locks into the next step. Polls with a deadline;
        past the grace period it terminates the backend (the end a dead client's backend meets
        anyway, once TCP notices). A COMMIT already under way is not interrupted by that."""
        deadline = time.monotonic() + grace_s
        sql = "select pid from pg_stat_activity where application_name = %s"
        while self.query(dbname, sql, (application_name,)):
            if time.monotonic() > deadline:
                self.query(dbname, "select pg_terminate_backend(pid) from pg_stat_activity where application_name = %s",
                           (application_name,))
                deadline = time.monotonic() + 10
                while self.query(dbname, sql, (application_name,)):
                    if time.monotonic() > deadline:
                        raise EnvironmentFault(f"backend {application_name} did not go away after pg_terminate_backend")
                    time.sleep(0.01)
                return
            time.sleep(0.005)

    def reset_faults(self) -> None:
        try:
            self.api.reset()
        except ToxiproxyError as e:
            raise EnvironmentFault(str(e)) from None
        if self.clock is not None:
            self.clock.reset()
        if isinstance(self.db, PostgresCluster) and not self.db.running:
            self.ensure_alive()


# ---------------------------------------------------------------------------------------
# A worker: its own connection through its own link, and a hook around COMMIT.
# ---------------------------------------------------------------------------------------


class WorkerDied(KnownstateError):
    """The worker process died (injected): its connection closed without COMMIT."""


class HookedConnection(psycopg.Connection):
    """A psycopg connection whose ``commit()`` first runs a one-shot hook. Faults use it to act at
    the most interesting instant: just before COMMIT leaves the client."""

    owner: "Worker | None" = None

    def commit(self) -> None:
        owner = self.owner
        if owner is not None and owner.before_commit is not None:
            hook, owner.before_commit = owner.before_commit, None
            hook(self)
        super().commit()


def cut_socket(conn: psycopg.Connection) -> None:
    """Close a connection the way a dying process does: the socket goes, no goodbye, no COMMIT."""
    with contextlib.suppress(Exception):
        s = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
    with contextlib.suppress(Exception):
        conn.close()


WATCHDOG_SECONDS = 5.0
"""A worker statement still running after this long is cancelled from the client. The server's own
lock_timeout and statement_timeout cannot be relied on: they are judged by the faked clock."""


@contextlib.contextmanager
def watchdog(conn: psycopg.Connection | None, seconds: float = WATCHDOG_SECONDS):
    """Cancel whatever ``conn`` runs if it takes longer than ``seconds``; yields a flag object
    whose ``fired`` says whether it had to."""
    class Flag:
        fired = False

    flag = Flag()

    def fire() -> None:
        flag.fired = True
        try:
            conn.cancel_safe(timeout=2)
        except Exception:
            cut_socket(conn)

    timer = threading.Timer(seconds, fire) if conn is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield flag
    finally:
        if timer is not None:
            timer.cancel()


class Worker:
    """One worker of the check. Its database connection goes through its own Toxiproxy link."""

    def __init__(self, env: Env, kind: str, index: int, dbname: str):
        self.env, self.kind, self.index, self.dbname = env, kind, index, dbname
        self.name = f"w{index}"
        self.link = env.api.link(f"{kind}-{self.name}-pg", env.db.host, env.db.port)
        self.conn: HookedConnection | None = None
        self._serial = itertools.count(1)
        self.app_name = ""
        self.links: list[Link] = [self.link]
        self.before_commit: Callable[[HookedConnection], None] | None = None

    def connection(self) -> HookedConnection:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.app_name = f"ks-{self.kind}-{self.name}-{next(self._serial)}"
            try:
                self.conn = HookedConnection.connect(
                    self.env.db.dsn(self.dbname, host=self.link.host, port=self.link.port),
                    application_name=self.app_name, connect_timeout=3,
                    options="-c lock_timeout=2000 -c statement_timeout=10000")
            except psycopg.Error as e:
                self.conn = None
                raise ConnectionLost(f"{self.name} connect: {str(e).strip().splitlines()[0]}") from None
            self.conn.owner = self
        return self.conn

    def abandon(self) -> None:
        """Drop the connection after an error and wait until the server has let go of it."""
        if self.conn is not None:
            cut_socket(self.conn)
            self.conn = None
        if self.app_name:
            self.env.settle(self.dbname, self.app_name)

    def clean(self) -> bool:
        """No toxic on any of its links, every link up, no COMMIT fault armed."""
        return self.before_commit is None and all(l.enabled and not l.toxics for l in self.links)

    def arm(self, hook: Callable[[HookedConnection], None]) -> None:
        """Run ``hook`` just before this worker's next COMMIT, on whatever connection it has then."""
        self.before_commit = hook


# ---------------------------------------------------------------------------------------
# What a run observed.
# ---------------------------------------------------------------------------------------


@dataclass
class Stats:
    examples: int = 0
    steps: int = 0
    invariants_checked: int = 0
    faults: Counter = field(default_factory=Counter)
    events: Counter = field(default_factory=Counter)
    transitions: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"examples": self.examples, "steps": self.steps, "invariants_checked": self.invariants_checked,
                "faults": dict(self.faults), "events": dict(self.events),
                "transitions": {f"{s} -{e}-> {t}": n for (s, e, t), n in self.transitions.items()}}


FAULT_KINDS = ("toxic", "link-down", "db-clock-jump", "db-crash", "commit-reply-lost", "commit-request-lost",
               "worker-death", "worker-stall")


# Toxics whose outcome is decided by the bytes, not by timing, so a seed replays the same run.
def toxics() -> st.SearchStrategy[Toxic]:
    stream = st.sampled_from(["upstream", "downstream"])
    return st.one_of(
        st.builds(lambda s, l, j: Toxic("latency", s, {"latency": l, "jitter": j}),
                  stream, st.integers(1, 25), st.integers(0, 5)),
        st.builds(lambda r: Toxic("bandwidth", "downstream", {"rate": r}), st.integers(16, 256)),
        st.builds(lambda a, v: Toxic("slicer", "downstream", {"average_size": a, "size_variation": v, "delay": 0}),
                  st.integers(4, 64), st.integers(0, 3)),
        st.builds(lambda t: Toxic("timeout", "upstream", {"timeout": t}), st.integers(20, 200)),
        st.just(Toxic("reset_peer", "upstream", {"timeout": 0})),
        st.builds(lambda b: Toxic("limit_data", "downstream", {"bytes": b}), st.sampled_from([0, 64, 512, 2048])),
    )


# ---------------------------------------------------------------------------------------
# The generic state machine.
# ---------------------------------------------------------------------------------------


class KindCheck(RuleBasedStateMachine):
    """Base of every kind's check. Subclasses set the class attributes and implement the hooks."""

    kind: ClassVar[str] = ""
    contract: ClassVar[Contract | None] = None
    schema: ClassVar[str] = ""
    tables: ClassVar[tuple[str, ...]] = ()
    n_workers: ClassVar[int] = 2
    required_events: ClassVar[tuple[str, ...]] = ()
    clock_jumps: ClassVar[tuple[int, ...]] = (QUANTUM, 2 * QUANTUM, 5 * QUANTUM, 6 * QUANTUM, 60 * QUANTUM, -QUANTUM)

    # Set per run by build_machine():
    env: ClassVar[Env]
    stats: ClassVar[Stats]
    dbname: ClassVar[str]
    last_trace: ClassVar[list[str]]
    failures: ClassVar[list[tuple[str, list[str]]]]
    progress: ClassVar[Callable[[Stats], None] | None] = None

    # -- hooks for the kind ----------------------------------------------------------------
    @classmethod
    def table(cls):
        """The transition table whose every row a CI run must observe."""
        return cls.contract.table

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

    def reset_example(self) -> None:
        """Reset the kind's stand-ins between examples (tables and toxics are reset here)."""

    def observed(self, model: Any) -> None:
        """Called after each step once the database agreed with ``model``: count state-based events."""

    def forget(self, worker: Worker) -> None:
        """The worker died: drop everything it held in memory."""

    # -- life cycle -------------------------------------------------------------------------
    def __init__(self) -> None:
        super().__init__()
        self._operations_always_enabled()
        self.trace: list[str] = []
        type(self).last_trace = self.trace
        if getattr(type(self), "all_traces", None) is not None:
            type(self).all_traces.append(self.trace)
        self.start_example()

    def start_example(self) -> None:
        env = self.env
        env.ensure_alive()
        env.reset_faults()
        if self.tables:
            env.query(self.dbname, f"truncate {', '.join(self.tables)} restart identity cascade")
        self.t0 = env.now(self.dbname)
        self.started = time.monotonic()
        self.workers = [Worker(env, self.kind, i, self.dbname) for i in range(self.n_workers)]
        self.reset_example()
        self.model = self.new_model()
        self.candidates = [self.model]
        self.writes: list[Write] = []
        self.repeats: list[Repeat] = []
        self.crashed = False
        self.link_faults = 0
        self._indeterminate_commit = False
        self.prev_views = self.views(self.observe_model(self.model)) if self.contract else {}
        self.stats.examples += 1
        if type(self).progress is not None:
            type(self).progress(self.stats)

    def teardown(self) -> None:
        for w in getattr(self, "workers", []):
            if w.conn is not None:
                with contextlib.suppress(Exception):
                    w.conn.close()

    def _operations_always_enabled(self) -> None:
        """Hypothesis's swarm testing switches a random subset of rules off for each example. Let it
        vary the faults (rules named ``fault_*``) but never switch off an operation: an example
        without ``send`` proves nothing about sends, and vacuity would fail on luck. Uses Hypothesis
        internals defensively: if they change, swarm testing simply applies to every rule again."""
        rs = getattr(self, "_rules_strategy", None)
        if rs is None or not all(hasattr(rs, a) for a in ("rules_strategy", "is_valid", "_enabled_rules_strategy")):
            return

        def enabled(r) -> bool:
            name = r.function.__name__
            return rs.is_valid(r) and (not name.startswith("fault_") or rs._feature_flags.is_enabled(name))

        rs._enabled_rules_strategy = rs.rules_strategy.filter(enabled)

    # -- time ---------------------------------------------------------------------------------
    def to_model_time(self, ts: dt.datetime) -> int:
        """A database timestamp as model seconds since the example started."""
        seconds = (ts - self.t0).total_seconds()
        q = round(seconds / QUANTUM) * QUANTUM
        if abs(seconds - q) >= QUANTUM / 2 - 5:
            raise EnvironmentFault(f"an example ran {time.monotonic() - self.started:.0f}s, longer than the clock "
                                   f"tolerance ({QUANTUM / 2 - 5:.0f}s): the run is too slow for this machine")
        return int(q)

    # -- the step ----------------------------------------------------------------------------
    def log(self, line: str) -> None:
        self.trace.append(line)

    def fault(self, kind: str, line: str) -> None:
        self.stats.faults[kind] += 1
        self.log(f"FAULT {line}")

    def event(self, name: str, n: int = 1) -> None:
        if n:
            self.stats.events[name] += n

    def apply(self, worker: Worker | None, label: str, model_op: Callable[[Any], Any],
              impl_op: Callable[[psycopg.Connection], Any], on_error: Callable[[], None] | None = None,
              external_maybe: Callable[[Any], None] | None = None) -> Any:
        """Apply one operation to the model and to the implementation, and compare outcomes.

        Returns the implementation's outcome, or None when the operation failed on a fault; then
        the model keeps every possible state — both when COMMIT was in flight, and, with
        ``external_maybe``, each of those with and without the external side having acted — and
        the next observation decides."""
        self.stats.steps += 1
        trial = self.model.copy()
        expected = model_op(trial)
        flag = None
        try:
            conn = worker.connection() if worker else self.env.admin(self.dbname)
            with watchdog(conn if worker else None) as flag:
                got = impl_op(conn)
        except CommitIndeterminate:
            self.log(f"{label} -> indeterminate (the connection died during COMMIT)")
            self.event("indeterminate commit")
            self._lost_connection(worker, on_error)
            trial._knownstate_committed = True
            self._indeterminate_commit = True
            self.candidates = self._with_external([self.model, trial], external_maybe)
            return None
        except (ConnectionLost, WorkerDied, ExternalCallFailed) as e:
            self.log(f"{label} -> {type(e).__name__}")
            self.event({ConnectionLost: "connection lost", WorkerDied: "worker died before commit",
                        ExternalCallFailed: "external call failed"}[type(e)])
            self._lost_connection(worker, on_error)
            self.candidates = self._with_external([self.model], external_maybe)
            return None
        except TransactionAborted as e:
            self._lost_connection(worker, on_error)
            if flag is not None and flag.fired:
                raise _record_mismatch(self, f"{label}: blocked for more than {WATCHDOG_SECONDS:.0f} s "
                                             f"(waiting on another transaction's lock?) and was cancelled") from None
            raise _record_mismatch(self, f"{label}: the server refused a statement the model accepts: {e.detail}") from None
        self.log(f"{label} -> {fmt(got)}")
        if got != expected:
            raise _record_mismatch(self, f"{label}: implementation answered {fmt(got)}, the model expects {fmt(expected)}")
        if isinstance(got, LostRace):
            self.event("lost race")
        self.model = trial
        self.candidates = [trial]
        return got

    @staticmethod
    def _with_external(models: list, external_maybe: Callable[[Any], None] | None) -> list:
        if external_maybe is None:
            return models
        out = list(models)
        for m in models:
            acted = m.copy()
            external_maybe(acted)
            out.append(acted)
        return out

    def _lost_connection(self, worker: Worker | None, on_error: Callable[[], None] | None) -> None:
        cleanup, self._fault_cleanup = getattr(self, "_fault_cleanup", None), None
        if cleanup is not None:
            cleanup()
        if worker is not None:
            worker.abandon()
        if on_error is not None:
            on_error()

    @invariant()
    def model_agrees(self) -> None:
        """Projected rows equal the model (narrowing indeterminate outcomes), and the six invariants hold."""
        if not hasattr(self, "candidates"):
            return
        real = self.observe_impl()
        matching = [m for m in self.candidates if self.observe_model(m) == real]
        if not matching:
            expected = self.observe_model(self.candidates[-1])
            raise _record_mismatch(self, "the database disagrees with the model after this step:\n"
                           + diff(expected, real)
                           + ("" if len(self.candidates) == 1 else
                              f"\n(none of the {len(self.candidates)} possible states after an indeterminate step matched)"))
        chosen = matching[0]
        committed = getattr(chosen, "_knownstate_committed", False)
        if self._indeterminate_commit and all(getattr(m, "_knownstate_committed", False) == committed for m in matching):
            self.event("indeterminate resolved: committed" if committed else "indeterminate resolved: not committed")
            self.log(f"  (observed: the indeterminate step {'committed' if committed else 'did not commit'})")
        self._indeterminate_commit = False
        if committed:
            del chosen._knownstate_committed
        self.observed(chosen)
        for t in getattr(chosen, "transitions", []):
            self.stats.transitions[t[1:]] += 1
        if hasattr(chosen, "transitions"):
            chosen.transitions.clear()
        self.model = chosen
        self.candidates = [chosen]
        violations = self.invariant_violations(real)
        if violations:
            raise _record_mismatch(self, "invariant violated: " + "; ".join(map(str, violations)))

    def invariant_violations(self, real: Any) -> list:
        """The contract's six invariants on the observed state. Kinds that are not durable runs
        (the document session) override this with their own predicates."""
        views = self.views(real)
        violations = check_invariants(self.contract, self.prev_views, views, self.writes, self.repeats)
        self.stats.invariants_checked += len(INVARIANTS)
        self.writes, self.repeats = [], []
        self.prev_views = views
        return violations

    # -- generic fault rules ---------------------------------------------------------------------
    # Preconditions keep faults sparse enough that work still flows: one faulted link at a time,
    # one armed COMMIT fault at a time, one database crash per example.
    def faulted_links(self) -> list[Link]:
        return [l for w in self.workers for l in w.links if l.toxics or not l.enabled]

    def _link(self, w: int) -> Link:
        worker = self.workers[w % self.n_workers]
        return worker.links[w // self.n_workers % len(worker.links)]

    link_faults_per_example: ClassVar[int] = 3

    def _may_fault_link(self) -> bool:
        return not self.faulted_links() and self.link_faults < self.link_faults_per_example

    @precondition(lambda self: self._may_fault_link())
    @rule(w=st.integers(0, 7), toxic=toxics())
    def fault_toxic(self, w: int, toxic: Toxic) -> None:
        self.link_faults += 1
        link = self._link(w)
        self._toxi(lambda: link.add(toxic))
        self.fault("toxic", f"toxic {link.name} {toxic.describe()}")

    @precondition(lambda self: self._may_fault_link())
    @rule(w=st.integers(0, 7))
    def fault_link_down(self, w: int) -> None:
        self.link_faults += 1
        link = self._link(w)
        self._toxi(link.down)
        self.fault("link-down", f"link down {link.name}")

    @precondition(lambda self: self.faulted_links())
    @rule()
    def heal(self) -> None:
        for link in self.faulted_links():
            self._toxi(link.clear)
            self.log(f"heal {link.name}")

    def clock_matters(self) -> bool:
        """Whether a clock jump could change anything now (kinds narrow this to keep jumps purposeful)."""
        return True

    @precondition(lambda self: self.env.clock is not None and self.clock_matters())
    @rule(data=st.data())
    def fault_clock_jump(self, data) -> None:
        seconds = data.draw(st.sampled_from(self.clock_jumps), label="seconds")
        self.env.clock.jump(seconds)
        for m in self.candidates:
            m.advance(seconds)
        self.fault("db-clock-jump", f"db clock jump {seconds:+d}s")

    @precondition(lambda self: self.env.can_crash and not self.crashed)
    @rule()
    def fault_db_crash(self) -> None:
        """At most one crash per example: a restart costs a tenth of a second."""
        self.crashed = True
        self.fault("db-crash", "database crash (SIGKILL of the postmaster) and restart")
        try:
            self.env.crash_and_restart()
        except ClusterError as e:
            raise EnvironmentFault(f"PostgreSQL did not come back after an injected crash: {e}") from None

    def arm_commit_fault(self, worker: Worker, kind: str) -> None:
        """The worker's next COMMIT meets a fault: its reply is lost (the server committed), its
        request is lost (the server did not), or the worker dies just before sending it."""
        link = worker.link

        def hook(conn: psycopg.Connection) -> None:
            if kind in ("commit-reply-lost", "commit-request-lost"):
                toxic = (Toxic("limit_data", "downstream", {"bytes": 0}) if kind == "commit-reply-lost"
                         else Toxic("reset_peer", "upstream", {"timeout": 0}))
                if any(t.name == toxic.name for t in link.toxics):
                    self._toxi(lambda: link.remove(toxic))
                self._toxi(lambda: link.add(toxic))
                self._fault_cleanup = lambda: self._toxi(lambda: link.remove(toxic))
            else:
                cut_socket(conn)
                raise WorkerDied(f"{worker.name} died before COMMIT")

        worker.arm(hook)

    def _toxi(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except ToxiproxyError as e:
            raise EnvironmentFault(str(e)) from None


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

PROFILES = {"ci": {"examples": 60, "steps": 50}, "deep": {"examples": 600, "steps": 80}}


@dataclass
class CheckResult:
    kind: str
    seed: int
    examples: int
    steps: int
    seconds: float
    stats: Stats
    failure: str | None = None
    counterexample: list[str] = field(default_factory=list)
    vacuous: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failure is None and not self.vacuous

    @property
    def counterexample_steps(self) -> int:
        return sum(1 for line in self.counterexample if not line.startswith("  "))


def required_observations(machine: type[KindCheck], env: Env) -> list[tuple[str, str]]:
    """(what, label) pairs a CI run must observe: every transition of the table and every event."""
    out = [("transition", f"{t.source} -{t.event}-> {t.target}") for t in machine.table().transitions]
    out += [("event", e) for e in machine.required_events]
    return out


def missing_observations(machine: type[KindCheck], stats: Stats, env: Env) -> list[str]:
    seen = {f"{s} -{e}-> {t}" for (s, e, t), n in stats.transitions.items() if n}
    missing = []
    for what, label in required_observations(machine, env):
        if what == "transition" and label not in seen:
            missing.append(f"transition {label}")
        elif what == "event" and not stats.events.get(label):
            missing.append(f"event '{label}'")
    return missing


def build_machine(machine: type[KindCheck], env: Env, seed: int,
                  progress: Callable[[Stats], None] | None = None) -> type[KindCheck]:
    dbname = f"ks_{machine.kind.replace('-', '_')}"
    env.database(dbname, machine.schema)
    cls = type(machine.__name__, (machine,), {"env": env, "stats": Stats(), "dbname": dbname, "last_trace": [],
                                              "failures": [], "progress": staticmethod(progress) if progress else None})
    return hyp_seed(seed)(cls)


@contextlib.contextmanager
def shrink_budget(seconds: float):
    """Bound the time Hypothesis spends shrinking one failure (its own default is 300 s); the
    counterexample reported is the smallest found within the budget."""
    from hypothesis.internal.conjecture import engine

    old = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        if old is not None:
            engine.MAX_SHRINKING_SECONDS = old


def run_check(machine: type[KindCheck], env: Env, *, examples: int, steps: int, seed: int,
              require_all: bool = True, progress: Callable[[Stats], None] | None = None,
              shrink_seconds: float = 60) -> CheckResult:
    """Run one kind's check against the real parts. Raises EnvironmentFault when a real part dies."""
    cls = build_machine(machine, env, seed, progress)
    conf = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink), report_multiple_bugs=False)
    start = time.monotonic()
    failure = None
    try:
        with shrink_budget(shrink_seconds):
            run_state_machine_as_test(cls, settings=conf)
    except EnvironmentFault:
        raise
    except Exception as e:  # the check failed: the last run is Hypothesis's shrunk replay
        failure = _describe_failure(e)
    trace = list(cls.last_trace) if failure else []
    if failure and "Flaky" in failure and cls.failures:
        # Shrinking met a replay that did not reproduce: report the smallest failure seen.
        message, trace = min(cls.failures, key=lambda f: len(f[1]))
        failure = f"{message}\n(shrinking stopped: a replay did not reproduce exactly)"
    result = CheckResult(kind=machine.kind, seed=seed, examples=cls.stats.examples, steps=cls.stats.steps,
                         seconds=time.monotonic() - start, stats=cls.stats, failure=failure,
                         counterexample=trace, unavailable=env.unavailable())
    if failure is None and require_all:
        result.vacuous = missing_observations(machine, cls.stats, env)
    return result


def _describe_failure(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    if isinstance(e, (Mismatch, AssertionError)):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}{where}: {e}"
