"""A lease in the application's clock, checked from its description, on the real parts.

A queue that stamps its leases with the application's now and takes them back by it
(``Lease(clock="application")``) is described like any other: the gate hands the adapter its
application clock (``Adapter.now()``), skews it apart from the database's (``app-clock-skew``)
and moves it through every stall, and the model stamps and judges the lease by it. The
reference below passes, reaching the lease's lapse and its take-back; a reaper that judges the
application's lease by the database's ``now()`` (the two clocks mixed) and a heartbeat that
stamps the database's ``now()`` are each caught naming ``lease``.
"""

from __future__ import annotations

import pytest

from knownstate.chaos.adapter import Adapter, Claimed
from knownstate.chaos.check import run_check
from knownstate.chaos.generic import kind
from knownstate.chaos.genericrules import SkewsAppClock
from knownstate.model.describe import Claim, Fence, Lease, RunKind
from tests.profiles import ONCE

pytestmark = pytest.mark.slow

APP_LEASE = RunKind(
    name="app-lease",
    owned=("running",),
    transitions=(
        "(new) -enqueue-> queued",
        "queued -claim-> running",
        "running -extend_lease-> running",
        "running -complete-> done",
        "running -reclaim-> queued",
    ),
    claim=Claim(how="queued jobs, FOR UPDATE SKIP LOCKED", unscheduled="always"),
    lease=Lease(
        seconds="1m",
        heartbeat="30s",
        clock="application",
        taken_back_by=("reclaim",),
        requeue_clock="unchanged",  # no schedule: due again at once, whatever the clock
    ),
    fence=Fence(kind="attempt"),
    receipts="the job row",
)
SCHEMA = """CREATE TABLE jobs (
    id bigserial PRIMARY KEY,
    key text NOT NULL UNIQUE,
    status text NOT NULL DEFAULT 'queued',
    attempts int NOT NULL DEFAULT 0,
    lease_until timestamptz
);"""


class AppLease(Adapter):
    schema = SCHEMA
    read_query = "SELECT key, status, attempts, lease_until FROM jobs"
    stamp = "%(now)s"  # the lease's clock: the application's now, passed in
    lapse = "%(now)s"

    def _args(self, **kw) -> dict:
        return {"now": self.now(), "lease": self.timing.lease, **kw}

    def enqueue(self, conn, key):
        with conn.transaction():
            sql = "INSERT INTO jobs (key) VALUES (%s) ON CONFLICT DO NOTHING RETURNING key"
            row = conn.execute(sql, [key]).fetchone()
        return row[0] if row else None

    def claim(self, conn, batch):
        with conn.transaction():
            rows = conn.execute(
                f"""UPDATE jobs SET status = 'running', attempts = attempts + 1,
                    lease_until = {self.stamp} + make_interval(secs => %(lease)s)
                WHERE id IN (SELECT id FROM jobs WHERE status = 'queued' ORDER BY id
                             LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
                RETURNING key, attempts""",
                self._args(batch=batch),
            ).fetchall()
        return [Claimed(key, attempts) for key, attempts in rows]

    def extend_lease(self, conn, job):
        with conn.transaction():
            return conn.execute(
                f"""UPDATE jobs SET lease_until = {self.stamp} + make_interval(secs => %(lease)s)
                WHERE key = %(key)s AND status = 'running' AND attempts = %(attempt)s""",
                self._args(key=job.key, attempt=job.attempt),
            ).rowcount

    def complete(self, conn, job):
        with conn.transaction():
            return conn.execute(
                """UPDATE jobs SET status = 'done', lease_until = NULL
                WHERE key = %s AND status = 'running' AND attempts = %s""",
                [job.key, job.attempt],
            ).rowcount

    def reclaim_stale(self, conn):
        with conn.transaction():
            rows = conn.execute(
                f"""UPDATE jobs SET status = 'queued', lease_until = NULL
                WHERE status = 'running' AND lease_until <= {self.lapse} RETURNING key""",
                self._args(),
            ).fetchall()
        return [key for (key,) in rows]


class ReapsByTheDatabase(AppLease):
    lapse = "now()"  # the application's lease, judged by the database's clock


class BeatsByTheDatabase(AppLease):
    stamp = "now()"  # the application's lease, stamped by the database's clock


# each runs from the command line too: knownstate verify --kind tests.test_app_clock_lease:NAME
AppLeaseKind = kind(APP_LEASE, AppLease)
ReapsByTheDatabaseKind = kind(APP_LEASE, ReapsByTheDatabase)
BeatsByTheDatabaseKind = kind(APP_LEASE, BeatsByTheDatabase)


def test_a_lease_in_the_applications_clock_is_checked_skewed_and_passes(knownstate_env):
    assert issubclass(AppLeaseKind, SkewsAppClock)  # its clock is skewed from the database's
    r = run_check(AppLeaseKind, knownstate_env, seed=1, profile=ONCE)
    assert r.passed, r.failure or r.vacuous
    assert r.coverage["transition running -reclaim-> queued"] >= 1
    assert r.stats.faults["app-clock-skew"] >= 1 and r.stats.faults["worker-stall"] >= 1


@pytest.mark.parametrize("check", [ReapsByTheDatabaseKind, BeatsByTheDatabaseKind])
def test_an_application_lease_mixed_with_the_databases_clock_is_caught(knownstate_env, check):
    """Caught at seeds 1, 2, 3 each, naming lease: the reaper in 5-6 steps (it misses a lapse
    the application's clock reached), the heartbeat in 3-4 (a claim grants less lease than the
    description says, by the clock that judges it)."""
    r = run_check(check, knownstate_env, seed=1, require_all=False, shrinks=100)
    assert r.failure is not None and "lease" in r.invariants, r.failure
