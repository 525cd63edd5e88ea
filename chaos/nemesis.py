"""The soak's nemesis: a fault schedule drawn from the seed, and the thread that carries it out.

Theory of operation
-------------------

What a fault does is apart from when it happens (Jepsen's nemesis vs its generator).
:func:`schedule` is the generator: a pure function of the seed, the duration, the processes and
the lease, so a seed names one schedule, which is printed before the soak starts and replayed by
the same command. Its faults are named as the check names them (:data:`~.faults.FAULTS`: one
vocabulary for the check, the nemesis, the reports and the timeline). It draws two independent
tracks, so faults of the two can overlap:

process track
    one process at a time: ``process-kill`` (SIGKILL, and a new incarnation after the fault's
    duration), ``worker-stall`` (SIGSTOP for longer than the lease, then SIGCONT: the owner
    comes back after somebody may have taken its work), ``link-down`` (its own Toxiproxy links
    down: to the database, to the stand-in, or both), ``worker-hold`` (a stall *aimed* at a
    stale owner, below);
global track
    ``db-clock-jump`` (the database clock jumps, through libfaketime; past the lease or a
    little, forward or back), ``db-clock-strobe`` (the database clock flips between two offsets
    for a while, then settles back), ``db-crash`` (SIGKILL of PostgreSQL, a restart on the same
    data after the fault's duration), ``stand-in-refuses`` (the stand-in answers the next few
    calls with an error: 503 or 422 at the sink, 503 at the operations API), ``stand-in-slow``
    (every worker's link to the stand-in gets a latency for a while, a quarter to a half of the
    lease per call: a batch of calls outlasts the lease, or a call its timeout, while its worker
    is alive).

:class:`Nemesis` is the executor: a thread that starts and ends each fault at its time through
a :class:`Parts` object (the soak's real parts), and records each as a
:class:`~knownstate.chaos.history.Period` with the wall-clock times it actually began and
ended. Waiting for a fault's time is the only waiting it does (a hold's looks at the database
are polls, each pushed on the same queue). :meth:`Nemesis.heal` ends every fault still in
progress (SIGCONT, restart, links up, database up), for the quiet period or an abort. A
part that fails to obey (Toxiproxy gone, PostgreSQL will not restart) ends the nemesis and is
kept in :attr:`Nemesis.error` for the soak to report as an environment failure.

A ``worker-hold`` reaches the stale owner on purpose instead of by luck. A timed
``worker-stall`` lands
wherever its worker happens to be, mostly between leases, and by the time it resumes its work
was taken back and finished by others: its stale write, if any, meets a terminal row. A hold
waits (polling, within :data:`AIM_WITHIN`) until its worker holds a lease and has no statement
or transaction open at the server: it is between its transactions, in its external call or
about to write under its token. It aims after the ``after``-th write under the lease (the claim
is the first), so the next write is each in turn; with ``runs=one`` at a holder of exactly one
run (a loop records one run by another write than a batch). It stops the worker there and
keeps it stopped, whatever that takes, until what it held was taken from it
(:meth:`Parts.taken`, read from the database): ``resume=reaped``, as soon as its lease lapsed
(by the clock that stamped it) and was taken back; ``resume=reclaimed``, once another worker
holds some of it under a new token, or nobody can (it aims only at runs the reaper puts
back, not at those whose attempts it ends). Meanwhile the other workers' calls to the
stand-in are slow (``ms`` per call), so the run, once taken back, stays free or held by its new
owner for a while: the old owner resumes into exactly that window, and its next write carries
a token the row no longer says. They stay slow after it resumed, until no run it held is held
by another (its write or the new owner's landed): the new owner's call, released at once,
would otherwise race the old owner's write. The moment is read from the server, never guessed
from a timer; :data:`HOLD_BOUND` leases is only the bound after which the owner resumes anyway
(the detail of the period says which). With ``resume=reclaimed``, a hold whose runs were taken
back and wait for a new owner gets the bound again from that moment: on a slow machine, or
while the other workers' calls are slow, a claim can be seconds away, and the catch must not
depend on it.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from .faults import SOAK_GLOBAL_FAULTS, SOAK_PROCESS_FAULTS
from .history import Period

POLL = 0.02
"""Seconds between two looks at the database while a hold aims or waits."""
AIM_WITHIN = 3.0
"""Seconds a hold looks for a moment its worker holds a lease; then it gives up (recorded)."""
HOLD_BOUND = 2.5
"""A hold lasts at most this many leases from its planned time, aiming included: then its worker
resumes, whatever happened."""

PROCESS_FAULTS, GLOBAL_FAULTS = SOAK_PROCESS_FAULTS, SOAK_GLOBAL_FAULTS


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``at`` seconds after the start, for ``duration`` seconds."""

    at: float
    kind: str
    target: str
    duration: float = 0.0
    params: tuple[tuple[str, object], ...] = ()

    def param(self, name: str, default=None):
        return dict(self.params).get(name, default)

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.params)
        who = "" if self.target == "*" else f" {self.target}"
        span = f" for {self.duration:.1f} s" if self.duration else ""
        return f"+{self.at:5.1f} s {self.kind}{who}{span}{' ' + extra if extra else ''}"


def schedule(
    seed: int,
    seconds: float,
    procs: list[str],
    lease: float,
    stand_in: str,
    refusals: tuple[int, ...] = (503,),
) -> list[Fault]:
    """The whole schedule for a soak of ``seconds``: a pure function of its arguments.

    ``procs``: the processes the process track may hit (workers more often than the producer
    and the reaper, which come last in the list); ``lease``: the seconds a stall must outlast;
    ``stand_in``: "sink" or "ops", the target of ``stand-in-refuses`` ("": no stand-in, no
    refusals)."""
    rng = random.Random(f"knownstate-soak:{seed}")
    workers = [p for p in procs if p.startswith("w")] or procs
    faults: list[Fault] = []
    t = rng.uniform(1.5, 3.0)
    while t < seconds - 1:
        kind = rng.choices(PROCESS_FAULTS, (3, 2, 3, 6))[0]
        target = rng.choice(workers) if rng.random() < 0.8 else rng.choice(procs)
        if kind == "worker-hold":  # aimed at a worker: only a worker holds leases
            resume = rng.choice(("reaped", "reclaimed"))
            runs = rng.choice(("one", "any"))
            ms = int(lease * 150) if stand_in else 0
            f = Fault(
                t,
                kind,
                rng.choice(workers),
                round(HOLD_BOUND * lease, 1),
                (("resume", resume), ("runs", runs), ("after", rng.randint(1, 3)), ("ms", ms)),
            )
        elif kind == "process-kill":
            f = Fault(t, kind, target, round(rng.uniform(0.3, 2.0), 1))
        elif kind == "worker-stall":
            f = Fault(t, kind, target, round(lease * rng.uniform(1.3, 2.2), 1))
        else:
            links = rng.choice(("db", "db", "ext", "both")) if not target.startswith("p") else "db"
            f = Fault(t, kind, target, round(rng.uniform(0.5, lease * 1.5), 1), (("links", links),))
        faults.append(f)
        t = f.at + f.duration + rng.uniform(0.5, 3.5)
    t = rng.uniform(2.0, 5.0)
    while t < seconds - 1:
        kind = rng.choices(GLOBAL_FAULTS, (3, 2, 2, 2, 2) if stand_in else (3, 2, 2, 0, 0))[0]
        if kind == "db-clock-jump":
            jump = rng.choice((lease + 1, lease + 1, 2 * lease, 1, -1, -lease))
            f = Fault(t, kind, "*", 0.0, (("seconds", int(round(jump))),))
        elif kind == "db-clock-strobe":
            f = Fault(
                t,
                kind,
                "*",
                round(rng.uniform(1.0, 3.0), 1),
                (
                    ("seconds", int(round(rng.choice((lease + 1, 2, -2))))),
                    ("every", round(rng.uniform(0.1, 0.3), 2)),
                ),
            )
        elif kind == "db-crash":
            f = Fault(t, kind, "*", round(rng.uniform(0.3, 2.0), 1))
        elif kind == "stand-in-refuses":
            f = Fault(
                t,
                kind,
                stand_in,
                0.0,
                (("calls", rng.randint(1, 6)), ("code", rng.choice(refusals))),
            )
        else:
            f = Fault(
                t,
                kind,
                stand_in,
                round(rng.uniform(lease, 3 * lease), 1),
                (("ms", int(rng.uniform(0.25, 0.5) * lease * 1000)),),
            )
        faults.append(f)
        t = f.at + f.duration + rng.uniform(3.0, 8.0)
    return sorted(faults, key=lambda f: (f.at, f.kind))


class Parts(Protocol):
    """What the nemesis acts on (implemented by the soak over its real parts)."""

    def kill(self, proc: str) -> None: ...
    def restart(self, proc: str) -> None: ...
    def stop(self, proc: str) -> None: ...
    def cont(self, proc: str) -> None: ...
    def partition(self, proc: str, links: str) -> None: ...
    def reconnect(self, proc: str, links: str) -> None: ...
    def clock_jump(self, seconds: float) -> None: ...
    def db_crash(self) -> None: ...
    def db_restart(self) -> None: ...
    def refuse(self, stand_in: str, calls: int, code: int) -> None: ...
    def slow(self, stand_in: str, ms: int | None) -> None: ...
    def slow_others(self, proc: str, ms: int | None) -> None:
        """Latency on the stand-in links of every worker but ``proc`` (None: remove it)."""

    def holds(self, proc: str, again: bool = False) -> dict[str, tuple[object, int]]:
        """The runs ``proc`` (its current incarnation) holds a lease on: run -> (token, how many
        changes it committed to the run under that token, its claim included); ``again``: only
        those a claim can take again once the reaper took them back."""

    def writes_bound(self) -> int:
        """The most writes the kind's loop makes under one lease before its last (0: none)."""

    def quiet(self, proc: str, within: float) -> bool:
        """Polls until ``proc`` has no statement running and no transaction open at the
        server; False when that did not happen ``within`` seconds (or cannot be seen)."""

    def taken(self, held: dict[str, object]) -> dict[str, str] | None:
        """Where each of ``held`` (run -> token) is now: ``held`` (still under that token),
        ``free`` (taken back, waiting for a claim), ``reheld`` (under another token), ``done``
        (terminal). None when the database cannot be read."""


@dataclass(order=True)
class _Due:
    when: float
    serial: int
    action: str = field(compare=False)
    fault: Fault = field(compare=False)


class Nemesis:
    """Carries out a schedule against ``parts``, from ``t0`` (time.time()) on."""

    def __init__(self, faults: list[Fault], parts: Parts, t0: float):
        self.faults, self.parts, self.t0 = faults, parts, t0
        self.periods: list[Period] = []
        self.active: dict[Fault, float] = {}  # fault -> when it began
        self.error: BaseException | None = None
        self._strobe_offset: dict[Fault, float] = {}
        self._aim_until: dict[Fault, float] = {}  # a hold still looking for its moment
        self._held: dict[Fault, dict] = {}  # a hold's worker is stopped holding these
        self._why: dict[Fault, str] = {}  # how a hold ended
        self._bounds: dict[Fault, int] = {}  # a hold's bounds still to come (the last ends it)
        self._slowed: dict[Fault, tuple[float, dict]] = {}  # resumed, the others still slow
        self._halt = threading.Event()
        self._lock = threading.RLock()
        self._queue: list[_Due] = []
        self._serial = 0
        for f in faults:
            self._push(t0 + f.at, "start", f)
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)

    def start(self) -> "Nemesis":
        self._thread.start()
        return self

    def _push(self, when: float, action: str, fault: Fault) -> None:
        self._serial += 1
        heapq.heappush(self._queue, _Due(when, self._serial, action, fault))

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue or self._halt.is_set():
                        return
                    due = self._queue[0].when
                if self._halt.wait(max(0.0, due - time.time())):
                    return
                with self._lock:
                    if self._halt.is_set():
                        return
                    item = heapq.heappop(self._queue)
                    getattr(self, f"_{item.action}")(item.fault)
        except BaseException as e:  # a part that does not obey: the soak reports it (exit 3)
            self.error = e
            self._halt.set()

    def now_active(self) -> list[Fault]:
        with self._lock:
            return list(self.active)

    # -- actions -------------------------------------------------------------------------
    def _start(self, f: Fault) -> None:
        p = self.parts
        began = time.time()
        if f.kind == "process-kill":
            p.kill(f.target)
        elif f.kind == "worker-stall":
            p.stop(f.target)
        elif f.kind == "link-down":
            p.partition(f.target, f.param("links"))
        elif f.kind == "db-clock-jump":
            p.clock_jump(f.param("seconds"))
        elif f.kind == "db-clock-strobe":
            self._strobe_offset[f] = 0.0
            self._tick(f)
        elif f.kind == "db-crash":
            p.db_crash()
        elif f.kind == "stand-in-refuses":
            p.refuse(f.target, f.param("calls"), f.param("code"))
        elif f.kind == "stand-in-slow":
            p.slow(f.target, f.param("ms"))
        elif f.kind == "worker-hold":
            self._aim_until[f] = began + AIM_WITHIN
            self._aim(f)
            return
        if f.duration:
            self.active[f] = began
            self._push(began + f.duration, "end", f)
        else:
            self.periods.append(Period(f.kind, f.target, began, began, _detail(f)))

    def _tick(self, f: Fault) -> None:
        """One flip of a clock strobe: to +seconds, or back to where it started."""
        if f not in self._strobe_offset:
            return
        step = f.param("seconds") if self._strobe_offset[f] == 0.0 else -self._strobe_offset[f]
        self.parts.clock_jump(step)
        self._strobe_offset[f] += step
        self._push(time.time() + f.param("every"), "tick", f)

    def _aim(self, f: Fault) -> None:
        """One look for the moment to stop a hold's worker: it holds a lease and is between
        transactions. Stopped, it is looked at again (what it holds cannot change any more)."""
        until = self._aim_until.get(f)
        if until is None:
            return
        p, now = self.parts, time.time()
        if now > until:
            del self._aim_until[f]
            self.periods.append(
                Period(
                    f.kind,
                    f.target,
                    now,
                    now,
                    _detail(
                        f,
                        f"not stopped: it held no lease between transactions "
                        f"within {AIM_WITHIN:g} s",
                        self._after(f),
                    ),
                )
            )
            return
        again = f.param("resume") == "reclaimed"  # runs another owner can take
        if self._aimed(f, p.holds(f.target, again)):
            p.stop(f.target)
            held = p.quiet(f.target, 0.5) and p.holds(f.target, again)
            if self._aimed(f, held):
                del self._aim_until[f]
                began = time.time()
                self._held[f] = {run: token for run, (token, _) in held.items()}
                self.active[f] = began
                if f.param("ms"):
                    self._lift_all()  # an earlier hold's slowness is this one's now
                    p.slow_others(f.target, f.param("ms"))
                self._bounds[f] = 1
                self._push(self.t0 + f.at + f.duration, "bound", f)
                self._push(began + POLL, "watch", f)
                return
            p.cont(f.target)
        self._push(time.time() + POLL, "aim", f)

    def _aimed(self, f: Fault, held) -> bool:
        """What a hold aims at: a worker holding runs, after its ``after``-th write under the
        lease (the claim is the first; at most as many as its loop makes before the last), so
        the stale owner's next write is any of them in turn; with ``runs=one``, exactly one run
        (a loop records one run and a batch of them by different writes: each must meet a stale
        owner)."""
        if not held or (f.param("runs") == "one" and len(held) != 1):
            return False
        return any(writes >= self._after(f) for _, writes in held.values())

    def _after(self, f: Fault) -> int:
        return min(f.param("after", 1), self.parts.writes_bound() or f.param("after", 1))

    def _watch(self, f: Fault) -> None:
        """One look at what a stopped hold's worker held: resume it once that was taken."""
        if f not in self.active:
            return
        where = self.parts.taken(self._held[f])
        states = set(where.values()) if where is not None else {"held"}
        if "held" not in states:
            if f.param("resume") == "reaped" or "reheld" in states or "free" not in states:
                self._why[f] = ", ".join(f"{run} {w}" for run, w in sorted(where.items()))
                self._end(f)
                return
            if f not in self._why:  # taken back, waiting for a new owner: the bound again
                self._why[f] = "taken back, no new owner before the bound"
                self._bounds[f] += 1
                self._push(time.time() + f.duration, "bound", f)
        self._push(time.time() + POLL, "watch", f)

    def _bound(self, f: Fault) -> None:
        """A hold's bound came: it ends, unless a later bound was set since (see ``_watch``)."""
        if f in self._bounds:
            self._bounds[f] -= 1
            if not self._bounds[f]:
                self._end(f)

    def _end(self, f: Fault) -> None:
        p = self.parts
        began = self.active.pop(f, None)
        if began is None:
            return
        if f.kind == "worker-hold":
            self._bounds.pop(f, None)
            p.cont(f.target)
            if f.param("ms"):  # the others stay slow until the resumed owner has written
                self._slowed[f] = (time.time() + f.duration, self._held[f])
                self._lift(f)
            held = ", ".join(f"{run}@{token}" for run, token in sorted(self._held.pop(f).items()))
            why = self._why.pop(f, "") or "still held (the bound was reached, or the quiet period)"
            self.periods.append(
                Period(
                    f.kind,
                    f.target,
                    began,
                    time.time(),
                    _detail(f, f"stopped holding {held}; resumed: {why}", self._after(f)),
                )
            )
            return
        if f.kind == "process-kill":
            p.restart(f.target)
        elif f.kind == "worker-stall":
            p.cont(f.target)
        elif f.kind == "link-down":
            p.reconnect(f.target, f.param("links"))
        elif f.kind == "db-clock-strobe":
            offset = self._strobe_offset.pop(f, 0.0)
            if offset:
                p.clock_jump(-offset)
        elif f.kind == "db-crash":
            p.db_restart()
        elif f.kind == "stand-in-slow":
            p.slow(f.target, None)
        self.periods.append(Period(f.kind, f.target, began, time.time(), _detail(f)))

    def _lift(self, f: Fault) -> None:
        """One look after a hold's worker resumed: the other workers' calls stay slow while a
        new owner holds what it held, so the resumed owner's next write meets that owner (its
        own calls were never slow). Lifted once no run it held is held by another (its write
        landed, or the new owner's did), or after the hold's duration."""
        if f not in self._slowed:
            return
        until, held = self._slowed[f]
        where = self.parts.taken(held)
        if time.time() < until and (where is None or "reheld" in where.values()):
            self._push(time.time() + POLL, "lift", f)
            return
        del self._slowed[f]
        self.parts.slow_others(f.target, None)

    def _lift_all(self) -> None:
        for f in list(self._slowed):
            del self._slowed[f]
            self.parts.slow_others(f.target, None)

    def heal(self) -> None:
        """Stop planning; end every fault in progress now (the quiet period begins)."""
        self._halt.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._lock:
            for f in sorted(self.active, key=lambda f: f.at):
                self._end(f)
            now = time.time()
            for f in sorted(self._aim_until, key=lambda f: f.at):  # every fault is recorded
                self.periods.append(
                    Period(
                        f.kind,
                        f.target,
                        now,
                        now,
                        _detail(
                            f, "not stopped: the quiet period began while it aimed", self._after(f)
                        ),
                    )
                )
            self._lift_all()
            self._queue.clear()
            self._aim_until.clear()


def _detail(f: Fault, what: str = "", after: int = 1) -> str:
    if f.kind == "worker-hold":
        slow = f", others +{f.param('ms')} ms per call" if f.param("ms") else ""
        runs = "one run" if f.param("runs") == "one" else "runs"
        return (
            f"aimed at a holder of {runs} after write {after} under its lease, resume once "
            f"{f.param('resume')}{slow}; {what}"
        )
    if f.kind == "link-down":
        return f"links: {f.param('links')}"
    if f.kind == "db-clock-jump":
        return f"{f.param('seconds'):+d} s"
    if f.kind == "db-clock-strobe":
        return f"{f.param('seconds'):+d} s every {f.param('every')} s"
    if f.kind == "stand-in-refuses":
        return f"next {f.param('calls')} call(s) answered {f.param('code')}"
    if f.kind == "stand-in-slow":
        return f"+{f.param('ms')} ms per call"
    return ""
