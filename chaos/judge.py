"""The soak's judge: the audit replayed run by run, each committed change judged by the contract.

Theory of operation
-------------------

The check judges every step it drives by :func:`knownstate.model.contract.check_invariants`:
the kind-neutral views of the runs before and after the step, the fenced writes it made. The
soak drives nothing; it records (:mod:`knownstate.chaos.history`). This module turns the record
into the same values and asks the same predicates (Jepsen's one history, many checkers):

1. The audit is replayed in commit order (:func:`~.history.commit_order`), one transaction at a
   time. The kind's soak binding (:mod:`knownstate.chaos.soakkinds`) reads each committed row
   version as a :class:`RunRow` (its key, status, fence token, lease) or as a step row (a
   receipt, an effect) of a run, and turns a run's rows into a
   :class:`~knownstate.model.contract.RunView`.
2. For each run a transaction changed: its view before and after, and, when the operation that
   made the change writes as the run's owner (the kind's ``owner_writes``), a
   :class:`~knownstate.model.contract.Write`: the token it carried, accepted (it landed), and
   whether it was still the owner's when it landed, as the kind's fence says (``attempt``: the
   row still says its token; ``row-lock``: the run is still owned under its token; ``status``:
   still owned, and under a lease in application time its lease live by the writer's own
   clock). ``check_invariants`` judges them. A state violation (a step twice, an effect without
   its receipt) is reported by the change that made it, not again by every change after.
3. One change, one finding: a stale write that landed is the fence's (whatever it then did to a
   terminal run); else a terminal run that changed is that; else everything the change broke.
4. Kind-neutral rules the contract states and a step-wise check reads from its model: a run is
   taken back (the kind's ``take_backs``) only once its lease lapsed, by the clock that judges
   it (``lease``); an operation that names the step it writes writes that step
   (``stable-step-identity``); nothing is lost: every run asked for (it waited where a claim
   takes it) is terminal after the quiet period, and every creation a producer was told had
   won committed.
5. The kind's own extras (:attr:`Judging.extras`), and the external effects
   (:mod:`knownstate.chaos.effects`): at-least-once deliveries, duplicates attributed; one
   creation per run.

Every finding names the invariant, the process incarnation and operation, the token it carried,
what the run said and who made it so (who took it back, who claimed it since), and the nemesis
periods around the write: from the writer's claim of the run until the write took effect.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from knownstate.model.contract import Contract, RunView, Violation, Write
from knownstate.model.contract import check_invariants

from .history import Audit, Finding, History, Op, Verdict, commit_order, near

if TYPE_CHECKING:
    from .soakkinds import SoakKind


@dataclass(frozen=True)
class RunRow:
    """One committed version of a run, as the judge reads it: its key, status, fence token
    (None: the kind has none), when its lease lapses (epoch seconds, by the clock that judges
    it; None: no lease), and what else a kind's extras read."""

    key: str
    status: str
    token: Any = None
    lease_until: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRow:
    """A committed row that is a step's receipt or effect: ``what`` is ``receipt``, ``failed``
    (a receipt of a step that was not ok) or ``effect``."""

    run: str
    step: str
    what: str


@dataclass(frozen=True)
class Judging:
    """What the judge needs of a kind: its contract, how its rows read, and which of its
    operations write as an owner, take runs back, create runs. Built by its soak binding."""

    contract: Contract
    fence: str  # the description's fence kind: attempt, status, row-lock, none
    app_clock_lease: bool  # the lease is stamped and judged in application time
    row: Callable[[Audit, bool], "RunRow | StepRow | None"]  # (change, its old version?)
    view: Callable[[RunRow, Counter], RunView]
    owner_writes: frozenset[str]
    take_backs: frozenset[str]
    creations: frozenset[str]
    heartbeats: frozenset[str] = frozenset()  # the owner writes that only extend its lease
    done: str | None = None  # the status that records the work done (its external effect's)
    token_noun: str = "attempt"
    extras: tuple[Callable[["Replay"], None], ...] = ()


@dataclass
class Change:
    """One transaction's change to one run: the row before and after, who made it, when."""

    audit: Audit
    op: Op | None
    before: RunRow | None
    after: RunRow


PRECEDENCE = ("lease-fence", "terminal-answers-from-receipts")
"""One change, one finding: a stale write that landed is the fence's to have refused, whatever
else it did; a change to a terminal run is that, whatever move it made."""


class Replay:
    """The audit replayed in commit order; :meth:`run` judges every change."""

    def __init__(self, h: History, kind: "SoakKind"):
        self.h, self.k = h, kind.judging(h.config)
        self.contract = self.k.contract
        self.ops = h.by_ref()
        self.rows: dict[str, RunRow] = {}
        self.steps: dict[str, Counter] = defaultdict(Counter)
        self.changes: dict[str, list[Change]] = defaultdict(list)
        self.asked: set[str] = set()
        self.v = Verdict()
        self._reported: set[tuple[str, str, Violation]] = set()
        table = self.contract.table
        owned = self.contract.owned
        self.claimable = {t.source for t in table.transitions if t.target in owned} - owned

    # -- the replay --------------------------------------------------------------------------
    def run(self) -> Verdict:
        for tx in _transactions(commit_order(self.h.audit)):
            self._transaction(tx)
        self._lost()
        self._creations()
        self._final()
        for extra in self.k.extras:
            extra(self)
        return self.v

    def _transaction(self, tx: list[Audit]) -> None:
        touched: dict[str, list[tuple[Audit, RunRow | StepRow]]] = defaultdict(list)
        for a in tx:
            read = self.k.row(a, False)
            if read is not None:
                touched[read.key if isinstance(read, RunRow) else read.run].append((a, read))
        for run, items in touched.items():
            before, counts = self.rows.get(run), Counter(self.steps[run])
            first = items[0][0]
            if first.old is not None and isinstance(items[0][1], RunRow):
                # what the row said when this change met it, as the server saw it
                before = self.k.row(first, True) or before
            for _, read in items:
                if isinstance(read, RunRow):
                    self.rows[run] = read
                else:
                    self.steps[run][(read.step, read.what)] += 1
            after = self.rows.get(run)
            if after is None:
                continue  # a step of a run whose row was never seen: nothing to judge it by
            if after.status in self.claimable:
                self.asked.add(run)
            last = items[-1][0]
            op = self.ops.get(last.ref or "")
            change = Change(last, op, before, after)
            if before is not None and before.status != after.status:
                self.v.transitions[(before.status, op.name if op else "?", after.status)] += 1
            self._judge(run, change, counts, [r for _, r in items if isinstance(r, StepRow)])
            self.changes[run].append(change)

    def view(self, row: RunRow, counts: Counter) -> RunView:
        return self.k.view(row, counts)

    def _judge(self, run: str, c: Change, counts: Counter, steps: list[StepRow]) -> None:
        op, contract = c.op, self.contract
        if op is None:
            self.v.observed["write with no logged operation"] += 1
        v0 = self.view(c.before, counts) if c.before is not None else None
        v1 = self.view(c.after, self.steps[run])
        before, after = ({run: v0} if v0 else {}), {run: v1}
        stale = self._write(run, c)
        if stale:
            self.report(run, c, "lease-fence", self._stale(run, c))
            return
        moves = check_invariants(contract, before, after)
        state_then = set(check_invariants(contract, before, before)) if v0 else set()
        state_now = set(check_invariants(contract, after, after))
        found = [x for x in moves if x not in state_now or x not in state_then]
        own = self._taken_back(run, c) + self._step_identity(run, c, steps)
        for name in PRECEDENCE[1:]:
            if any(x.invariant == name for x in found + own):
                found = [x for x in found if x.invariant == name]
                own = [x for x in own if x.invariant == name]
        for x in found:
            self.report(run, c, x.invariant, self._says(run, c, x), key=x)
        for x in own:
            self.report(run, c, x.invariant, x.message)
        if c.before is not None and c.before.status not in contract.owned:
            if c.after.status in contract.owned:
                self.v.observed["claim"] += 1

    # -- the fence ----------------------------------------------------------------------------
    def _write(self, run: str, c: Change) -> bool:
        """Whether the change is a write by an owner that landed though it no longer owned the
        run (the contract's Write, judged by check_invariants)."""
        op, b = c.op, c.before
        if op is None or op.name not in self.k.owner_writes or run not in op.runs or b is None:
            return False
        token = op.token(run)
        fence, owned = self.k.fence, b.status in self.contract.owned
        if fence == "status":
            current = owned and self._lease_live(b, op, c.audit)
        elif token is None:
            return False  # a write that carried no token cannot be judged by one
        elif fence == "attempt":
            current = token == b.token  # the status is the conditional transition's to judge
        else:
            current = owned and token == b.token
        if current:
            self.v.observed["owner write committed under its token"] += 1
        write = Write(run, token if isinstance(token, int) else -1, True, current)
        return bool(check_invariants(self.contract, {}, {}, [write]))

    def _lease_live(self, row: RunRow, op: Op | None, a: Audit) -> bool:
        """Whether ``row``'s lease was live when ``op`` wrote it, by the clock that judges it:
        the writer's own (an application-time lease: the clock its operation read), else the
        database's (the clock of the change's transaction)."""
        if row.lease_until is None:
            return False
        clock = self._clock(op, a)
        return clock is None or row.lease_until > clock

    def _clock(self, op: Op | None, a: Audit) -> float | None:
        return (op.app_now if op is not None else None) if self.k.app_clock_lease else a.at

    def _taken_back(self, run: str, c: Change) -> list[Violation]:
        """A run taken back while its lease was live (the ``lease`` guarantee)."""
        op, b, owned = c.op, c.before, self.contract.owned
        if op is None or op.name not in self.k.take_backs or b is None:
            return []
        if b.status not in owned or c.after.status in owned:
            return []
        self.v.observed["lapsed lease taken back"] += 1
        if self._lease_live(b, op, c.audit):
            return [Violation("lease", self._live(run, c))]
        if b.lease_until is None:
            return [Violation("lease", f"{_who(op)} took {run} back, which held no lease")]
        return []

    def _live(self, run: str, c: Change) -> str:
        clock = self._clock(c.op, c.audit)
        whose = "the taker's clock" if self.k.app_clock_lease else "the database clock"
        left = "" if clock is None else f" ({c.before.lease_until - clock:.1f} s left by {whose})"
        return f"{_who(c.op)} {c.op.name} took {run} back while its lease was live{left}"

    def _step_identity(self, run: str, c: Change, steps: list[StepRow]) -> list[Violation]:
        """An operation that names the step it writes (``step_index``) writes that step."""
        asked = c.op.args.get("step_index") if c.op is not None else None
        if type(asked) is not int:
            return []
        return [
            Violation(
                "stable-step-identity",
                f"{_who(c.op)} {c.op.name}({run}, step {asked}) wrote the {s.what} of step "
                f"{s.step}",
            )
            for s in steps
            if s.step != str(asked)
        ]

    # -- what a finding says --------------------------------------------------------------------
    def _stale(self, run: str, c: Change) -> str:
        op, b, noun = c.op, c.before, self.k.token_noun
        token = op.token(run)
        if self.k.fence == "status" and b.status in self.contract.owned:
            clock = self._clock(op, c.audit)
            return (
                f"{_who(op)} {op.name}({run}) carried a lease lapsed by its own clock and landed "
                f"(lease until {self.h.rel(b.lease_until)}, its clock read {self.h.rel(clock)})"
            )
        said = f"{noun} {token}" if token is not None else "its claim"
        was = f"the run was {b.status}"
        if b.token is not None:
            was += f" under {noun} {b.token}"
        if self.k.fence == "attempt" and b.token != token:
            was = f"the row was at {noun} {b.token}"
        since = self._since(run, c)
        return f"{_who(op)} {op.name}({run}) carried {said} and landed, but {was}{since}"

    def _since(self, run: str, c: Change) -> str:
        """Who made the run what the stale writer met: who took it back since the writer held
        it, who claimed it since; else who last changed it."""
        writer, token = c.op, c.op.token(run)
        held = self._held_since(run, writer)
        out = ""
        for earlier in self.changes[run]:
            op = earlier.op
            if op is None or (held is not None and op.t0 < held):
                continue
            if op.name in self.k.take_backs and earlier.before is not None:
                if earlier.before.status in self.contract.owned:
                    out += f": its lease had lapsed and {op.inc} took the run back at "
                    out += self.h.rel(op.t0)
            elif _claims(earlier, self.contract.owned) and earlier.after.token != token:
                out += f"{',' if out else ':'} claimed by {op.inc} at {self.h.rel(op.t0)}"
        if not out and self.changes[run]:
            last = self.changes[run][-1].op
            if last is not None and last is not writer:
                out = f" (by {last.inc} {last.name} at {self.h.rel(last.t0)})"
        return out

    def _says(self, run: str, c: Change, x: Violation) -> str:
        """A contract predicate's violation, said of the change and the operation that made it."""
        move = ""
        if c.before is not None and c.before.status != c.after.status and "->" not in x.message:
            move = f" ({c.before.status} -> {c.after.status})"
        name = c.op.name if c.op is not None else "write"
        return f"{_who(c.op)} {name}({run}): {x.message}{move}"

    def _held_since(self, run: str, op: Op | None) -> float | None:
        """When ``op``'s process claimed the run it writes (its claim's start)."""
        if op is None:
            return None
        claims = [
            c.op.t0
            for c in self.changes[run]
            if c.op is not None
            and c.op.proc == op.proc
            and c.op.t0 <= op.t0
            and _claims(c, self.contract.owned)
        ]
        return claims[-1] if claims else None

    def report(
        self, run: str, c: Change, invariant: str, message: str, key: Violation | None = None
    ) -> None:
        """A finding about change ``c`` (a state violation once per run)."""
        if key is not None:
            if (run, invariant, key) in self._reported:
                return
            self._reported.add((run, invariant, key))
        periods = self.around(run, c.op, claim=_claims(c, self.contract.owned))
        self.v.findings.append(Finding(invariant, message, run, _at(c.op), c.audit.ref, periods))

    def around(self, run: str | None, op: Op | None, claim: bool = False) -> list:
        """The nemesis periods around a write: those that touched its process (or everyone) from
        when it took the run (its claim) until the write took effect."""
        if op is None:
            return []
        since = None if claim or run is None else self._held_since(run, op)
        return near(self.h, op.proc, since or op.t0, _at(op))

    # -- the end: nothing lost -------------------------------------------------------------------
    def _lost(self) -> None:
        """Every run asked for (it waited where a claim takes it) ends terminal."""
        contract = self.contract
        for run, row in self.rows.items():
            self.v.runs += 1
            if contract.is_terminal(row.status):
                self.v.terminal += 1
            elif run not in self.asked:
                self.v.observed["run never asked for (left as created)"] += 1
            elif row.status in contract.owned:
                self.finding(
                    "lease",
                    f"run {run} is still {row.status} after the quiet period: its owner's lease "
                    "was never taken back",
                    run,
                )
            else:
                self.finding(
                    "conditional-transition",
                    f"run {run} is still {row.status} after the quiet period: no worker took it",
                    run,
                )

    def finding(self, invariant: str, message: str, run: str | None = None, **kw) -> None:
        """A finding about no one change (the end state, the external side)."""
        kw.setdefault("t", self.h.quiet_from)
        if "periods" not in kw and kw.get("ref") in self.ops:
            kw["periods"] = self.around(run, self.ops[kw["ref"]])
        self.v.findings.append(Finding(invariant, message, run, **kw))

    def _creations(self) -> None:
        """A creation the producer was told had won committed; an unknown one is counted."""
        for o in self.h.ops:
            if o.name not in self.k.creations:
                continue
            created = [str(r) for r in o.runs] or ([str(o.value)] if o.out == "won" else [])
            for run in created:
                if o.out == "won" and run not in self.rows:
                    self.finding(
                        "receipt-with-effect",
                        f"{o.inc} {o.name}({run}) answered won, but the run never committed",
                        run,
                        t=_at(o),
                        ref=o.ref,
                    )
                elif o.out in ("indeterminate", "conn-lost") or (o.t1 is None and o.out is None):
                    resolved = "committed" if run in self.rows else "not committed"
                    self.v.observed[f"creation unknown to its producer: {resolved}"] += 1

    def _final(self) -> None:
        """The end state through the contract's state predicates (once per violation)."""
        views = {run: self.view(row, self.steps[run]) for run, row in self.rows.items()}
        for x in check_invariants(self.contract, views, views):
            run = next((r for r in views if f"run {r} " in x.message), None)
            if (run, x.invariant, x) not in self._reported:
                self._reported.add((run, x.invariant, x))
                self.finding(x.invariant, x.message, run)


def judge(h: History, kind: "SoakKind") -> Verdict:
    """Every rule over the whole history; findings sorted by when their write took effect."""
    v = Replay(h, kind).run()
    for o in h.ops:
        if o.out == "lost":
            v.observed["lost race or fence refusal"] += 1
        if o.out in ("indeterminate", "conn-lost", "ext-failed", "aborted"):
            v.observed[o.out.replace("-", " ")] += 1
        if o.t1 is None:
            v.observed["operation cut by a kill"] += 1
    v.findings.sort(key=lambda f: (f.t is None, f.t or 0.0))
    return v


# ---------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------


def _transactions(audit: list[Audit]) -> list[list[Audit]]:
    out: list[list[Audit]] = []
    for a in audit:
        if out and a.xid and out[-1][-1].xid == a.xid:
            out[-1].append(a)
        else:
            out.append([a])
    return out


def _claims(c: Change, owned: frozenset[str]) -> bool:
    """Whether the change claimed the run: into an owned status from one that is not."""
    return c.after.status in owned and (c.before is None or c.before.status not in owned)


def _at(op: Op | None) -> float | None:
    """When an operation's write took effect: by its end (it began before, perhaps long before
    a stall)."""
    if op is None:
        return None
    return op.t1 if op.t1 is not None else op.t0


def _who(op: Op | None) -> str:
    return op.inc if op is not None else "an unlogged writer"
