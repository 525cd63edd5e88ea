"""The benchmarks: each runs for about a second with small sizes and reports positive figures and
its ratio lines. No speed is asserted here: speed lives in the benchmark's printed ratios.

The outbox bench measures the peer queues that are installed (the ``bench`` extra) and names each
one that is not in one line. Also the worker loop it measures: it records a batch's outcomes in
one statement (or each row in its own, when asked), runs its single-statement transactions in
autocommit (one round trip each), keeps the fence, and reports a connection lost during a
statement as an indeterminate commit.
"""

from __future__ import annotations

import argparse
import os
import sys

import psycopg
import pytest

from knownstate.chaos import bench
from knownstate.impl import outbox as impl
from knownstate.impl.errors import CommitIndeterminate, ConnectionLost
from knownstate.model.contract import LostRace, Won
from knownstate.model.outbox import Report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knownstate")
    bench.add_parser(p.add_subparsers(dest="command"))
    return p


def children() -> set[int]:
    """Live (not zombie) child processes of this test process."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            stat = bench.measure._proc_stat(pid)
            if stat and int(stat[1]) == os.getpid() and stat[0] != "Z":
                out.add(int(pid))
    return out


def test_cli_defaults_and_sub_commands():
    a = parser().parse_args(["bench", "outbox"])
    assert (a.workers, a.seconds, a.batch, a.effect, a.durability, a.peers, a.func) == (
        4,
        10.0,
        (1, 10, 100),
        "noop",
        "fsync",
        (),
        bench.run_outbox,
    )
    a = parser().parse_args(["bench", "documents"])
    assert (a.clients, a.seconds, a.rate, a.func) == (8, 10.0, None, bench.run_documents)
    a = parser().parse_args(
        [
            "bench",
            "outbox",
            "--workers",
            "2",
            "--seconds",
            "1.5",
            "--batch",
            "3,30",
            "--effect",
            "both",
            "--durability",
            "no-fsync",
            "--peers",
            "procrastinate,pgqueuer",
        ]
    )
    assert (a.workers, a.seconds, a.batch, a.effect, a.durability, a.peers) == (
        2,
        1.5,
        (3, 30),
        "both",
        "no-fsync",
        ("procrastinate", "pgqueuer"),
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--effect", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
        (["--seconds", "0"], "must be more than 0"),
        (["--durability", "maybe"], "invalid choice: 'maybe'"),
        (["--peers", "celery"], "unknown peer 'celery': choose from pgqueuer, procrastinate"),
        (["--batch", "10,ten"], "not a list of whole numbers: '10,ten'"),
        (["--batch", "10,10"], "must be distinct sizes in 1..10000, got 10,10"),
        (["--batch", "0"], "must be distinct sizes in 1..10000, got 0"),
    ],
)
def test_bad_input_is_one_line_naming_the_problem(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["bench", "outbox", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "".join(err)


def test_bounds_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="--workers"):
        bench.bench_outbox(workers=0, seconds=1)
    with pytest.raises(ValueError, match="seconds"):
        bench.bench_outbox(workers=1, seconds=bench.MAX_SECONDS + 1)
    with pytest.raises(ValueError, match="--batch"):
        bench.bench_outbox(workers=1, seconds=1, batches=(0,))
    with pytest.raises(ValueError, match="effect"):
        bench.bench_outbox(workers=1, seconds=1, effect="pigeon")
    with pytest.raises(ValueError, match="durability 'maybe': fsync or no-fsync"):
        bench.bench_outbox(workers=1, seconds=1, durability="maybe")
    with pytest.raises(ValueError, match="unknown peer 'celery'"):
        bench.bench_outbox(workers=1, seconds=1, peers=("celery",))
    with pytest.raises(ValueError, match="--clients"):
        bench.bench_documents(clients=bench.MAX_LOOPS + 1, seconds=1)
    with pytest.raises(ValueError, match="--rate"):
        bench.bench_documents(clients=1, seconds=1, rate=0)
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "documents", "--rate", "fast"])


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


@pytest.mark.slow
def test_bench_outbox_side_by_side_reports_figures_and_ratios(monkeypatch, capsys):
    """Ours (batched and per row), each peer installed, and the ceiling, at two batch sizes."""
    before = children()
    r = bench.bench_outbox(
        workers=2,
        seconds=1,
        batches=(1, 5),
        effect="both",
        durability="no-fsync",
        peers=bench.PEERS,
    )
    assert children() <= before, "the sink process outlived the bench"
    installed = [p for p, v in r["peers"].items() if v]
    assert set(r["peers"]) == set(bench.PEERS)
    assert r["figures"] == [bench.OURS, bench.OURS_PER_ROW, bench.OURS_SINK, *installed]
    assert list(r["runs"]) == [1, 5]
    for batch, run in r["runs"].items():
        assert set(run) == {"ceiling", *r["figures"]}
        assert positive(run["ceiling"]["per_second"], run["ceiling"]["count"])
        for name in r["figures"]:
            d = run[name]
            assert positive(
                d["per_second"], d["count"], d["ratio"], d["tx_per_job"], d["wal_per_job"]
            ), (name, d)
            assert not d["starved"], (batch, name, d)
        for name in (bench.OURS, bench.OURS_PER_ROW, bench.OURS_SINK):
            assert run[name]["errors"] == run[name]["fenced"] == run[name]["failed"] == 0, run[name]
        # Transactions per job follow from the protocol: a claim, and a record per batch or row.
        assert run[bench.OURS]["tx_per_job"] == pytest.approx(2 / batch, rel=0.25)
        assert run[bench.OURS_PER_ROW]["tx_per_job"] == pytest.approx(1 + 1 / batch, rel=0.25)
    for modes in r["plans"].values():
        assert all(s.startswith("Index Scan using outbox_delivery_pkey") for s in modes.values())

    monkeypatch.setattr(bench, "bench_outbox", lambda *a, **k: r)
    args = parser().parse_args(
        ["bench", "outbox", "--workers", "2", "--seconds", "1", "--batch", "1,5"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "ratios at batch 1 / 5:" in out and "outbox / ceiling" in out
    assert "outbox / outbox-per-row" in out
    assert "what limits ours" in out and "jobs/s" in out and "the fenced writes' plans" in out
    for p, v in r["peers"].items():
        assert (f"outbox / {p}" in out) if v else (f"{p}: not installed, not measured" in out)


@pytest.mark.slow
def test_a_peer_not_installed_is_one_line_not_a_traceback(monkeypatch, capsys):
    for p in bench.PEERS:
        monkeypatch.setitem(sys.modules, p, None)  # what an environment without the bench extra has
    assert bench.peer_versions(bench.PEERS) == {p: None for p in bench.PEERS}
    args = parser().parse_args(
        [
            "bench",
            "outbox",
            "--workers",
            "1",
            "--seconds",
            "0.5",
            "--batch",
            "2",
            "--durability",
            "no-fsync",
            "--peers",
            "pgqueuer,procrastinate",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out
    for p in bench.PEERS:
        line = f"{p}: not installed, not measured (pip install -e '.[bench]')"
        assert out.count(line) == 2  # in the progress, and in the report


@pytest.mark.slow
def test_bench_documents_reports_throughput_latency_and_ratio(monkeypatch, capsys):
    before = children()
    r = bench.bench_documents(clients=2, seconds=1, rate=50)
    assert children() <= before, "the document server process outlived the bench"
    d = r["documents"]
    assert positive(
        r["ceiling"]["per_second"],
        d["per_second"],
        d["count"],
        d["ratio"],
        d["p50_ms"],
        d["p99_ms"],
    )
    assert d["p50_ms"] <= d["p99_ms"]
    assert d["conflicts"] == 0 and d["errors"] == 0  # one document per client: nothing to conflict
    o = r["open_loop"]  # 50 PUT/s for 1 s, every one answered
    assert (o["requests"], o["saves"], o["errors"], o["conflicts"]) == (50, 50, 0, 0)
    assert 0 < o["p50_ms"] <= o["p99_ms"] <= o["max_ms"]

    monkeypatch.setattr(bench, "bench_documents", lambda *a, **k: r)
    args = parser().parse_args(
        ["bench", "documents", "--clients", "2", "--seconds", "1", "--rate", "50"]
    )
    assert args.rate == 50.0 and args.func(args) == 0
    out = capsys.readouterr().out
    assert "ratio documents = " in out and "PUT/s" in out and "p50" in out and "p99" in out
    assert "PUT latency at 50/s" in out and "what limits it" in out


# -- the loop the outbox bench measures ------------------------------------------------------


class Counting(psycopg.Connection):
    """A connection that counts the statements it sends."""

    statements = 0

    def execute(self, *args, **kwargs):
        self.statements += 1
        return super().execute(*args, **kwargs)


@pytest.mark.parametrize("per_row, statements", [(False, 2), (True, 5)], ids=["batched", "per-row"])
def test_worker_loop_runs_in_autocommit_and_keeps_the_fence(knownstate_db, per_row, statements):
    """Batched: one claim and one record for the whole batch. Per row: one claim, then a record
    per row (4 rows). Either way a row taken over meanwhile is fenced, the others recorded."""
    dsn = knownstate_db(impl.SCHEMA)
    store = impl.OutboxStore()
    with psycopg.connect(dsn, autocommit=True) as admin:
        for i in (1, 2, 3, 4):
            store.enqueue(admin, i, {"n": i})
        seen = []

        def send(claim, payload):
            seen.append((claim.id, payload))
            if claim.id == 2:  # meanwhile its lease lapsed and another worker took it over
                admin.execute("update outbox_delivery set attempts = attempts + 1 where id = 2")
            return {3: impl.RETRYABLE}.get(claim.id, impl.OK)

        worker = impl.OutboxWorker(
            lambda: Counting.connect(dsn), store, send, batch=10, per_row=per_row
        )
        try:
            assert worker.run_once() == 4
            conn = worker.conn()
            assert conn.autocommit and conn.statements == statements
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        finally:
            worker.drop()
        assert seen == [(1, {"n": 1}), (2, {"n": 2}), (3, {"n": 3}), (4, {"n": 4})]
        stats = worker.stats
        assert (stats.done, stats.failed, stats.fenced, stats.errors) == (2, 1, 1, 0)
        rows = admin.execute(
            "select id, status, attempts, last_error from outbox_delivery order by id"
        ).fetchall()
        assert rows == [
            (1, "sent", 1, None),
            (2, "processing", 2, None),
            (3, "pending", 1, "sink answered retryable"),
            (4, "sent", 1, None),
        ]


@pytest.mark.parametrize(
    "autocommit, error", [(True, CommitIndeterminate), (False, ConnectionLost)]
)
def test_a_lost_connection_in_autocommit_is_an_indeterminate_commit(
    knownstate_db, autocommit, error
):
    """In autocommit the statement carries its own COMMIT: losing the connection then cannot mean
    "nothing committed". In a transaction it still does (the COMMIT was never sent)."""
    dsn = knownstate_db(impl.SCHEMA)
    store = impl.OutboxStore()
    with psycopg.connect(dsn, autocommit=True) as admin:
        store.enqueue(admin, 1)
        store.enqueue(admin, 2)
        (claim,) = [c for c, _ in store.claim_batch(admin, 1)]
        for op in (
            lambda conn: store.complete(conn, claim),
            lambda conn: store.claim_batch(conn, 1),
            lambda conn: store.record_batch(conn, [Report(claim, impl.OK)]),
        ):
            with psycopg.connect(dsn, autocommit=autocommit) as conn:
                admin.execute("select pg_terminate_backend(%s)", (conn.info.backend_pid,))
                with pytest.raises(error):
                    op(conn)
        assert store.complete(admin, claim) == Won("sent")
        assert store.complete(admin, claim) == LostRace("fenced")
