"""Real worker processes against the real notification sink: a worker dies, nothing is lost.

Three OS processes each run the reference :class:`OutboxWorker` loop (claim a batch, POST each
delivery to the sink, record the batch's outcomes with one fenced write, each row fenced on its
own) over a few hundred deliveries. One
of them — the victim, whose path to the sink is slow (a latency toxic on its own Toxiproxy link) —
is SIGKILLed while it holds a claimed batch. Its rows stay ``processing`` until the database
clock passes their lease and the reaper takes them back; the survivors then deliver them again.

What must hold: every delivery ends ``sent``, the sink received the very attempt that was
recorded as sent, no row is left ``processing``, and the victim's rows that had already reached
the sink are delivered twice — the documented at-least-once duplicate, counted and printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import polling
import psycopg
import pytest

from knownstate.chaos import tools
from knownstate.chaos.sink import NotificationSink
from knownstate.chaos.toxi import Toxic
from knownstate.impl import outbox as impl
from knownstate.impl.outbox import OutboxStore
from knownstate.model.contract import Won
from knownstate.model.outbox import Config

N = 300
LEASE = 300

# The worker process: the reference loop, unchanged. It reports on stdout what it claimed and what
# it recorded (so the test knows what the victim held when it died) and stops when stdin closes.
WORKER = r"""
import json, sys, threading
import psycopg
from knownstate.impl.outbox import OutboxStore, OutboxWorker, send_to_sink
from knownstate.model.outbox import Config

dsn, sink_url, lease = sys.argv[1], sys.argv[2], int(sys.argv[3])

def say(*words):
    print(*words, flush=True)

class Reporting(OutboxStore):
    def claim_batch(self, conn, batch):
        claimed = super().claim_batch(conn, batch)
        if claimed:
            say("claimed", *(f"{c.id}:{c.attempt}" for c, _ in claimed))
        return claimed

    def record_batch(self, conn, reports, errors=None):
        out = super().record_batch(conn, reports, errors)
        for r, o in zip(reports, out.value):
            say("recorded", f"{r.claim.id}:{r.claim.attempt}", type(o).__name__)
        return out

def connect():
    conn = psycopg.connect(dsn)
    say("backend", conn.info.backend_pid)
    return conn

stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
worker = OutboxWorker(connect, Reporting(Config(lease=lease)),
                      lambda c, p: send_to_sink(sink_url, c, p), stop, batch=10,
                      idle=0.01)  # the worker's own poll interval
say("ready")
worker.run()
say("stats", json.dumps(vars(worker.stats)))
"""


class WorkerProcess:
    """One worker OS process and the lines it printed."""

    def __init__(self, name: str, dsn: str, sink_url: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, dsn, sink_url, str(LEASE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=tools.die_with_parent,
        )
        self.lines: list[list[str]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append(line.split())

    def said(self, word: str) -> list[list[str]]:
        with self._lock:
            return [line[1:] for line in self.lines if line and line[0] == word]

    def claims(self) -> set[tuple[int, int]]:
        return {tuple(map(int, t.split(":"))) for line in self.said("claimed") for t in line}

    def recorded(self) -> set[tuple[int, int]]:
        return {tuple(map(int, line[0].split(":"))) for line in self.said("recorded")}

    def mid_batch(self, received: set[tuple[int, int]]) -> bool:
        """It holds claimed rows it has not recorded, and the sink already received one of them
        (the loop records a batch once its last send returned)."""
        return bool((self.claims() - self.recorded()) & received)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=10)

    def finish(self) -> dict:
        """Close stdin (the stop signal), wait for a clean exit, return the loop's stats."""
        self.proc.stdin.close()
        assert self.proc.wait(timeout=20) == 0, (
            f"{self.name} exited {self.proc.returncode}: {self.proc.stderr.read()}"
        )
        self._reader.join(timeout=10)
        (stats,) = self.said("stats")
        return json.loads(" ".join(stats))


def poll(what: str, predicate, deadline_s: float = 30.0, procs: list[WorkerProcess] = ()):
    """:func:`polling.poll`, failing at once when one of ``procs`` exits (not by SIGKILL)."""

    def holds():
        if value := predicate():
            return value
        for p in procs:
            if p.proc.poll() is not None and p.proc.returncode != -signal.SIGKILL:
                raise AssertionError(f"{p.name} exited {p.proc.returncode}: {p.proc.stderr.read()}")
        return None

    return polling.poll(what, holds, deadline_s)


def statuses(observer: psycopg.Connection) -> dict[int, tuple[str, int]]:
    return {
        i: (s, a)
        for i, s, a in observer.execute("select id, status, attempts from outbox_delivery")
    }


@pytest.mark.slow
def test_a_killed_worker_loses_nothing_and_its_sends_may_repeat(
    knownstate_db, knownstate_db_clock, toxiproxy
):
    dsn = knownstate_db(impl.SCHEMA)
    store = OutboxStore(Config(lease=LEASE))
    workers: list[WorkerProcess] = []
    with (
        NotificationSink() as sink,
        psycopg.connect(dsn, autocommit=True) as observer,
        psycopg.connect(dsn) as conn,
    ):
        try:
            for i in range(1, N + 1):
                store.enqueue(conn, i, {"to": f"user{i}"})
            slow = toxiproxy.link("worker-victim-sink", sink.host, sink.port)
            slow.add(Toxic("latency", "downstream", {"latency": 200, "jitter": 0}))

            victim = WorkerProcess("victim", dsn, f"http://{slow.host}:{slow.port}")
            workers.append(victim)
            poll("the victim claimed a batch", victim.claims, procs=workers)
            workers += [WorkerProcess(f"survivor{k}", dsn, sink.url) for k in (1, 2)]
            survivors = workers[1:]
            poll(
                "every survivor recorded a delivery and the victim is mid-batch",
                lambda: all(s.recorded() for s in survivors) and victim.mid_batch(set(sink.log)),
                procs=workers,
            )

            victim.kill()
            assert victim.proc.returncode == -signal.SIGKILL
            # its transactions end when the server sees it gone
            for (pid,) in victim.said("backend"):
                poll(
                    f"the victim's backend {pid} is gone",
                    lambda: (
                        not observer.execute(
                            "select 1 from pg_stat_activity where pid = %s", (int(pid),)
                        ).fetchone()
                    ),
                )
            rows = statuses(observer)
            orphans = {i for i, a in victim.claims() if rows[i] == ("processing", a)}
            assert orphans, "the victim held no claimed row when it died: the kill was not mid-run"

            # The survivors deliver everything else; the orphans wait for the reaper,
            # never for the victim.
            poll(
                "only the victim's rows are unfinished",
                lambda: {i for i, (s, _) in statuses(observer).items() if s != "sent"} == orphans,
                procs=workers,
            )
            assert store.reclaim_stale(conn) == Won(())  # their leases are still live
            knownstate_db_clock.jump(LEASE + 60)
            assert store.reclaim_stale(conn) == Won(tuple(sorted(orphans)))
            poll(
                "every delivery is sent",
                lambda: all(s == "sent" for s, _ in statuses(observer).values()),
                procs=workers,
            )
            stats = [s.finish() for s in survivors]
        finally:
            for w in workers:
                w.kill()

        final = statuses(observer)
        assert len(final) == N and all(s == "sent" for s, _ in final.values())
        assert not observer.execute(
            "select 1 from outbox_delivery where status = 'processing' or lease_until is not null"
        ).fetchone()
        log = set(sink.log)
        missing = sorted((i, a) for i, (_, a) in final.items() if (i, a) not in log)
        assert not missing, (
            f"recorded as sent but the sink never received that attempt: {missing[:10]}"
        )
        received = sink.received()
        assert set(received) == set(final) and min(received.values()) >= 1

        # At-least-once: every orphan that reached the sink before the kill went out again.
        victim_attempt = dict(victim.claims())
        reached = {i for i in orphans if (i, victim_attempt[i]) in log}
        assert all(received[i] >= 2 for i in reached)
        # redelivered by a new claim
        assert all(final[i][1] == victim_attempt[i] + 1 for i in orphans)
        duplicates = sink.duplicates()
        assert duplicates == sum(n - 1 for n in received.values()) >= len(reached)

        by_victim = {i for i, a in victim.recorded() if final[i] == ("sent", a)}
        victim_sent_in_db = {i for i, a in victim.claims() if final[i] == ("sent", a)}
        assert by_victim <= victim_sent_in_db
        # each row sent by exactly one record
        assert sum(s["done"] for s in stats) == N - len(victim_sent_in_db)
        assert all(s["fenced"] == 0 and s["errors"] == 0 for s in stats), stats
        print(
            f"\n{N} deliveries, 3 workers, victim killed holding {len(orphans)} claimed row(s), "
            f"{len(reached)} of them already at the sink; reaper reclaimed {len(orphans)}; "
            f"duplicate deliveries at the sink: {duplicates}; survivors: {stats}"
        )
    for w in workers:
        assert w.proc.poll() is not None
