"""What a soak recorded: the records its judge (:mod:`knownstate.chaos.judge`) reads.

Theory of operation
-------------------

A soak (:mod:`knownstate.chaos.soak`) leaves four records, each written by a different party,
none of them by the judge:

operations
    each worker process's own log (:mod:`knownstate.chaos.soakworker`): every store operation
    with the runs it named and the fence token it carried, its outcome or error, and when. A
    process killed mid-operation leaves an operation without an end.
audit
    a row per committed row change, written by a trigger in the same transaction as the change
    (so it exists exactly when the change committed): the table, the row before and after, the
    database clock of the transaction (the clock every lease guard reads) and the operation that
    made it (its statements carry the operation's reference).
external
    what the stand-ins recorded: every call the notification sink or the receiver answered,
    every create request the operations API acted on, and its operations at the end.
nemesis
    the faults, each a period: which part, from when to when, named as in
    :data:`~knownstate.chaos.faults.FAULTS`.

What the judge says is a :class:`Verdict`: :class:`Finding` s (a violation, named by its
invariant, attributed to a process, an operation and the nemesis periods around it),
:class:`Duplicate` s (a repeated external effect the kind allows, attributed to the attempt that
was never recorded), and what it observed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from knownstate.model.contract import INVARIANTS

from .faults import SOAK_GLOBAL_FAULTS

# ---------------------------------------------------------------------------------------
# The records.
# ---------------------------------------------------------------------------------------


@dataclass
class Op:
    """One store operation (or outbox send) of one worker process, from its own log."""

    ref: str  # "w1.2:17": process w1, incarnation 2, operation 17
    proc: str
    name: str
    runs: dict[str, Any]  # run -> fence token it carried (None: no token)
    t0: float
    t1: float | None = None  # None: the process died during it
    out: str | None = (
        None  # won, lost, rejected, indeterminate, conn-lost, aborted, ext-failed, ...
    )
    value: Any = None
    args: dict = field(default_factory=dict)
    app_now: float | None = None  # branch reset: the application clock the operation read

    @property
    def inc(self) -> str:
        return self.ref.split(":")[0]

    def token(self, run: str) -> Any:
        return self.runs.get(run)


@dataclass
class Proc:
    """One incarnation of one worker process."""

    name: str
    inc: int
    role: str
    pid: int
    start: float
    end: float | None = None
    how: str = ""  # "stopped" (at the end), "killed" (by the nemesis), "died" (on its own)


@dataclass
class Period:
    """A nemesis fault (named as in :data:`~.faults.FAULTS`), from start to end. ``target``: a
    process name, "*" (the database or its clock: every process), or a stand-in ("sink",
    "ops")."""

    kind: str
    target: str
    start: float
    end: float
    detail: str = ""

    def affects(self, proc: str) -> bool:
        return self.target == proc or self.kind in SOAK_GLOBAL_FAULTS

    def describe(self, t0: float) -> str:
        who = "" if self.target == "*" else f" {self.target}"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.kind}{who} {self.start - t0:+.1f}..{self.end - t0:+.1f} s{extra}"


@dataclass
class Audit:
    """One committed row change."""

    id: int
    table: str
    op: str  # INSERT or UPDATE
    ref: str | None  # the operation that made it
    old: dict | None
    new: dict | None
    at: float  # the database clock of its transaction (epoch seconds)
    xid: int = 0
    seen: dict | None = None  # the new row as its kind reads it (a described kind: its read_query)
    was: dict | None = None  # the old row, likewise

    @property
    def row(self) -> dict:
        return self.new if self.new is not None else (self.old or {})


@dataclass
class History:
    kind: str
    seed: int
    t0: float
    config: dict
    procs: list[Proc] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    periods: list[Period] = field(default_factory=list)
    audit: list[Audit] = field(default_factory=list)
    external: dict[str, list] = field(default_factory=dict)
    mutant: str | None = None
    quiet_from: float | None = None  # when the nemesis stopped and healing began

    def by_ref(self) -> dict[str, Op]:
        return {o.ref: o for o in self.ops}

    def on(self, run: str) -> list[Op]:
        """The operations that named ``run``, in order (indexed once)."""
        index = self.__dict__.get("_on")
        if index is None or self.__dict__.get("_on_size") != len(self.ops):
            index = defaultdict(list)
            for o in self.ops:
                for r in o.runs:
                    index[str(r)].append(o)
            self.__dict__["_on"], self.__dict__["_on_size"] = index, len(self.ops)
        return index.get(run, [])

    def until(self, op: Op) -> float:
        """When the operation ended: its end, or for one cut by a kill its process's end."""
        if op.t1 is not None:
            return op.t1
        name, inc = op.inc.split(".")
        ends = [p.end for p in self.procs if p.name == name and str(p.inc) == inc and p.end]
        return ends[0] if ends else float("inf")

    def rel(self, t: float | None) -> str:
        return "?" if t is None else f"+{t - self.t0:.1f} s"


# ---------------------------------------------------------------------------------------
# What the judge says.
# ---------------------------------------------------------------------------------------


@dataclass
class Finding:
    """A violation: the invariant it breaks, what happened, and who and what was around it."""

    invariant: str
    message: str
    run: str | None = None
    t: float | None = None
    ref: str | None = None
    periods: list[Period] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.invariant in INVARIANTS, self.invariant

    def line(self, t0: float) -> str:
        near = "; ".join(p.describe(t0) for p in self.periods) or "none"
        return f"{self.invariant}: {self.message} [nemesis: {near}]"


@dataclass
class Duplicate:
    """One repeated external effect, attributed to the earlier attempt that was never recorded."""

    run: str
    effect: str  # what arrived more than once
    t: float  # when the unrecorded attempt's effect arrived
    owner: str  # the process incarnation that held the lapsed attempt ("w1.2")
    attempt: Any
    cause: str
    periods: list[Period] = field(default_factory=list)
    why: str = ""  # the cause in a few words, for counting

    def line(self, t0: float) -> str:
        near = "; ".join(p.describe(t0) for p in self.periods) or "none: under load alone"
        return (
            f"{self.effect}: attempt {self.attempt} (at +{self.t - t0:.1f} s) "
            f"held by {self.owner}, "
            f"{self.cause} [nemesis: {near}]"
        )


@dataclass
class Verdict:
    findings: list[Finding] = field(default_factory=list)
    duplicates: list[Duplicate] = field(default_factory=list)
    observed: Counter = field(default_factory=Counter)
    transitions: Counter = field(default_factory=Counter)  # (from, operation, to): how often
    runs: int = 0
    terminal: int = 0

    @property
    def passed(self) -> bool:
        return not self.findings


# ---------------------------------------------------------------------------------------
# Reading the records.
# ---------------------------------------------------------------------------------------


def near(h: History, proc: str | None, start: float | None, end: float | None) -> list[Period]:
    """The nemesis periods that touched ``proc`` (or everyone) between start and end."""
    if start is None:
        return []
    end = start if end is None else end
    return [
        p
        for p in h.periods
        if p.start <= end and p.end >= start and (proc is None or p.affects(proc))
    ]


def commit_order(audit: Iterable[Audit]) -> list[Audit]:
    """The audit rows transaction by transaction, in the order the transactions committed.

    A row's audit id is drawn when the change is made, not when it commits: a transaction that
    wrote an effect, stalled, and committed after another transaction's change to the same run
    (possible exactly when the run row was not locked) has the smaller ids. A transaction's last
    change is made just before its COMMIT, so transactions are ordered by their last audit id;
    within one, by id. (Rows without a transaction id count as a transaction each.)"""
    groups: dict[object, list[Audit]] = defaultdict(list)
    for a in audit:
        groups[a.xid or ("row", a.id)].append(a)
    ordered = sorted(groups.values(), key=lambda g: max(a.id for a in g))
    return [a for g in ordered for a in sorted(g, key=lambda a: a.id)]
