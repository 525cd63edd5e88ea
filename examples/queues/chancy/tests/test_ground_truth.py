"""What the gate finds in chancy 0.26.0, reproduced by hand: workers on connections of their own
(each its own ``Chancy`` app and pool), the library's own calls (``Worker.announce_worker``,
``Worker.fetch_jobs``, the executor's ``on_job_completed`` and the worker's ``flush``, the
``Recovery`` plugin's pass), real PostgreSQL whose clock the test moves and which it crashes
(knownstate's pytest plugin: ``knownstate_db``, ``knownstate_db_clock``,
``knownstate_cluster``). No knownstate model, no binding.

A chancy worker announces itself in ``chancy_workers`` (``last_seen``) every
``heartbeat_poll_interval`` (30 s); ``Recovery`` re-queues a running job whose worker was not
seen for ``heartbeat_timeout`` (90 s), or has no row at all, clearing its ``claim_id``; every
update a worker flushes matches the job id and the ``claim_id`` it fetched the job under. The
workers table is ``UNLOGGED``: a database crash empties it.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from chancy import Chancy, Job, Queue, Worker
from chancy.executors.asyncex import AsyncExecutor
from chancy.plugins.recovery import Recovery
from psycopg.rows import dict_row

TIMEOUT = 90  # heartbeat_timeout
DEFAULT = Queue("default")
APPS: list[Chancy] = []


async def worker(dsn: str, worker_id: str) -> Worker:
    """A process of its own: its own Chancy app, its own pool, one connection."""
    app = Chancy(dsn, no_default_plugins=True, min_connection_pool_size=1)
    await app.pool.open()
    APPS.append(app)
    return Worker(app, worker_id=worker_id, heartbeat_timeout=TIMEOUT)


async def close_all() -> None:
    while APPS:
        await APPS.pop().pool.close()


@pytest.fixture(autouse=True)
def forget_apps():
    yield
    APPS.clear()  # a failed test's pools died with its event loop


async def announce(w: Worker) -> None:
    async with w.chancy.pool.connection() as conn:
        await w.announce_worker(conn)


async def fetch(w: Worker) -> list:
    async with w.chancy.pool.connection() as conn:
        return await w.fetch_jobs(DEFAULT, conn, up_to=1)


async def finish(w: Worker, job) -> None:
    await AsyncExecutor(w, DEFAULT).on_job_completed(job=job, exc=None)
    await w.flush()


async def recover(leader: Worker) -> int:
    async with leader.chancy.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cursor:
        return await Recovery.recover(leader, leader.chancy, cursor)


def rows(dsn: str, sql: str) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


@pytest.fixture
def dsn(knownstate_db, knownstate_db_clock):
    knownstate_db_clock.reset()  # the application's clock and the database's agree
    name = knownstate_db()

    async def migrate():
        async with Chancy(name, no_default_plugins=True) as app:
            await app.migrate()

    asyncio.run(migrate())
    return name


async def running_on_a(dsn: str):
    """Worker A announces itself, the job is pushed, A fetches it."""
    a = await worker(dsn, "a")
    await announce(a)
    await a.chancy.push(Job(func="run", kwargs={"key": "1"}))
    [held_by_a] = await fetch(a)
    return a, held_by_a


def test_a_crash_makes_every_running_job_look_abandoned(dsn, knownstate_cluster):
    """lease (the gate's counterexample): A beat a moment ago, its lease has most of 90 s to
    go; the database crashes and restarts; the UNLOGGED workers table comes back empty, so
    Recovery re-queues A's job at once and B runs it while A still does. A's own finish is
    then refused by the claim_id fence: the job runs twice, and A's run is lost."""

    async def before():
        a, held_by_a = await running_on_a(dsn)
        assert rows(dsn, "SELECT worker_id FROM chancy_workers") == [("a",)]
        await close_all()
        return held_by_a

    held_by_a = asyncio.run(before())
    knownstate_cluster.crash()
    knownstate_cluster.restart()
    assert rows(dsn, "SELECT worker_id FROM chancy_workers") == []  # UNLOGGED: emptied

    async def after():
        a, leader, b = [await worker(dsn, n) for n in ("a", "leader", "b")]
        assert await recover(leader) == 1  # A's job, though A's lease is live
        await announce(b)
        [held_by_b] = await fetch(b)
        assert held_by_b.id == held_by_a.id  # B runs the job A is running
        await finish(a, held_by_a)  # A's finish: refused, its claim_id is gone
        assert rows(dsn, "SELECT state, taken_by FROM chancy_jobs") == [("running", "b")]
        await close_all()

    asyncio.run(after())


def test_a_stale_workers_finish_is_discarded(dsn, knownstate_db_clock):
    """lease-fence holds: A pauses past the timeout, Recovery re-queues its job, B fetches it;
    A's finish matches a claim_id the job no longer has and lands nowhere. B's lands."""

    async def scenario():
        a, held_by_a = await running_on_a(dsn)
        knownstate_db_clock.jump(TIMEOUT + 1)  # A's pause: no beat for longer than the timeout
        leader, b = await worker(dsn, "leader"), await worker(dsn, "b")
        assert await recover(leader) == 1
        await announce(b)
        [held_by_b] = await fetch(b)
        await finish(a, held_by_a)  # A, stale
        assert rows(dsn, "SELECT state, taken_by FROM chancy_jobs") == [("running", "b")]
        await finish(b, held_by_b)
        assert rows(dsn, "SELECT state FROM chancy_jobs") == [("succeeded",)]
        await close_all()

    asyncio.run(scenario())


def test_a_worker_that_beats_keeps_its_job(dsn, knownstate_db_clock):
    """The control: a worker announcing itself within the timeout keeps its job; Recovery
    takes nothing, and its finish is the only one."""

    async def scenario():
        a, held = await running_on_a(dsn)
        leader = await worker(dsn, "leader")
        for _ in range(3):
            knownstate_db_clock.jump(TIMEOUT // 2)
            await announce(a)
        assert await recover(leader) == 0
        await finish(a, held)
        await close_all()

    asyncio.run(scenario())
    assert rows(dsn, "SELECT state FROM chancy_jobs") == [("succeeded",)]
