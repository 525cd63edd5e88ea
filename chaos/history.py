"""What a soak recorded, and the judge that reads it.

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
    what the stand-ins recorded: every delivery the notification sink answered, every create
    request the operations API acted on, and its operations at the end.
nemesis
    the faults, each a period: which part, from when to when.

The judge replays the audit in commit order per run and asks of every write what the contract
asks (:data:`knownstate.model.contract.INVARIANTS`, named in every finding):

- *conditional-transition*: every change is a transition of the kind's table; a claim takes a
  run from the status it waits in;
- *lease-fence*: a write that carries a token (the claimed attempt, the execution generation,
  a poll's lease by its own clock) lands only while the row still says that token, judged
  before anything else (also behind a terminal status: the fence is what should have refused
  it); a reaper takes back only a lapsed lease; a claim changes the token;
- *terminal-answers-from-receipts*: nothing changes a terminal run, and no repeat request
  applies an effect;
- *stable-step-identity*: a step is its position in the frozen payload: a run_step writes the
  receipt and effect of the step it asked for, and is never refused the step that was next (as
  many receipts committed as its index);
- *receipt-with-effect*, *stable-step-identity*: the final rows, through the kind's own views
  and :func:`~knownstate.model.contract.check_invariants` (an effect without its receipt, a
  step twice), plus what a terminal status promises (an executed plan has every receipt, a
  sent delivery reached the sink under the attempt recorded);
- *external-effect-semantics*: one creation per branch reset at the operations API.

Nothing lost: every run that was created (an INSERT committed) and asked for (enqueued,
approved, requested) is terminal after the quiet period, and every creation a producer was told
had won committed; a creation whose COMMIT was indeterminate is accounted for either way.

Duplicates. An at-least-once effect that arrived more than once (a delivery the sink accepted
twice, a create request the API deduplicated) is allowed, counted, and *attributed*: to the
earlier attempt whose owner never recorded it — which worker, which attempt, why (its lease
lapsed and the reaper took it back; its reply was lost; it died after the call) — and to the
nemesis periods that overlapped that attempt, or to none (it lapsed under load alone). A
duplicate with no such earlier attempt (two owners of one attempt) is a finding.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

from knownstate.model import approved_plan as plan_model
from knownstate.model import branch_reset as reset_model
from knownstate.model import outbox as outbox_model
from knownstate.model.contract import INVARIANTS, check_invariants

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
    final: dict[str, list[dict]] = field(default_factory=dict)  # table -> rows at the end
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


def judge(h: History) -> Verdict:
    """Every rule over the whole history. Findings come sorted by time."""
    v = Verdict()
    {"outbox": _outbox, "approved-plan": _plan, "branch-reset": _reset}[h.kind](h, v)
    for o in h.ops:
        if o.out == "lost":
            v.observed["lost race or fence refusal"] += 1
        if o.out in ("indeterminate", "conn-lost", "ext-failed", "aborted"):
            v.observed[o.out.replace("-", " ")] += 1
        if o.t1 is None:
            v.observed["operation cut by a kill"] += 1
    refs = h.by_ref()
    for f in v.findings:  # one rule for the periods around every write that broke a rule
        op = refs.get(f.ref or "")
        if op is not None and f.run is not None:
            f.periods = _around(h, op, f.run)
    v.findings.sort(key=lambda f: (f.t is None, f.t or 0.0))
    return v


# ---------------------------------------------------------------------------------------
# Shared helpers.
# ---------------------------------------------------------------------------------------


def ts(value: Any) -> float | None:
    """A timestamp from a row (ISO text from to_jsonb, a datetime, or epoch seconds)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value)).timestamp()


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


def _per_run(audit: Iterable[Audit], table: str, key: str = "id") -> dict[str, list[Audit]]:
    out: dict[str, list[Audit]] = defaultdict(list)
    for a in audit:
        if a.table == table:
            out[str(a.row[key])].append(a)
    return out


def _at(op: Op | None) -> float | None:
    """When an operation's write took effect: by its end (it began before, perhaps long before
    a stall)."""
    if op is None:
        return None
    return op.t1 if op.t1 is not None else op.t0


def _who(op: Op | None) -> str:
    return op.inc if op is not None else "an unlogged writer"


def _stale(h: History, v: Verdict, run: str, op: Op, a: Audit, said: str, why: str) -> None:
    v.findings.append(
        Finding(
            "lease-fence",
            f"{_who(op)} {op.name}({run}) carried {said} and landed, {why}",
            run,
            _at(op),
            op.ref,
            near(h, op.proc, _held_since(h, op, run), op.t1 or op.t0),
        )
    )


def _around(h: History, op: Op, run: str) -> list[Period]:
    """The nemesis periods around a write: those that touched its process (or everyone) from
    when it took the run (for a write under a token: its claim) until the write took effect."""
    since = _held_since(h, op, run) if op.token(run) is not None else op.t0
    return near(h, op.proc, since, _at(op))


def _held_since(h: History, op: Op, run: str) -> float | None:
    """When the operation's process claimed the run it writes under (its claim's start)."""
    claims = [
        o
        for o in h.on(run)
        if o.proc == op.proc
        and o.t0 <= op.t0
        and o.name in ("claim_batch", "claim", "mark_executing", "start")
        and o.out == "won"
    ]
    return claims[-1].t0 if claims else op.t0


def _lost_and_held(
    h: History,
    v: Verdict,
    runs: dict[str, list[Audit]],
    asked: set[str],
    terminal: set[str],
    held: set[str],
    status_key: str = "status",
) -> None:
    """Nothing lost: every run asked for ends terminal after the quiet period."""
    v.runs = len(runs)
    for run, changes in runs.items():
        status = changes[-1].row[status_key]
        if status in terminal:
            v.terminal += 1
            continue
        if run not in asked:
            v.observed["run never asked for (left as created)"] += 1
            continue
        if status in held:
            v.findings.append(
                Finding(
                    "lease-fence",
                    f"run {run} is still {status} after the quiet "
                    f"period: its owner's lease was never reaped",
                    run,
                    h.quiet_from,
                )
            )
        else:
            v.findings.append(
                Finding(
                    "conditional-transition",
                    f"run {run} is still {status} after the quiet period: no worker ever took it",
                    run,
                    h.quiet_from,
                )
            )


def _creations_committed(h: History, v: Verdict, names: tuple[str, ...], runs: set[str]) -> None:
    """A creation the producer was told had won committed; an indeterminate one is accounted for."""
    for o in h.ops:
        if o.name not in names:
            continue
        created = [str(r) for r in o.runs] or ([str(o.value)] if o.out == "won" else [])
        for run in created:
            if o.out == "won" and run not in runs:
                v.findings.append(
                    Finding(
                        "receipt-with-effect",
                        f"{o.inc} {o.name}({run}) answered won, but the run never committed",
                        run,
                        _at(o),
                        o.ref,
                    )
                )
            elif o.out in ("indeterminate", "conn-lost") or (o.t1 is None and o.out is None):
                landed = run in runs
                resolved = "committed" if landed else "not committed"
                v.observed[f"creation unknown to its producer: {resolved}"] += 1


def _transition(h: History, v: Verdict, table, a: Audit, op: Op | None, run: str) -> bool:
    """conditional-transition for one change; True when it reported one."""
    src, dst = a.old["status"], a.new["status"]
    if table.allows(src, dst):
        return False
    v.findings.append(
        Finding(
            "conditional-transition",
            f"{_who(op)} {op.name if op else 'write'}({run}) "
            f"moved it {src} -> {dst}, which the table does not allow",
            run,
            _at(op),
            a.ref,
            near(h, op.proc if op else None, op.t0 if op else None, op.t1 if op else None),
        )
    )
    return True


# ---------------------------------------------------------------------------------------
# The outbox.
# ---------------------------------------------------------------------------------------

OUTBOX_TERMINAL = {"sent", "failed", "dead"}
CLAIMS = ("claim_batch", "claim", "begin_claim")


def _outbox(h: History, v: Verdict) -> None:
    ops, runs = h.by_ref(), _per_run(h.audit, "outbox_delivery")
    for run, changes in runs.items():
        for a in changes:
            if a.op != "UPDATE":
                continue
            op = ops.get(a.ref or "")
            if op is None:
                v.observed["write with no logged operation"] += 1
            old, new = a.old, a.new
            token = op.token(run) if op is not None and op.name not in CLAIMS else None
            if isinstance(token, int) and old["attempts"] != token:
                # First: a write under an attempt the row no longer says is the fence's to
                # refuse, whatever the status the row is in.
                _stale(
                    h,
                    v,
                    run,
                    op,
                    a,
                    f"attempt {token}",
                    f"but the row was at attempt {old['attempts']}"
                    + _outbox_why(h, runs[run], token, old["attempts"], ops),
                )
                continue
            if old["status"] in OUTBOX_TERMINAL:
                v.findings.append(
                    Finding(
                        "terminal-answers-from-receipts",
                        f"{_who(op)} {op.name if op else 'write'}({run}) changed it after it was "
                        f"{old['status']} ({old['status']} -> {new['status']})",
                        run,
                        _at(op),
                        a.ref,
                    )
                )
                continue
            if op is not None and op.name in CLAIMS:
                v.observed["claim"] += 1
                if new["attempts"] != old["attempts"] + 1:
                    v.findings.append(
                        Finding(
                            "lease-fence",
                            f"{op.inc} claimed {run} without changing its "
                            f"fence token (attempts stayed {old['attempts']})",
                            run,
                            _at(op),
                            op.ref,
                        )
                    )
                    continue
            elif op is not None and op.name == "reclaim_stale":
                v.observed["reclaim of a lapsed lease"] += 1
                lease = ts(old.get("lease_until"))
                if old["status"] == "processing" and (lease is None or lease > a.at):
                    v.findings.append(
                        Finding(
                            "lease-fence",
                            f"{op.inc} reclaimed {run} while its lease was live "
                            f"({lease - a.at:.0f} s left by the database clock)"
                            if lease
                            else f"{op.inc} reclaimed {run}, which held no lease",
                            run,
                            _at(op),
                            op.ref,
                        )
                    )
                    continue
            _transition(h, v, outbox_model.TABLE, a, op, run)
    asked = {run for run, ch in runs.items() if ch[0].op == "INSERT"}
    _lost_and_held(h, v, runs, asked, OUTBOX_TERMINAL, {"processing"})
    _creations_committed(h, v, ("enqueue",), set(runs))
    _outbox_sink(h, v, runs, ops)


def _outbox_why(h: History, changes: list[Audit], token: int, now: int, ops: dict[str, Op]) -> str:
    """Who took the run back from attempt ``token``, and who claimed attempt ``now``."""
    why = ""
    for a in changes:
        op = ops.get(a.ref or "")
        if op is None or a.op != "UPDATE":
            continue
        if op.name == "reclaim_stale" and a.old["attempts"] == token:
            why += f": its lease had lapsed and {op.inc} took the run back at {h.rel(op.t0)}"
        if op.name in CLAIMS and a.new["attempts"] == now:
            why += f"{',' if why else ':'} claimed by {op.inc} at {h.rel(op.t0)}"
    return why


def _outbox_sink(h: History, v: Verdict, runs: dict[str, list[Audit]], ops: dict[str, Op]) -> None:
    """Receipts exactly once, and every duplicate delivery attributed."""
    accepted: dict[str, list[tuple[float, int, str | None]]] = defaultdict(list)
    for t, delivery, attempt, code, *sender in h.external.get("deliveries", []):
        if code == 200:
            accepted[str(delivery)].append((t, attempt, sender[0] if sender else None))
    for run, changes in runs.items():
        last = changes[-1].row
        sent = [a for a in changes if a.op == "UPDATE" and a.new["status"] == "sent"]
        got = accepted.get(run, [])
        if last["status"] == "sent" and all(att != last["attempts"] for _, att, _ in got):
            op = ops.get(sent[-1].ref or "") if sent else None
            v.findings.append(
                Finding(
                    "external-effect-semantics",
                    f"{run} recorded as sent under attempt "
                    f"{last['attempts']}, but the sink never accepted that attempt",
                    run,
                    _at(op),
                    sent[-1].ref if sent else None,
                )
            )
        recorded = last["attempts"] if last["status"] == "sent" else None
        original = next((i for i, (_, att, _) in enumerate(got) if att == recorded), 0)
        for i, (t, attempt, sender) in enumerate(got):
            if i == original:
                continue
            v.observed["duplicate delivery"] += 1
            before = [ref for _, att, ref in got[:i] if att == attempt]
            _attribute_delivery(h, v, run, changes, ops, t, attempt, sender, before)


SAID = {
    "lost": "was refused (the fence)",
    "indeterminate": "lost its COMMIT's answer (indeterminate)",
    "conn-lost": "lost its connection",
    "aborted": "was aborted by the server",
    None: "was cut by a kill",
}


def _attribute_delivery(
    h: History,
    v: Verdict,
    run: str,
    changes: list[Audit],
    ops: dict[str, Op],
    t: float,
    attempt: int,
    sender: str | None,
    before: list[str | None],
) -> None:
    """One delivery the sink accepted beyond the recorded one. ``sender``: the operation whose
    request it was (from its header); ``before``: the senders of earlier acceptances of the same
    attempt (none, unless two workers held one attempt)."""
    claim = next(
        (
            a
            for a in changes
            if a.op == "UPDATE"
            and a.new["status"] == "processing"
            and a.new["attempts"] == attempt
            and a.old["status"] != "processing"
        ),
        None,
    )
    owner = ops.get(claim.ref or "") if claim else None
    send = ops.get(sender or "")
    if before:
        senders = ", ".join(ref or "?" for ref in [*before, sender])
        v.findings.append(
            Finding(
                "lease-fence",
                f"the sink accepted {run} more than once under attempt "
                f"{attempt} (sent by {senders}): two workers held the same attempt",
                run,
                t,
                sender,
                near(h, send.proc if send else None, t, t),
            )
        )
        return
    ended = next(
        (
            a
            for a in changes
            if a.op == "UPDATE" and a.old["status"] == "processing" and a.old["attempts"] == attempt
        ),
        None,
    )
    by = ops.get(ended.ref or "") if ended else None
    owner = owner or send
    who = owner.inc if owner else "?"
    send = send or next(
        (o for o in h.on(run) if o.name == "send" and o.token(run) == attempt), None
    )
    outcome = next(
        (
            o
            for o in h.on(run)
            if o.name in ("complete", "fail")
            and o.token(run) == attempt
            and o.proc == (owner.proc if owner else None)
        ),
        None,
    )
    if outcome is not None and outcome.out != "won":
        did = f"its {outcome.name} {SAID.get(outcome.out, 'ended ' + str(outcome.out))}"
    elif send is not None and send.out not in ("ok", None):
        did = f"its send got no answer ({send.out})"
    elif outcome is None:
        did = "it never recorded an outcome"
    else:
        did = f"it recorded {outcome.name}"
    if by is not None and by.name == "reclaim_stale":
        cause = f"{did}; its lease lapsed and {by.inc} took it back at {h.rel(by.t0)}"
        until, why = by.t0, "lease lapsed, reclaimed"
    elif by is not None:
        cause = f"{did}; attempt ended by {by.inc} {by.name} at {h.rel(by.t0)}"
        until, why = (
            by.t0,
            f"owner recorded {by.name} (reply lost)" if by.proc == who.split(".")[0] else by.name,
        )
    else:
        cause = did
        until, why = t, "never recorded"
    since = owner.t0 if owner else None
    v.duplicates.append(
        Duplicate(
            run,
            f"delivery {run} accepted more than once",
            t,
            who,
            attempt,
            cause,
            near(h, owner.proc if owner else None, since, until),
            why,
        )
    )


# ---------------------------------------------------------------------------------------
# The approved plan.
# ---------------------------------------------------------------------------------------

PLAN_TERMINAL = {s.value for s in plan_model.TERMINAL}
STEP_OPS = ("run_step", "heartbeat")
HEALS = ("read", "repeat", "compensate")


def _plan(h: History, v: Verdict) -> None:
    ops = h.by_ref()
    heartbeat_s = h.config["heartbeat_s"]
    row: dict[str, dict] = {}  # the run row as of the audit so far (commit order)
    by: dict[str, Op | None] = {}  # the operation that wrote it so
    approved: set[str] = set()
    for a in commit_order(h.audit):
        op = ops.get(a.ref or "")
        if a.table == "agent_proposal":
            run = str(a.row["id"])
            if a.op == "UPDATE":
                _plan_update(h, v, a, op, run, heartbeat_s, by.get(run))
                if a.new["status"] == "approved":
                    approved.add(run)
            row[run], by[run] = a.new, op
        elif a.table in ("agent_proposal_step", "demo_ledger"):
            run = str(a.row["proposal_id"])
            _plan_effect(h, v, a, op, run, row.get(run), by.get(run))
    runs = _per_run(h.audit, "agent_proposal")
    _lost_and_held(h, v, runs, approved, PLAN_TERMINAL, {"executing"})
    _creations_committed(h, v, ("propose",), set(runs))
    _plan_next_step(h, v, ops)
    _plan_final(h, v)


def _plan_next_step(h: History, v: Verdict, ops: dict[str, Op]) -> None:
    """A step is its position in the frozen payload: a run_step asked for the next step (as
    many receipts committed as its index, all by its own executor's earlier operations: only
    the holder of the run's token writes them, one operation after another) is never refused."""
    receipts: dict[str, list[Op]] = defaultdict(list)
    for a in h.audit:
        if a.table == "agent_proposal_step" and a.op == "INSERT" and a.ref in ops:
            receipts[str(a.row["proposal_id"])].append(ops[a.ref])
    lengths = {str(p["id"]): len(p["steps"]) for p in h.final.get("agent_proposal", [])}
    for o in h.ops:
        asked = o.args.get("step_index")
        if o.name != "run_step" or o.out != "rejected" or type(asked) is not int:
            continue
        for run in o.runs:
            done = sum(1 for w in receipts.get(run, []) if w.inc == o.inc and w.t0 < o.t0)
            if asked == done < lengths.get(run, 0):
                v.findings.append(
                    Finding(
                        "stable-step-identity",
                        f"{o.inc} run_step({run}, step {asked}) was refused ({o.value}), but "
                        f"step {asked} was the next of its payload ({done} receipt(s) before it)",
                        run,
                        _at(o),
                        o.ref,
                    )
                )


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


def _made(h: History, status: str, op: Op | None) -> str:
    """``failed (by r0.1 read at +5.2 s)``: a status and who wrote it."""
    return f"{status} (by {op.inc} {op.name} at {h.rel(op.t0)})" if op is not None else status


def _plan_update(
    h: History, v: Verdict, a: Audit, op: Op | None, run: str, heartbeat_s: int, last: Op | None
) -> None:
    old, new = a.old, a.new
    token = op.token(run) if op is not None else None
    if (
        op is not None
        and op.name in STEP_OPS
        and (old["status"] != "executing" or old["generation"] != token)
    ):
        # First: a write under a token the row no longer says is the fence's to refuse, also
        # (above all) behind a terminal status.
        _stale(
            h,
            v,
            run,
            op,
            a,
            f"token {token}",
            f"but the run was {_made(h, old['status'], last)} under token {old['generation']}",
        )
        return
    if old["status"] in PLAN_TERMINAL:
        v.findings.append(
            Finding(
                "terminal-answers-from-receipts",
                f"{_who(op)} {op.name if op else 'write'}({run}) changed it after it was "
                f"{old['status']} ({old['status']} -> {new['status']})",
                run,
                _at(op),
                a.ref,
                near(h, op.proc if op else None, op.t0 if op else None, op.t1 if op else None),
            )
        )
        return
    if op is not None and op.name in STEP_OPS:
        v.observed["step or heartbeat committed under its token"] += 1
    elif op is not None and op.name == "mark_executing":
        v.observed["claim"] += 1
        if new["generation"] == old["generation"]:
            v.findings.append(
                Finding(
                    "lease-fence",
                    f"{op.inc} claimed {run} without a new token",
                    run,
                    _at(op),
                    a.ref,
                )
            )
            return
    elif op is not None and op.name in HEALS and new["status"] == "failed":
        v.observed["lazy heal"] += 1
        beat = ts(old.get("heartbeat_at"))
        if beat is not None and beat >= a.at - heartbeat_s:
            v.findings.append(
                Finding(
                    "lease-fence",
                    f"{op.inc} {op.name}({run}) healed a live run "
                    f"(heartbeat {a.at - beat:.0f} s old, lease {heartbeat_s} s)",
                    run,
                    _at(op),
                    a.ref,
                )
            )
            return
    _transition(h, v, plan_model.TABLE, a, op, run)


def _plan_effect(
    h: History, v: Verdict, a: Audit, op: Op | None, run: str, was: dict | None, last: Op | None
) -> None:
    what = "receipt" if a.table == "agent_proposal_step" else "effect"
    step = a.row.get("step_index")
    if op is None:
        v.observed[f"{what} with no logged operation"] += 1
        return
    if op.name != "run_step":
        v.findings.append(
            Finding(
                "terminal-answers-from-receipts",
                f"{op.inc} {op.name}({run}) applied the {what} of step {step} again",
                run,
                _at(op),
                a.ref,
                near(h, op.proc, op.t0, op.t1),
            )
        )
        return
    token = op.token(run)
    if was is None or was["status"] != "executing" or was["generation"] != token:
        status = _made(h, was["status"], last) if was else "missing"
        _stale(h, v, run, op, a, f"token {token} (step {step} {what})", f"but the run was {status}")
        return
    asked = op.args.get("step_index")
    if type(asked) is int and step != asked:
        v.findings.append(
            Finding(
                "stable-step-identity",
                f"{op.inc} run_step({run}, step {asked}) wrote the {what} of step {step}",
                run,
                _at(op),
                a.ref,
            )
        )


def _plan_final(h: History, v: Verdict) -> None:
    """The final rows through the kind's views and the contract's predicates, plus what a
    terminal status promises about receipts."""
    receipts: dict[int, list[plan_model.Receipt]] = defaultdict(list)
    for r in h.final.get("agent_proposal_step", []):
        receipts[r["proposal_id"]].append(
            plan_model.Receipt(r["step_index"], r["ok"], r.get("detail", ""))
        )
    proposals = []
    for p in h.final.get("agent_proposal", []):
        steps = tuple(plan_model.Step.from_json(s) for s in p["steps"])
        got = tuple(sorted(receipts.get(p["id"], []), key=lambda r: r.step_index))
        proposals.append(
            plan_model.Proposal(
                p["id"],
                plan_model.Status(p["status"]),
                steps,
                generation=p["generation"],
                receipts=got,
            )
        )
        run, indexes = str(p["id"]), [r.step_index for r in got]
        if indexes != list(range(len(indexes))):
            v.findings.append(
                Finding(
                    "stable-step-identity",
                    f"plan {run} has receipts for steps {indexes}: not a prefix of its payload",
                    run,
                )
            )
        if p["status"] == "executed" and (len(got) != len(steps) or not all(r.ok for r in got)):
            v.findings.append(
                Finding(
                    "receipt-with-effect",
                    f"plan {run} is executed with {len(got)} receipt(s) for {len(steps)} step(s)",
                    run,
                )
            )
    ledger = tuple(
        plan_model.LedgerEntry(e["proposal_id"], e["step_index"], e["account"], e["delta"])
        for e in h.final.get("demo_ledger", [])
    )
    views = plan_model.views(plan_model.PlanState(tuple(proposals), (), ledger))
    for violation in check_invariants(plan_model.CONTRACT, views, views):
        v.findings.append(Finding(violation.invariant, violation.message))


# ---------------------------------------------------------------------------------------
# The branch reset.
# ---------------------------------------------------------------------------------------

RESET_TERMINAL = {s.value for s in reset_model.TERMINAL}


def _reset(h: History, v: Verdict) -> None:
    ops, runs = h.by_ref(), _per_run(h.audit, "branch_reset")
    for run, changes in runs.items():
        for a in changes:
            if a.op == "UPDATE":
                _reset_update(h, v, a, ops.get(a.ref or ""), run)
    _lost_and_held(h, v, runs, set(runs), RESET_TERMINAL, {"running"})
    _creations_committed(h, v, ("request",), set(runs))
    _reset_external(h, v, runs)


def _reset_update(h: History, v: Verdict, a: Audit, op: Op | None, run: str) -> None:
    old, new = a.old, a.new
    if op is None:
        v.observed["write with no logged operation"] += 1
    if old["status"] in RESET_TERMINAL:
        v.findings.append(
            Finding(
                "terminal-answers-from-receipts",
                f"{_who(op)} {op.name if op else 'write'}({run}) changed it after it was "
                f"{old['status']}",
                run,
                _at(op),
                a.ref,
            )
        )
        return
    lease = ts(old.get("lease_until"))
    if op is not None and op.name == "poll" and op.app_now is not None:
        if old["status"] == "running" and lease is not None and lease <= op.app_now:
            _stale(
                h,
                v,
                run,
                op,
                a,
                "a lease lapsed by its own clock",
                f"(lease until {h.rel(lease)}, its clock read {h.rel(op.app_now)})",
            )
            return
        v.observed["poll committed"] += 1
    elif op is not None and op.name == "reap" and op.app_now is not None:
        v.observed["reap"] += 1
        if old["status"] == "running" and lease is not None and lease > op.app_now:
            v.findings.append(
                Finding(
                    "lease-fence",
                    f"{op.inc} reaped {run} while its lease was live "
                    f"({lease - op.app_now:.1f} s left by the reaper's clock)",
                    run,
                    _at(op),
                    a.ref,
                )
            )
            return
    if old["status"] == new["status"] == "running":
        return  # the start's receipt of its operation, or a poll of one still in progress
    _transition(h, v, reset_model.TABLE, a, op, run)


def _reset_external(h: History, v: Verdict, runs: dict[str, list[Audit]]) -> None:
    """One creation per run at the operations API, its id on the row; the rest attributed."""
    ops_at_api = {o["id"]: o for o in h.external.get("ops", [])}
    refs = h.by_ref()
    creates: dict[str, list[tuple]] = defaultdict(list)
    for t, run, key, op_id, created, *sender in h.external.get("creates", []):
        creates[run].append((t, key, op_id, created, sender[0] if sender else None))
    for run, requests in creates.items():
        made = [r for r in requests if r[3]]
        for n, (t, _key, op_id, _, sender) in enumerate(made[1:], 2):
            by = refs.get(sender or "") or _during(h, run, t, ("start", "poll"))
            v.findings.append(
                Finding(
                    "external-effect-semantics",
                    f"{run}: operation {op_id} is creation {n} of the run (one is allowed)"
                    + (f", created during {by.inc} {by.name}({run})" if by else ""),
                    run,
                    t,
                    by.ref if by else None,
                    near(h, by.proc if by else None, t, t),
                )
            )
        for i, (t, _key, _op_id, created, _) in enumerate(requests[1:], 1):
            if created:
                continue
            v.observed["create retried, one creation"] += 1
            previous, sender = requests[i - 1][0], requests[i - 1][4]
            first = refs.get(sender or "") or _during(h, run, previous, ("start",))
            again = refs.get(requests[i][4] or "") or _during(h, run, t, ("start",))
            _attribute_create(h, v, run, (previous, first), (t, again))
        final = runs.get(run, [])
        row = final[-1].row if final else {}
        if (
            made
            and row.get("status") not in (None, "queued")
            and row.get("external_op_id") != made[0][2]
        ):
            v.findings.append(
                Finding(
                    "receipt-with-effect",
                    f"{run} is {row.get('status')} with operation "
                    f"{row.get('external_op_id')} recorded, but the API created "
                    f"{made[0][2]}",
                    run,
                )
            )
        op = ops_at_api.get(row.get("external_op_id"))
        if row.get("status") == "succeeded" and op is not None and op["status"] != "succeeded":
            v.findings.append(
                Finding(
                    "receipt-with-effect",
                    f"{run} succeeded, but its operation {op['id']} is {op['status']}",
                    run,
                )
            )


def _during(h: History, run: str, t: float, names: tuple[str, ...]) -> Op | None:
    """The operation on ``run`` that was running at ``t`` (the latest begun, if several)."""
    found = [o for o in h.on(run) if o.name in names and o.t0 <= t <= h.until(o)]
    return max(found, key=lambda o: o.t0) if found else None


def _ended(h: History, op: Op | None, otherwise: float) -> float:
    end = h.until(op) if op is not None else otherwise
    return otherwise if end == float("inf") else end


def _attribute_create(
    h: History, v: Verdict, run: str, first: tuple[float, Op | None], again: tuple[float, Op | None]
) -> None:
    """A create request the API deduplicated, attributed to the one of the two requests (the
    one that created the operation, the one answered with it) whose sender never recorded the
    operation: usually the first (its start failed after the API acted); the second when the
    first's sender recorded it (the second was sent earlier, by a start that gave up waiting,
    and arrived late)."""
    (t, owner), (t_again, other) = first, again
    late = owner is not None and owner.out == "won" and other is not None
    if late:
        t, owner = t_again, other
    if owner is None:
        cause = why = "the sender of the request is unknown"
    elif owner.t1 is None:
        cause = "its process died after the create was sent, before its COMMIT"
        why = "start died before COMMIT"
    elif late:
        cause = f"its start ended {owner.out}, and its request arrived after the operation existed"
        why = f"late request of a start that ended {owner.out}"
    else:
        cause = f"its start ended {owner.out} after the API acted on its create"
        why = f"start ended {owner.out}"
    v.duplicates.append(
        Duplicate(
            run,
            f"create request for {run} acted on more than once",
            t,
            owner.inc if owner else "?",
            owner.ref if owner else "?",
            cause,
            near(h, owner.proc if owner else None, owner.t0 if owner else t, _ended(h, owner, t)),
            why,
        )
    )
