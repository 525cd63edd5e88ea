"""The benchmarks: each runs for about a second with small sizes and reports positive figures and
its ratio line. No speed is asserted here: speed lives in the benchmark's printed ratios.

Also the worker loop the outbox bench measures: it runs its single-statement transactions in
autocommit (one round trip each), keeps the fence, and reports a connection lost during a
statement as an indeterminate commit.
"""

from __future__ import annotations

import argparse
import os

import psycopg
import pytest

from knownstate.chaos import bench
from knownstate.impl import outbox as impl
from knownstate.impl.errors import CommitIndeterminate, ConnectionLost
from knownstate.model.contract import LostRace, Won


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knownstate")
    bench.add_parser(p.add_subparsers(dest="command"))
    return p


def children() -> set[int]:
    """Live (not zombie) child processes of this test process."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            stat = bench._proc_stat(pid)
            if stat and int(stat[1]) == os.getpid() and stat[0] != "Z":
                out.add(int(pid))
    return out


def test_cli_defaults_and_sub_commands():
    a = parser().parse_args(["bench", "outbox"])
    assert (a.workers, a.seconds, a.batch, a.effect, a.func) == (4, 10.0, 10, "both", bench.run_outbox)
    a = parser().parse_args(["bench", "documents"])
    assert (a.clients, a.seconds, a.rate, a.func) == (8, 10.0, None, bench.run_documents)
    a = parser().parse_args(["bench", "outbox", "--workers", "2", "--seconds", "1.5", "--batch", "3",
                             "--effect", "noop"])
    assert (a.workers, a.seconds, a.batch, a.effect) == (2, 1.5, 3, "noop")
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "outbox", "--effect", "carrier-pigeon"])
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "outbox", "--seconds", "0"])


def test_bounds_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="--workers"):
        bench.bench_outbox(workers=0, seconds=1)
    with pytest.raises(ValueError, match="seconds"):
        bench.bench_outbox(workers=1, seconds=bench.MAX_SECONDS + 1)
    with pytest.raises(ValueError, match="--batch"):
        bench.bench_outbox(workers=1, seconds=1, batch=0)
    with pytest.raises(ValueError, match="effect"):
        bench.bench_outbox(workers=1, seconds=1, effect="pigeon")
    with pytest.raises(ValueError, match="--clients"):
        bench.bench_documents(clients=bench.MAX_LOOPS + 1, seconds=1)
    with pytest.raises(ValueError, match="--rate"):
        bench.bench_documents(clients=1, seconds=1, rate=0)
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "documents", "--rate", "fast"])


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


@pytest.mark.slow
def test_bench_outbox_reports_figures_and_ratios(monkeypatch, capsys):
    before = children()
    r = bench.bench_outbox(workers=2, seconds=1, batch=5, effect="both")
    assert children() <= before, "the sink process outlived the bench"
    assert positive(r["ceiling"]["per_second"], r["ceiling"]["count"])
    for e in ("noop", "sink"):
        assert positive(r[e]["per_second"], r[e]["count"], r[e]["ratio"], r[e]["expected_ratio_cpu"]), r[e]
        assert r[e]["errors"] == 0 and r[e]["fenced"] == 0 and not r[e]["starved"], r[e]
    assert r["sink"]["sink_received"] == r["sink"]["sent"] and r["sink"]["sink_duplicates"] == 0
    assert "outbox_delivery_pkey" in r["completion_plan"]

    # What the command prints for these figures.
    monkeypatch.setattr(bench, "bench_outbox", lambda *a, **k: r)
    args = parser().parse_args(["bench", "outbox", "--workers", "2", "--seconds", "1", "--batch", "5"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "ratio noop = " in out and "ratio sink = " in out
    assert "deliveries/s" in out and "commits/s" in out and "what limits it" in out


@pytest.mark.slow
def test_bench_documents_reports_throughput_latency_and_ratio(monkeypatch, capsys):
    before = children()
    r = bench.bench_documents(clients=2, seconds=1, rate=50)
    assert children() <= before, "the document server process outlived the bench"
    d = r["documents"]
    assert positive(r["ceiling"]["per_second"], d["per_second"], d["count"], d["ratio"],
                    d["p50_ms"], d["p99_ms"])
    assert d["p50_ms"] <= d["p99_ms"]
    assert d["conflicts"] == 0 and d["errors"] == 0  # one document per client: nothing to conflict
    o = r["open_loop"]                               # 50 PUT/s for 1 s, every one answered
    assert (o["requests"], o["saves"], o["errors"], o["conflicts"]) == (50, 50, 0, 0)
    assert 0 < o["p50_ms"] <= o["p99_ms"] <= o["max_ms"]

    monkeypatch.setattr(bench, "bench_documents", lambda *a, **k: r)
    args = parser().parse_args(["bench", "documents", "--clients", "2", "--seconds", "1",
                                "--rate", "50"])
    assert args.rate == 50.0 and args.func(args) == 0
    out = capsys.readouterr().out
    assert "ratio documents = " in out and "PUT/s" in out and "p50" in out and "p99" in out
    assert "PUT latency at 50/s" in out and "what limits it" in out


# -- the loop the outbox bench measures ------------------------------------------------------


def test_worker_loop_runs_in_autocommit_and_keeps_the_fence(fresh_db):
    dsn = fresh_db(impl.SCHEMA)
    store = impl.OutboxStore()
    with psycopg.connect(dsn, autocommit=True) as admin:
        for i in (1, 2, 3):
            store.enqueue(admin, i, {"n": i})
        seen = []

        def send(claim, payload):
            seen.append((claim.id, payload))
            if claim.id == 2:  # meanwhile its lease lapsed and another worker took it over
                admin.execute("update outbox_delivery set attempts = attempts + 1 where id = 2")
            return impl.OK

        worker = impl.OutboxWorker(lambda: psycopg.connect(dsn), store, send, batch=10)
        try:
            assert worker.run_once() == 3
            assert worker.conn.autocommit
            assert worker.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        finally:
            worker.conn.close()
        assert seen == [(1, {"n": 1}), (2, {"n": 2}), (3, {"n": 3})]
        assert (worker.stats.sent, worker.stats.fenced, worker.stats.errors) == (2, 1, 0)
        rows = admin.execute("select id, status, attempts from outbox_delivery order by id").fetchall()
        assert rows == [(1, "sent", 1), (2, "processing", 2), (3, "sent", 1)]


@pytest.mark.parametrize("autocommit, error", [(True, CommitIndeterminate), (False, ConnectionLost)])
def test_a_lost_connection_in_autocommit_is_an_indeterminate_commit(fresh_db, autocommit, error):
    """In autocommit the statement carries its own COMMIT: losing the connection then cannot mean
    "nothing committed". In a transaction it still does (the COMMIT was never sent)."""
    dsn = fresh_db(impl.SCHEMA)
    store = impl.OutboxStore()
    with psycopg.connect(dsn, autocommit=True) as admin:
        store.enqueue(admin, 1)
        store.enqueue(admin, 2)
        (claim,) = [c for c, _ in store.claim_batch(admin, 1)]
        for op in (lambda conn: store.complete(conn, claim), lambda conn: store.claim_batch(conn, 1)):
            with psycopg.connect(dsn, autocommit=autocommit) as conn:
                admin.execute("select pg_terminate_backend(%s)", (conn.info.backend_pid,))
                with pytest.raises(error):
                    op(conn)
        assert store.complete(admin, claim) == Won("sent")
        assert store.complete(admin, claim) == LostRace("fenced")
