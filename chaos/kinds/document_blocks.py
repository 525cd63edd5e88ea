"""The document server under the scheduler: its operations raced at statement level.

The session rules send one request at a time, so the server never has two transactions on one
document at once. Here two or three of its operations start together, each on its own thread
and its own connection through the server's database link, the store's code unchanged: the
store takes its connections from a source (``DocumentStore(connections=...)``, where the pool
would hand each request one) that gives each operation its worker's
:class:`~knownstate.chaos.interleave.ScheduledConnection`, so every statement waits at a gate and
a schedule drawn from the example decides who runs next (:mod:`knownstate.chaos.interleave`).
What the HTTP layer adds to an operation is a mapping of its outcome to a status code; the
operations raced are the store's, which the API serves one for one.

The blocks (:data:`SCENARIOS`): saves on one version, a retry racing its original, a save racing
an owner's change of the access list (the saver may write before it), a read racing a save, and
a retry overtaking its original (the original's answer is lost on the way back while it is still
in flight, and only the retry's answer is seen).

How a block is scheduled: one operation is preempted once, after a drawn statement, while the
others run whole (:func:`~knownstate.chaos.schedules.preempted_once`); the original, in a retry
overtaking it. How a block counts for its scenario's requirement: by the preemption points it
covered. Each operation that ran first must have been preempted after each of its statements
but its last, three times each (the profile's count), as many statements as the scenario's
blocks saw it run first (:meth:`ServerBlocks._count_coverage`). A bug one preemption reveals is then
found before the reference could pass, whichever statement the preemption needs. The counts
depend on the server checked (a mutant that reads the version before its swap has one point
more), so they are learned as the run goes.

How it is judged: the outcomes, and the documents and access list read afterwards, must be
explained by some order of the operations applied to the server's pure model,
:class:`~knownstate.model.document_server.ServerModel` (:mod:`knownstate.chaos.linearize`). A
history no order explains fails the check through its one door, naming the invariants the real
world breaks (a version based on a stale one, a retry answered with a conflict against itself)
and otherwise the guarantee the refused outcome breaks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import psycopg
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.impl.documents.store import DocumentStore
from knownstate.model.contract import Violation, Won
from knownstate.model.document import Saved, SaveRequest, SeqTaken, Snapshot, VersionConflict
from knownstate.model.document_server import ServerModel

from .. import linearize, schedules
from ..harness import EnvironmentFault
from ..interleave import BlockResult, Op, ScheduledConnection, SchedulerEnvironmentError, history
from ..replay import Exchange, canon
from ..runner import needs
from .document_judge import show
from .document_plant import DOC

SCENARIOS = (
    "a save racing an access change",
    "a read racing a save",
    "saves on one version",
    "a retry racing its original",
    "a retry overtaking its original",
)
"""In the order Hypothesis favours (the first about four times as often as each other): the
two whose other operation is one statement first, since only their save, run first, has a
point to preempt (at seed 8, 23 of 62 blocks of a save racing an access change preempted
the save, 62 of 90 of a read racing a save)."""
SERVER_BLOCKS = tuple(needs(f"server block: {s}", "concurrency") for s in SCENARIOS)
"""The check's requirements: a run passes only once every scenario's preemption points were
covered (where blocks can run at all). Counted by block, 39 of 58 blocks of saves on one version
ran one after the other at seed 2, and a race two saves reveal was found after 4 to 126
examples at seeds 1-10, some of them close to where the reference passed."""
STRANGER = "carol"  # the user whose access the owner changes in a block (no tab is hers)
GRANT = "grant"  # the worker that lets her write before a block changes her access


def preempted_event(scenario: str, op: str, k: int) -> str:
    return f"server block: {scenario}: {op} preempted after statement {k}"


@dataclass(frozen=True)
class ServerCall:
    """One operation of the document server, by the name it has on the store and on the model
    (``get``, ``put``, ``share``, ``unshare``, ``access_list``), and its arguments. ``lost``:
    its answer never reaches the client (the server still runs it whole)."""

    worker: str
    op: str
    args: tuple
    lost: bool = False

    def apply(self, target: Any) -> Any:
        """Run it on a :class:`DocumentStore` or a :class:`ServerModel` (the same vocabulary)."""
        return getattr(target, self.op)(*self.args)

    @property
    def label(self) -> str:
        a = self.args
        if self.op == "put":
            user, _, base, content, writer, seq = a
            return f"{user} PUT {writer}#{seq} base v{base} {canon(content)}"
        if self.op == "get":
            return f"{a[0]} GET"
        if self.op == "share":
            return f"{a[0]} shares with {a[2]} ({'write' if a[3] else 'read'})"
        if self.op == "unshare":
            return f"{a[0]} stops sharing with {a[2]}"
        return f"{a[0]} {self.op}"

    @property
    def request(self) -> SaveRequest | None:
        """The save as a session's request (the receipts' judge reads it), for a put."""
        if self.op != "put":
            return None
        user, doc_id, base, content, writer, seq = self.args
        return SaveRequest(doc_id, user, writer, seq, base, dict(content), 0)


# ---------------------------------------------------------------------------------------
# Running a block and judging it (the check's rule and the tests use these).
# ---------------------------------------------------------------------------------------


def run_block(
    scheduler,
    dsn: str,
    make_store: Callable[..., DocumentStore],
    calls: Sequence[ServerCall],
    choose: Callable[[list[str]], str],
) -> BlockResult:
    """Run ``calls`` together, one connection each (``dsn``: the server's database link), on one
    store built by ``make_store(connections=...)`` as the server's is, scheduled by ``choose``."""
    seat = threading.local()
    store = make_store(connections=lambda: contextlib.nullcontext(seat.conn))
    conns: list[ScheduledConnection] = []
    try:
        for _ in calls:
            conns.append(ScheduledConnection.connect(dsn, autocommit=True, connect_timeout=5))
    except psycopg.OperationalError as e:
        for c in conns:
            c.close()
        raise EnvironmentFault(
            f"a server block could not connect to the database through the server's link: {e}"
        ) from None

    def op(call: ServerCall, conn: ScheduledConnection) -> Op:
        def run(c):
            seat.conn = c
            return call.apply(store)

        return Op(call.worker, call.label, conn, run)

    try:
        return scheduler.run([op(c, conn) for c, conn in zip(calls, conns)], choose)
    except SchedulerEnvironmentError as e:
        raise EnvironmentFault(f"a server block could not run: {e}") from None
    finally:
        for c in conns:
            with contextlib.suppress(Exception):
                c.close()
        store.close()


ACL_SQL = "SELECT document_id, user_id, can_write FROM document_acl ORDER BY 1, 2"


def model_rows(server: ServerModel) -> str:
    """The model's documents (with their history) and access lists, as the rows read them."""
    docs = {
        d.id: [d.kind, d.version, dict(d.content), [dataclasses.astuple(h) for h in d.history]]
        for d in server.docs.values()
    }
    acl = sorted([d.id, u, w] for d in server.docs.values() for u, w in d.acl.items())
    return canon({"docs": docs, "acl": acl})


def real_rows(documents: dict, acl: list[tuple]) -> str:
    """The same from the database: ``documents`` as :meth:`DocumentStore.documents` reads them,
    ``acl`` as :data:`ACL_SQL`."""
    docs = {
        d.id: [d.kind, d.version, dict(d.content), [dataclasses.astuple(h) for h in d.history]]
        for d in documents.values()
    }
    return canon({"docs": docs, "acl": sorted([list(r) for r in acl])})


def judge_block(
    result: BlockResult, calls: Sequence[ServerCall], servers: Sequence[ServerModel], rows: str
) -> linearize.Verdict:
    """Is the block linearizable against the server's model, from ``servers`` (the possible
    states before it), ending in ``rows`` (:func:`real_rows`)? A lost answer is not compared."""
    by_worker = {c.worker: c for c in calls}
    ops = history(result, {c.worker: c.apply for c in calls})
    ops = [
        dataclasses.replace(o, output=linearize.UNKNOWN) if by_worker[o.client].lost else o
        for o in ops
    ]
    return linearize.check(
        ops, list(servers), copy=copy.deepcopy, final=linearize.FinalState(rows, model_rows)
    )


def broken_by(observed: Any, answers: Sequence[Any]) -> tuple[str, ...]:
    """The guarantee an observed outcome breaks where the model answers ``answers`` instead."""
    replayed = [a for a in answers if isinstance(a, Won) and getattr(a.value, "replayed", False)]
    if isinstance(observed, (VersionConflict, SeqTaken)) and replayed:
        return ("retry-answered-from-receipt",)
    if isinstance(observed, Won) and isinstance(observed.value, Saved):
        if not observed.value.replayed and any(a != observed for a in answers):
            return ("no-stale-save-accepted",)
    return ()


def describe_outcome(x: Any) -> str:
    if isinstance(x, Won) and isinstance(x.value, Snapshot):
        return f"v{x.value.version} {canon(x.value.content)}"
    return show(x)


# ---------------------------------------------------------------------------------------
# The rule.
# ---------------------------------------------------------------------------------------


class ServerBlocks:
    """The server-block rule of the document-session check (a mixin)."""

    server_blocks = True
    """Whether the check races the server's operations (a check of another client keeps its
    own rules to the client)."""

    def _may_race_server(self) -> bool:
        return (
            self.server_blocks
            and self.budget["server block"]
            and "concurrency" in self.run.capabilities
            and len(self.worlds) == 1
            and self._server_calm()
        )

    @precondition(lambda self: self._may_race_server())
    @rule(data=st.data(), scenario=st.sampled_from(SCENARIOS))
    def race_the_server(self, data, scenario: str) -> None:
        """Two or three of the server's operations at once, scheduled statement by statement,
        judged by linearizability against the server's model."""
        self.budget["server block"] -= 1
        calls, choose = self._server_calls(data, scenario)
        self.begin_step(len(calls))
        make = self._server_store
        res = run_block(self.ws.scheduler(), self.plant.server_dsn, make, calls, choose)
        self.log(f"SERVER BLOCK ({scenario}) " + " | ".join(f"{c.worker} {c.label}" for c in calls))
        self.trace.extend(f"  {line}" for line in res.trace[1:])
        for c, r in zip(calls, res.ops):
            if r.error is None:
                seen = "(answer lost)" if c.lost else describe_outcome(r.value)
                self.trace.append(f"    {c.worker} -> {seen}")
        self.event("server block")
        self._count_coverage(scenario, calls, res)
        self.event("lock wait in a server block", res.waits)
        after = real_rows(self.observer.documents(), self.ws.query(ACL_SQL))
        world = self.worlds[0]
        verdict = judge_block(res, calls, [world.model.server], after)
        if not verdict.ok:
            self._server_block_failed(verdict, calls, res, world.model)
        kept = []
        for server in verdict.final_states:
            w = world.fork()
            w.model.server = copy.deepcopy(server)
            kept.append(w)
        self.worlds = kept
        self.after_step()

    def _server_store(self, connections) -> DocumentStore:
        return self.store_class(
            self.plant.server_dsn, queries=self.queries, connections=connections
        )

    def _server_block_failed(self, verdict, calls, res: BlockResult, model) -> None:
        names: tuple[str, ...] = ()
        nexts = zip(verdict.next_refused, verdict.next_answers)
        refused = verdict.refused_anywhere or tuple((op, a, ()) for (op, _), a in nexts)
        for op, answers, _ in refused:
            names += broken_by(op.output, answers)
        exchanges = [
            Exchange(c.worker, c.request, r.value)
            for c, r in zip(calls, res.ops)
            if c.request is not None and not c.lost and r.error is None
        ]
        real = self.observe_impl()
        violations = self.judge(real, model, exchanges)
        problem = "\n".join(verdict.explain())
        found = {v.invariant for v in violations}
        violations += [Violation(n, problem) for n in dict.fromkeys(names) if n not in found]
        self.fail(problem, violations)

    def _count_coverage(self, scenario: str, calls: Sequence[ServerCall], res: BlockResult) -> None:
        """Count the preemption points the block covered (an operation with another's statement
        between its k-th and its next), and set its scenario's requirement to the fewest times
        any point of the scenario was covered: for each operation, each k after which it went
        on with another statement when it ran first (up to
        :data:`~knownstate.chaos.schedules.PREEMPTION_POINTS`), the one a block preempts. Only
        what ran first counts: a save run whole after another misses its swap and reads why,
        a statement more than it can run first. Where no operation of the scenario ran two
        statements first, it is the scenario's blocks instead."""
        ops = {c.worker: c.op for c in calls if c.worker != GRANT}
        steps = [w for w in res.schedule if w in ops]
        seen = self.run.learned.setdefault(f"server block: {scenario}", {"blocks": 0, "points": {}})
        seen["blocks"] += 1
        for worker, op in ops.items():
            mine = [i for i, w in enumerate(steps) if w == worker]
            gaps = [k for k, (i, j) in enumerate(zip(mine, mine[1:]), 1) if j > i + 1]
            for k in gaps:
                self.event(preempted_event(scenario, op, k))
            if steps and worker == steps[0]:  # an operation may end before any statement
                unpreempted = min(gaps, default=len(mine) - 1)
                seen["points"][op] = max(seen["points"].get(op, 0), unpreempted)
        events = self.stats.events
        points = [
            events[preempted_event(scenario, op, k)]
            for op, n in seen["points"].items()
            for k in range(1, min(n, schedules.PREEMPTION_POINTS) + 1)
        ]
        events[f"server block: {scenario}"] = min(points, default=seen["blocks"])

    def _server_calls(self, data, scenario: str) -> tuple[list[ServerCall], Callable]:
        """The operations of a block of ``scenario`` on the document as the model has it now,
        and the block's schedule."""
        v = self.worlds[0].model.server.docs[DOC].version

        def save(worker: str, user: str) -> ServerCall:
            self.edits += 1  # a writer and a title nobody else uses
            content = {"title": f"{user}.blk.{self.edits}"}
            return ServerCall(worker, "put", (user, DOC, v, content, f"blk-{self.edits}", 1))

        users = st.sampled_from(["alice", "bob"])
        first = None
        if scenario == "saves on one version":
            n = data.draw(st.integers(2, 3), label="saves")
            calls = [save(f"s{i}", data.draw(users, label="who saves")) for i in range(1, n + 1)]
        elif scenario in ("a retry racing its original", "a retry overtaking its original"):
            original = save("original", data.draw(users, label="who saves"))
            lost = scenario.startswith("a retry overtaking")
            retry = dataclasses.replace(original, worker="retry")
            calls = [dataclasses.replace(original, lost=lost), retry]
            first = "original" if lost else None
        elif scenario == "a save racing an access change":
            change = data.draw(st.sampled_from(["write", "read", "none"]), label="access change")
            if change == "none":
                acl = ServerCall("owner", "unshare", ("alice", DOC, STRANGER))
            else:
                acl = ServerCall("owner", "share", ("alice", DOC, STRANGER, change == "write"))
            calls = [save("saver", STRANGER), acl]
            if not self.worlds[0].model.server.docs[DOC].acl.get(STRANGER):
                grant = ServerCall(GRANT, "share", ("alice", DOC, STRANGER, True))
                race = schedules.preempted_once(data, [c.worker for c in calls])
                return [grant, *calls], lambda ready: GRANT if GRANT in ready else race(ready)
        else:
            reader = data.draw(st.sampled_from(["alice", "bob", STRANGER]), label="who reads")
            calls = [save("saver", "alice"), ServerCall("reader", "get", (reader, DOC))]
        return calls, schedules.preempted_once(data, [c.worker for c in calls], first)
