"""The document server's operations raced at statement level (chaos/kinds/document_blocks.py)
on the real parts: the store's own code on real PostgreSQL, each operation on its own scheduled
connection, judged by linearizability against the server's model — never by counting winners
by hand. Each test pins what a server that is not atomic would get wrong, and shows the judge
catches it on the same schedule."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import psycopg
import pytest

from knownstate.chaos import schedules
from knownstate.chaos.harness import Stats
from knownstate.chaos.interleave import BlockResult, Scheduler
from knownstate.chaos.kinds.document_blocks import (
    ACL_SQL,
    ServerBlocks,
    ServerCall,
    judge_block,
    real_rows,
    run_block,
)
from knownstate.chaos.kinds.document_mutants import MUTANTS
from knownstate.chaos.kinds.document_plant import DOC, INITIAL, SCHEMA
from knownstate.chaos.kinds.document_session import DocumentSessionCheck
from knownstate.impl.documents.store import DocumentStore, schema_sql
from knownstate.model.document_server import ServerModel
from fixed_draws import FixedDraws


@pytest.fixture
def dsn(knownstate_db, knownstate_cluster):
    return knownstate_db(schema_sql())


@pytest.fixture
def scheduler(dsn):
    s = Scheduler(dsn, pause=True)
    yield s
    s.close()


def _mutant_store(name: str):
    """The store class and queries a mutant of the catalogue runs the server with."""
    check = next(m for m in MUTANTS if m.name == name).machine(DocumentSessionCheck)
    return check.store_class, check.queries


def _block(dsn, scheduler, calls, choose, store_class=DocumentStore, queries=None):
    """Seed the document, run ``calls`` as one block, and judge it from the seeded model."""
    with DocumentStore(dsn, pool_size=None) as admin:
        admin.reset()
        admin.seed(DOC, "record", SCHEMA, INITIAL, "alice", {"bob": True})
        model = ServerModel()
        model.seed(DOC, "record", SCHEMA, INITIAL, "alice", {"bob": True})

        def make(**kwargs):
            return store_class(dsn, queries=queries, **kwargs)

        res = run_block(scheduler, dsn, make, calls, choose)
        with psycopg.connect(dsn) as conn:
            acl = conn.execute(ACL_SQL).fetchall()
        return res, judge_block(res, calls, [model], real_rows(admin.documents(), acl))


def _save(worker: str, user: str, writer: str, n: int, base: int = 1) -> ServerCall:
    return ServerCall(worker, "put", (user, DOC, base, {"title": f"{writer}.{n}"}, writer, 1))


def _round_robin():
    """Each worker in turn: every save reads before any writes."""
    turn = itertools.count()
    return lambda options: options[next(turn) % len(options)]


@pytest.mark.parametrize("seed", [1, 2])
def test_fifty_concurrent_saves_on_one_version_have_one_winner(dsn, scheduler, seed):
    calls = [_save(f"s{i}", ("alice", "bob")[i % 2], f"w{i}", i) for i in range(50)]
    rng = random.Random(seed)
    res, verdict = _block(dsn, scheduler, calls, lambda options: rng.choice(options))
    why = "\n".join(verdict.explain() + list(res.trace))
    assert verdict.ok, f"seed {seed} (replay: pytest {__file__} -k 'fifty and {seed}'):\n{why}"
    # the model admits one winner on one version: the rows ended at v2, as one order explains
    assert [s.docs[DOC].version for s in verdict.final_states] == [2]


def test_saves_compared_in_python_are_judged_not_linearizable(dsn, scheduler):
    calls = [_save(f"s{i}", "alice", f"w{i}", i) for i in range(3)]
    store_class, queries = _mutant_store("cas-compared-in-python")
    _, ok = _block(dsn, scheduler, calls, _round_robin())
    assert ok.ok, "\n".join(ok.explain())
    res, bad = _block(dsn, scheduler, calls, _round_robin(), store_class, queries)
    assert bad.ok is False, "\n".join(res.trace)
    assert "not linearizable" in "\n".join(bad.explain())


def test_a_retry_racing_its_original_is_answered_from_the_receipt(dsn, scheduler):
    original = _save("original", "bob", "w1", 1)
    calls = [original, ServerCall("retry", original.op, original.args)]
    _, ok = _block(dsn, scheduler, calls, _round_robin())
    assert ok.ok, "\n".join(ok.explain())
    store_class, queries = _mutant_store("receipt-looked-up-before-the-swap-only")
    res, bad = _block(dsn, scheduler, calls, _round_robin(), store_class, queries)
    assert bad.ok is False, "\n".join(res.trace)


def test_a_save_racing_an_access_change_and_a_read_racing_a_save(dsn, scheduler):
    for calls in (
        [
            ServerCall("owner", "share", ("alice", DOC, "carol", True)),
            _save("saver", "carol", "w1", 1),
        ],
        [ServerCall("reader", "get", ("bob", DOC)), _save("saver", "alice", "w1", 1)],
    ):
        for first in ([0, 1], [1, 0]):
            order = itertools.cycle([calls[i].worker for i in first])

            def choose(options, order=order):
                want = next(order)
                return want if want in options else options[0]

            res, verdict = _block(dsn, scheduler, calls, choose)
            assert verdict.ok, "\n".join(verdict.explain() + list(res.trace))


def test_one_preemption_finds_a_version_compared_in_python_exactly_after_its_read(dsn, scheduler):
    """Two saves on one version, the first preempted after each of its statements in turn: the
    reference is linearizable at every point; the mutant that reads the version, compares it
    in Python and then updates loses an update only when preempted after that read (its second
    statement), the point a block preempts when it draws 2."""
    calls = [_save("s1", "alice", "w1", 1), _save("s2", "bob", "w2", 2)]
    store_class, queries = _mutant_store("cas-compared-in-python")
    caught = []
    for k in range(1, schedules.PREEMPTION_POINTS + 1):
        choose = schedules.preempted_once(FixedDraws(["s1", "s2"], k), ["s1", "s2"])
        res, ok = _block(dsn, scheduler, calls, choose)
        assert ok.ok, f"reference, preempted after {k}:\n" + "\n".join(res.trace)
        first = min(k, res.schedule.count("s1"))
        assert res.schedule[:first] == ("s1",) * first
        choose = schedules.preempted_once(FixedDraws(["s1", "s2"], k), ["s1", "s2"])
        res, bad = _block(dsn, scheduler, calls, choose, store_class, queries)
        if not bad.ok:
            caught.append(k)
    assert caught == [2]


class _Counting(ServerBlocks):
    """The coverage count of server blocks, without a database."""

    def __init__(self):
        self.run = SimpleNamespace(learned={}, stats=Stats())
        self.stats = self.run.stats

    def event(self, name, n=1):
        self.stats.events[name] += n

    def count(self, scenario, *schedule):
        calls = [ServerCall(w, "put", ()) for w in dict.fromkeys(schedule)]
        self._count_coverage(scenario, calls, BlockResult((), tuple(schedule), ()))
        return self.stats.events[f"server block: {scenario}"]


def test_a_scenario_counts_the_fewest_covers_of_the_points_its_first_operation_is_preempted_at():
    """A save run first whole in two statements has one point, after its first: a block run one
    after the other covers none of it; one preempting it there covers it. A save seen to run
    three statements first has two, so the scenario is short again until the second is
    covered. Only what ran first counts (a save run after another misses and reads why: three
    statements it never runs first). Where nothing ran two statements first, blocks count."""
    c = _Counting()
    saves = "saves on one version"
    assert c.count(saves, "s1", "s1", "s2", "s2", "s2") == 0
    assert c.count(saves, "s1", "s2", "s2", "s2", "s1", "s1") == 1
    assert c.count(saves, "s2", "s1", "s1", "s1", "s2", "s2") == 2
    assert c.count(saves, "s1", "s1", "s1", "s2", "s2") == 0  # a point after statement 2 now
    assert c.count(saves, "s1", "s1", "s2", "s2", "s1") == 1
    assert c.count("a read racing a save", "r", "s") == 1
    assert c.count("a read racing a save", "s", "r") == 2
