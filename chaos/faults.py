"""Faults: what each one does, apart from when it may happen (Jepsen's nemesis and generator).

A kind declares *when* as data, a :class:`FaultPolicy`: how many operations pass between two
faults, when a faulted link heals by itself, how many link faults and database crashes an
example may have, which COMMIT faults apply, how far a stalled worker freezes. The rules below
are the base's, and a kind never re-declares one: it only answers a few questions about its
own state (which workers have work to do, which hold a live lease, what the others do while
one is frozen) through the hooks of :class:`FaultRules`.

Every fault is a rule, drawn and shrunk by Hypothesis with the operations, and every value a
fault uses (a toxic's attributes, a clock jump) is drawn from the seed: Toxiproxy's own
randomness cannot be seeded, so no toxic is left to chance.

The faults
----------

toxic, link-down
    On one worker's own Toxiproxy link (to PostgreSQL, or to a stand-in): a toxic whose outcome
    is decided by the bytes, not by timing, or the link disabled. Healed by the ``heal`` rule, or
    by itself ``policy.heal_after`` operations later.
db-clock-jump
    The database server's ``now()`` moves (libfaketime, or the time shift on a database the
    harness does not own). Drawn only when the kind says the clock matters now.
db-crash
    SIGKILL of the postmaster and every backend, then a restart on the same data: between two
    steps, or with a worker's transaction open at its COMMIT.
commit-reply-lost, commit-request-lost, worker-death
    At a worker's next COMMIT: the server commits and the answer is lost; the request is lost
    and nothing commits; the worker dies just before sending it. The worker takes its turn at
    once, so the fault meets real work and leaves nothing behind. On a connection in
    autocommit (a library that insists on it) they meet the worker's next statement, which
    commits on its own (``commit_point``).
reply-lost
    A stand-in acts on a worker's next request and the answer never arrives.
worker-stall
    A worker holding a live lease freezes (a GC pause, a suspended VM) past it; the others carry
    on; it resumes at once or later, and its writes must then be fenced.

One-shot faults that meet a worker's turn at once (the COMMIT faults, a lost reply) leave
nothing behind, so they neither wait for ``policy.gap`` nor hold back the next fault.

One vocabulary
--------------

:data:`FAULTS` names every fault, the check's and the soak's nemesis's
(:mod:`knownstate.chaos.nemesis`), once: a fault both inject has one name (the soak's
SIGSTOP past the lease is a ``worker-stall``, its links cut a ``link-down``, its clock bump a
``db-clock-jump``), and what only real processes can suffer has a name of its own
(``process-kill``, ``worker-hold``, ``db-clock-strobe``, ``stand-in-slow``). The check's
policy, the nemesis, the reports and the timeline read these names and no others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from . import rows, timings
from .harness import QUANTUM, HookedConnection, Worker, WorkerDied, cut_socket
from .toxi import Link, Toxic, ToxiproxyError

if TYPE_CHECKING:
    from .check import KindCheck

FAULTS: dict[str, str] = {
    "toxic": "a toxic on one worker's own link, decided by the bytes, not by timing",
    "link-down": "one worker's own links disabled (in a soak: to the database, the stand-in)",
    "db-clock-jump": "the database's now() moves (libfaketime), forward or back",
    "db-crash": "SIGKILL of the postmaster and every backend, then a restart on the same data",
    "commit-reply-lost": "at a worker's next COMMIT: the server commits, the answer is lost",
    "commit-request-lost": "at a worker's next COMMIT: the request is lost, nothing commits",
    "worker-death": "a worker dies just before sending its COMMIT",
    "worker-stall": "a worker freezes past its lease (the soak: SIGSTOP), then resumes",
    "reply-lost": "a stand-in acts on a worker's next request and its answer never arrives",
    "stand-in-refuses": "the stand-in answers the next calls with an error (503, 422), not acting",
    # What only real processes suffer (the soak's nemesis):
    "process-kill": "SIGKILL of one process, a new incarnation after the fault's duration",
    "worker-hold": "a worker-stall aimed at a stale owner, from the server's view: stopped while "
    "it holds a lease between transactions, resumed once its run was taken back",
    "db-clock-strobe": "the database clock flips between two offsets, then settles back",
    "stand-in-slow": "latency on every worker's link to the stand-in, a part of the lease per call",
    # Faults of one kind's check:
    "app-clock-skew": "an application's clock set apart from the database's (the branch reset: "
    "one worker's; a described queue's schedules: the clock the adapter is given)",
    "draft-store": "document session: the browser's draft store starts failing",
}
"""Every fault, by the one name the check, the nemesis, the reports and the timeline use."""
FAULT_KINDS = tuple(FAULTS)
COMMIT_FAULTS = ("commit-reply-lost", "commit-request-lost", "worker-death", "db-crash")
SOAK_PROCESS_FAULTS = ("process-kill", "worker-stall", "link-down", "worker-hold")
"""What the soak's nemesis does to one process at a time (in the order its schedule draws)."""
SOAK_GLOBAL_FAULTS = (
    "db-clock-jump",
    "db-clock-strobe",
    "db-crash",
    "stand-in-refuses",
    "stand-in-slow",
)
"""What the soak's nemesis does to every process at once (the database, its clock, the stand-in)."""
SOAK_FAULTS = SOAK_PROCESS_FAULTS + SOAK_GLOBAL_FAULTS


@dataclass(frozen=True)
class FaultPolicy:
    """When faults may fire: data a kind sets (the rules are the base's)."""

    gap: int = 2
    """Operations after a fault before the next link fault, clock jump or crash may fire."""
    heal_after: int = 4
    """Operations a faulted link stays faulted; then it heals by itself (faults are transient)."""
    link_faults: int = 3
    """Toxics and link-downs per example."""
    db_crashes: int = 1
    """Database crashes per example (a restart costs about a tenth of a second)."""

    crash_between_steps: bool = True
    """Whether a crash may also fire between two steps (it always may at a COMMIT, when
    ``db-crash`` is one of ``commit_faults``)."""
    commit_faults: tuple[str, ...] = ("commit-reply-lost", "commit-request-lost", "worker-death")
    """What may meet a worker's next COMMIT (a subset of :data:`COMMIT_FAULTS`)."""
    clock_jumps: tuple[int, ...] = (
        QUANTUM,
        2 * QUANTUM,
        5 * QUANTUM,
        6 * QUANTUM,
        60 * QUANTUM,
        -QUANTUM,
    )
    """Database clock jumps, in seconds."""
    db_clock_moves_model: bool = True
    """False when no guard of the kind reads the database clock: a jump must then move nothing."""
    stall: int | None = None
    """Seconds a stalled worker freezes (its lease + a quantum); None: the kind has no lease."""
    stall_clock: str = "db"
    """The clock its lease is judged by: ``db`` (jump the database clock) or ``app`` (the model's
    application clocks move; the kind owns them)."""
    reply_lost: bool = False
    """Whether a stand-in's answer to a worker's next request may be lost."""
    swarm: frozenset[str] = frozenset({"toxic", "link-down", "db-clock-jump", "db-crash"})
    """Fault kinds Hypothesis's swarm testing may switch off for a whole example (the others,
    and every operation, stay on, so no required event depends on the luck of the switch)."""

    def __post_init__(self) -> None:
        names = set(self.swarm) - set(FAULTS)
        if names:
            raise ValueError(f"unknown fault {sorted(names)} in swarm: choose from {FAULT_KINDS}")
        unknown = set(self.commit_faults) - set(COMMIT_FAULTS)
        if unknown:
            raise ValueError(f"unknown COMMIT fault {sorted(unknown)}: choose from {COMMIT_FAULTS}")
        if self.stall_clock not in ("db", "app"):
            raise ValueError(f"stall_clock must be 'db' or 'app', not {self.stall_clock!r}")


def toxics() -> st.SearchStrategy[Toxic]:
    """Toxics whose outcome is decided by the bytes, not by timing, so a seed replays the same
    run."""
    stream = st.sampled_from(["upstream", "downstream"])
    return st.one_of(
        st.builds(
            lambda s, l, j: Toxic("latency", s, {"latency": l, "jitter": j}),
            stream,
            st.integers(1, 25),
            st.integers(0, 5),
        ),
        st.builds(lambda r: Toxic("bandwidth", "downstream", {"rate": r}), st.integers(16, 256)),
        st.builds(
            lambda a, v: Toxic(
                "slicer", "downstream", {"average_size": a, "size_variation": v, "delay": 0}
            ),
            st.integers(4, 64),
            st.integers(0, 3),
        ),
        st.builds(lambda t: Toxic("timeout", "upstream", {"timeout": t}), st.integers(20, 200)),
        st.just(Toxic("reset_peer", "upstream", {"timeout": 0})),
        st.builds(
            lambda b: Toxic("limit_data", "downstream", {"bytes": b}),
            st.sampled_from([0, 64, 512, 2048]),
        ),
    )


REPLY_LOST = Toxic("limit_data", "downstream", {"bytes": 0})
REQUEST_LOST = Toxic("reset_peer", "upstream", {"timeout": 0})


class FaultRules:
    """The base's fault rules, mixed into :class:`~knownstate.chaos.check.KindCheck`.

    Hooks a kind answers (all optional):

    - ``turns(w) -> list``: the work worker ``w`` can do next that ends in a COMMIT or an
      external call (empty: none). ``turn(w, data, due)`` does one of them (``due``: after a
      stall, the runs of the write ``next_write`` brought it to).
    - ``leases() -> list[int]``: workers holding a live lease (a stall freezes one of them).
    - ``meanwhile(w, data)``: what the others do while ``w`` is frozen (the reaper runs, ...).
    - ``next_write(w, data)``: bring ``w`` to its next write (a stall freezes inside it, or
      before it while its runs are taken back and claimed).
    - ``clock_matters() -> bool``: whether a database clock jump could change anything now;
      ``crash_matters() -> bool`` likewise for a crash between two steps.
    - ``external_links(worker) -> list[Link]``: the worker's links to stand-ins.
    """

    policy = FaultPolicy()
    commit_point = "COMMIT"
    """Where the COMMIT faults meet a worker: its next COMMIT, or in autocommit its next
    statement (the round trip the connection hooks either way: :mod:`.adapter`)."""

    # -- hooks ---------------------------------------------------------------------------------
    def turns(self, w: int) -> list:
        return []

    def turn(self, w: int, data, due: frozenset = frozenset()) -> None:
        """Worker ``w`` takes its next turn (:meth:`turns`) as one step. ``due``: after a stall,
        the runs of the write it was about to make (:meth:`next_write`; empty: any)."""
        raise NotImplementedError(
            f"{type(self).__name__}.turns() offers work but turn() is missing"
        )

    def leases(self) -> list[int]:
        return []

    def meanwhile(self, w: int, data, retake: bool = False) -> None:
        """While worker ``w`` is frozen past its lease, the world goes on (default: nothing).
        ``retake``: on purpose the way a fence exists for: what ``w`` holds is taken back and
        claimed again by another worker (or healed, where reads heal)."""

    def next_write(self, w: int, data, frozen: bool = False) -> frozenset:
        """Worker ``w`` is about to freeze inside its next write (``frozen``), or just before it
        while its runs are taken back and claimed: do what its loop does before that write (an
        external call whose outcome the write records) and return the runs the write is for
        (default: nothing done; any run it holds)."""
        return frozenset()

    def clock_matters(self) -> bool:
        return True

    def crash_matters(self) -> bool:
        """Whether a database crash between two steps could tell anything now."""
        return True

    def external_links(self, worker: Worker) -> list[Link]:
        return [link for link in worker.links if link is not worker.link]

    # -- pacing --------------------------------------------------------------------------------
    def _reset_faults(self: "KindCheck") -> None:
        self.op_count = 0
        self.last_fault = -self.policy.gap
        self.link_faults = 0
        self.crashes = 0
        self.faulted_since: dict[str, int] = {}
        self.reply_lost_armed: int | None = None
        self._fault_cleanup: Callable[[], None] | None = None

    def _calm(self: "KindCheck") -> bool:
        return self.op_count - self.last_fault >= self.policy.gap

    def all_links(self: "KindCheck") -> list[Link]:
        """Every link a fault may act on (kinds without workers override)."""
        return [link for w in self.workers for link in w.links]

    def faulted_links(self: "KindCheck") -> list[Link]:
        return [link for link in self.all_links() if link.toxics or not link.enabled]

    def _age_faults(self: "KindCheck") -> None:
        """Called before every operation: links faulted for ``heal_after`` operations heal."""
        self.op_count += 1
        faulted = {link.name: link for link in self.faulted_links()}
        for name in list(self.faulted_since):
            if name not in faulted:
                del self.faulted_since[name]
        for name, link in faulted.items():
            since = self.faulted_since.setdefault(name, self.op_count)
            if self.op_count - since >= self.policy.heal_after:
                self._toxi(link.clear)
                del self.faulted_since[name]
                self.log(f"  (heal {link.name} after {self.policy.heal_after} operations)")

    def _may_fault_link(self: "KindCheck") -> bool:
        return (
            self._calm()
            and not self.faulted_links()
            and self.link_faults < self.policy.link_faults
            and bool(self.all_links())
        )

    def _link(self: "KindCheck", w: int) -> Link:
        links = self.all_links()
        return links[w % len(links)]

    def _toxi(self: "KindCheck", fn: Callable[[], None]) -> None:
        try:
            fn()
        except ToxiproxyError as e:
            self.env.ensure_alive()
            from .harness import EnvironmentFault

            raise EnvironmentFault(str(e)) from None

    # -- link faults -----------------------------------------------------------------------------
    @precondition(lambda self: self._may_fault_link())
    @rule(w=st.integers(0, 7), toxic=toxics())
    def fault_toxic(self: "KindCheck", w: int, toxic: Toxic) -> None:
        self.link_faults += 1
        link = self._link(w)
        self._toxi(lambda: link.add(toxic))
        self.fault("toxic", f"toxic {link.name} {toxic.describe()}")

    @precondition(lambda self: self._may_fault_link())
    @rule(w=st.integers(0, 7))
    def fault_link_down(self: "KindCheck", w: int) -> None:
        self.link_faults += 1
        link = self._link(w)
        self._toxi(link.down)
        self.fault("link-down", f"link down {link.name}")

    @precondition(lambda self: self.faulted_links())
    @rule()
    def heal(self: "KindCheck") -> None:
        for link in self.faulted_links():
            self._toxi(link.clear)
            self.log(f"heal {link.name}")

    # -- the database ------------------------------------------------------------------------------
    def _may_jump(self: "KindCheck") -> bool:
        """A jump that must move nothing (no guard reads the database clock) tests something
        only where ``now()`` itself moves: a time shift would move application-time stamps."""
        where = self.policy.db_clock_moves_model or "db-clock" in self.env.capabilities()
        return self.env.clock is not None and where and self._calm() and self.clock_matters()

    @precondition(lambda self: self._may_jump())
    @rule(data=st.data())
    def fault_clock_jump(self: "KindCheck", data) -> None:
        self.jump_clock(data.draw(st.sampled_from(self.policy.clock_jumps), label="seconds"))

    def jump_clock(self: "KindCheck", seconds: int) -> None:
        """The database's clock moves ``seconds``; the model's with it, when a guard reads it."""
        self.env.clock.jump(seconds)
        if self.policy.db_clock_moves_model:
            self.advance(seconds)
            self.fault("db-clock-jump", f"{self.env.clock.label} {seconds:+d}s")
        else:
            self.fault(
                "db-clock-jump",
                f"db clock jump {seconds:+d}s (no guard of this kind reads "
                "the database clock: nothing may move)",
            )

    @initialize(crashable=st.booleans())
    def _crashable(self: "KindCheck", crashable: bool) -> None:
        """Whether this example may crash the database, drawn with it: a restart costs more than
        the rest of an example, so only some do (and a shrinking example leaves crashes out)."""
        self.may_crash_here = crashable

    def _may_crash(self: "KindCheck") -> bool:
        return (
            self.env.can_crash
            and self.crashes < self.policy.db_crashes
            and getattr(self, "may_crash_here", False)
        )

    @precondition(
        lambda self: (
            self.policy.crash_between_steps
            and self._may_crash()
            and self._calm()
            and self.crash_matters()
        )
    )
    @rule()
    def fault_db_crash(self: "KindCheck") -> None:
        self.crashes += 1
        self.fault("db-crash", "database crash (SIGKILL of the postmaster) and restart")
        self.env.crash_and_restart()

    # -- faults that meet a worker's next turn -------------------------------------------------
    def _commit_faults(self: "KindCheck") -> list[str]:
        return [k for k in self.policy.commit_faults if k != "db-crash" or self._may_crash()]

    def _turners(self: "KindCheck") -> list[int]:
        return [w.index for w in self.workers if self.turns(w.index)]

    def _may_meet_commit(self: "KindCheck") -> bool:
        return (
            bool(self.policy.commit_faults)
            and all(w.before_commit is None for w in self.workers)
            and bool(self._turners())
        )

    @precondition(lambda self: self._may_meet_commit())
    @rule(data=st.data(), kind=st.sampled_from(COMMIT_FAULTS))
    def fault_commit(self: "KindCheck", data, kind: str) -> None:
        """A worker's next COMMIT meets a fault, in the turn it takes at once: its reply is lost
        (the server committed), its request is lost (it did not), it dies just before sending it,
        or the database server crashes with the transaction open. The worker cannot know whether
        it committed; the check keeps both possible states until an observation decides."""
        allowed = self._commit_faults()
        if kind not in allowed:
            kind = allowed[COMMIT_FAULTS.index(kind) % len(allowed)]
        w = rows.row(data, self._turners(), "worker")
        self.arm_commit_fault(self.workers[w], kind)
        self.fault(kind, f"{kind} at w{w}'s next {self.commit_point}", pace=False)
        self.turn(w, data)
        self.workers[w].before_commit = None  # a turn that wrote nothing never reached COMMIT

    def arm_commit_fault(self: "KindCheck", worker: Worker, kind: str) -> None:
        """Arm ``kind`` on ``worker``'s next COMMIT (on whatever connection it has then)."""
        link = worker.link

        def hook(conn: HookedConnection) -> None:
            if kind == "db-crash":
                self.crashes += 1
                self.env.crash_and_restart()
            elif kind == "worker-death":
                cut_socket(conn)
                raise WorkerDied(f"{worker.name} died before COMMIT")
            else:
                toxic = REPLY_LOST if kind == "commit-reply-lost" else REQUEST_LOST
                self._toxi(lambda: link.remove(toxic))
                self._toxi(lambda: link.add(toxic))
                self._fault_cleanup = lambda: self._toxi(lambda: link.remove(toxic))

        worker.arm(hook)

    def _may_lose_reply(self: "KindCheck") -> bool:
        return (
            self.policy.reply_lost
            and self.reply_lost_armed is None
            and any(self.external_links(self.workers[w]) for w in self._turners())
        )

    @precondition(lambda self: self._may_lose_reply())
    @rule(data=st.data())
    def fault_reply_lost(self: "KindCheck", data) -> None:
        """A stand-in acts on the worker's next request, and its answer never arrives; the worker
        takes its turn at once."""
        able = [w for w in self._turners() if self.external_links(self.workers[w])]
        w = rows.row(data, able, "worker")
        self.reply_lost_armed = w
        self.fault("reply-lost", f"stand-in answer lost at w{w}'s next call", pace=False)
        self.turn(w, data)
        self.reply_lost_armed = None

    def external_call(self: "KindCheck", worker: Worker) -> "_ExternalCall":
        """Wrap a worker's call to a stand-in: an armed lost reply acts on exactly this call."""
        return _ExternalCall(self, worker)

    # -- a worker that stalls past its lease -------------------------------------------------------
    def stall_passes(self: "KindCheck", seconds: int) -> None:
        """A stall's time passes: the database's clock jumps (``policy.stall_clock == "db"``),
        and the models' clocks move (``advance``)."""
        if self.policy.stall_clock == "db":
            self.env.clock.jump(seconds)
        self.advance(seconds)

    def _may_stall(self: "KindCheck") -> bool:
        if self.policy.stall is None or not self.leases():
            return False
        return self.policy.stall_clock == "app" or self.env.clock is not None

    @precondition(lambda self: self._may_stall())
    @rule(
        data=st.data(),
        resume=st.sampled_from(
            [
                "at once",
                "later",
                "racing the others",
                "inside its write",
                "inside its write",
                "after its runs were taken back",
            ]
        ),
    )
    def stall(self: "KindCheck", data, resume: str) -> None:
        """A worker holding a live lease freezes (a GC pause, a suspended VM) until its lease
        lapsed; then either the world goes on meanwhile (the kind's ``meanwhile``) and it
        resumes with its next turn at once, or later; or it resumes *while* the others act on
        its runs (a concurrent block: the reaper taking a run back as the stale owner writes
        it); or it froze *inside* its next write, between two statements of its transaction,
        while the others did whole operations on its run (a block so scheduled; half the
        racing stalls are such too). A racing stall that finds no other worker able to touch its
        runs resumes at once after the world went on. One stall in six is aimed at what a fence
        is for: meanwhile its runs are taken back and claimed again (the kind's ``meanwhile``
        with ``retake``), and it resumes at once with the write it was about to make (the
        kind's ``next_write``). Either way it races with its run owner's writes (``by_owner``)."""
        w = rows.row(data, self.leases(), "worker")
        frozen = resume == "inside its write" or (
            resume == "racing the others" and data.draw(st.booleans(), label="or froze inside")
        )
        due = frozenset()
        if frozen or resume == "after its runs were taken back":
            # the write it was about to make: the one it makes on resuming, fenced meanwhile
            due = self.next_write(w, data, frozen)
        if frozen:
            self.model_agrees()  # judged (and a lost answer's fate observed) before it freezes
        seconds = self.policy.stall
        self.stall_passes(seconds)
        if resume in ("racing the others", "inside its write"):
            how = (
                "inside its next write; meanwhile the others do whole operations:"
                if frozen
                else "and resumes racing the others:"
            )
            self.fault("worker-stall", f"w{w} stalls {seconds}s, past its lease, {how}", pace=False)
            if self.race(data, w, frozen=frozen, due=due):
                return
        else:
            self.fault(
                "worker-stall", f"w{w} stalls {seconds}s, past its lease; meanwhile:", pace=False
            )
        self.meanwhile(w, data, retake=resume == "after its runs were taken back")
        if resume != "later" and (due or self.turns(w)):
            self.log(f"  (w{w} resumes)")
            self.turn(w, data, due)


class _ExternalCall:
    def __init__(self, check: "KindCheck", worker: Worker):
        self.check, self.worker, self.toxic_on = check, worker, None

    def __enter__(self) -> "_ExternalCall":
        check = self.check
        if check.reply_lost_armed == self.worker.index:
            check.reply_lost_armed = None
            for link in check.external_links(self.worker):
                check._toxi(link.clear)
                check._toxi(lambda link=link: link.add(REPLY_LOST))
            self.toxic_on = check.external_links(self.worker)
        self.timed = timings.span("impl")  # the call itself is the implementation's (--timings)
        self.timed.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timed.__exit__(*exc)
        for link in self.toxic_on or ():
            self.check._toxi(lambda link=link: link.remove(REPLY_LOST))
