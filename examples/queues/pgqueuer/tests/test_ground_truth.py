"""What the gate finds in pgqueuer 1.6.0, reproduced by hand: two workers, two connections, the
library's own calls (``Queries``), real PostgreSQL whose clock the test moves (knownstate's
pytest plugin: ``knownstate_db``, ``knownstate_db_clock``). No knownstate model, no binding.

Each test is one finding of ``knownstate verify pgqueuer``: a worker whose heartbeat went
stale (a pause longer than ``heartbeat_timeout``) still writes for the job another worker
re-picked, because every write pgqueuer makes matches the job id only.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import psycopg
from pgqueuer.adapters.persistence.qb import QueryBuilderEnvironment
from pgqueuer.queries import EntrypointExecutionParameter, Queries

TIMEOUT = timedelta(seconds=30)  # heartbeat_timeout: a picked job older than this is re-picked
RUN = {"run": EntrypointExecutionParameter(concurrency_limit=0)}


OPEN: list[psycopg.AsyncConnection] = []


async def worker(dsn: str) -> Queries:
    """A worker of its own: its own connection (pgqueuer insists on autocommit)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    OPEN.append(conn)
    return Queries.from_psycopg_connection(conn)


async def close_all() -> None:
    while OPEN:
        await OPEN.pop().close()


async def dequeue(q: Queries):
    return await q.dequeue(1, RUN, uuid.uuid4(), None, TIMEOUT)


async def stale_and_repicked(dsn: str, clock):
    """Worker A picks the job and pauses past the heartbeat timeout; worker B re-picks it."""
    a, b = await worker(dsn), await worker(dsn)
    [job_id] = await a.enqueue("run", b"work")
    [held_by_a] = await dequeue(a)
    clock.jump(TIMEOUT.total_seconds() + 1)  # A's pause: no heartbeat for longer than the timeout
    [held_by_b] = await dequeue(b)
    assert held_by_a.id == held_by_b.id == job_id  # B now runs the same job
    return a, b, held_by_a, held_by_b


def rows(dsn: str, sql: str) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def schema() -> str:
    return QueryBuilderEnvironment().build_install_query(create_schema=False)


def test_a_stale_worker_finishes_the_job_another_worker_runs(knownstate_db, knownstate_db_clock):
    """lease-fence: A's completion lands while B holds the job. The job is gone from the queue
    and logged successful by A; B's heartbeat and its own completion then meet nothing."""
    dsn = knownstate_db(schema())

    async def scenario():
        a, b, held_by_a, held_by_b = await stale_and_repicked(dsn, knownstate_db_clock)
        await a.log_jobs([(held_by_a, "successful", None)])  # A, stale, finishes
        assert rows(dsn, "SELECT id FROM pgqueuer") == []  # B's running job is gone
        await b.update_heartbeat([held_by_b.id])  # B goes on, unaware: its writes find nothing
        await b.log_jobs([(held_by_b, "exception", None)])
        await close_all()

    asyncio.run(scenario())
    log = rows(dsn, "SELECT status::text FROM pgqueuer_log ORDER BY id")
    assert log == [("queued",), ("picked",), ("picked",), ("successful",)]  # B's outcome lost


def test_a_stale_worker_retries_the_job_another_worker_runs(knownstate_db, knownstate_db_clock):
    """lease-fence: A's retry lands while B holds the job, putting it back in the queue, so a
    third worker picks it while B still runs it: two live runs of one job."""
    dsn = knownstate_db(schema())

    async def scenario():
        a, b, held_by_a, held_by_b = await stale_and_repicked(dsn, knownstate_db_clock)
        await a.retry_job(held_by_a, timedelta(0), None)  # A, stale, asks for a retry
        assert rows(dsn, "SELECT status::text, attempts FROM pgqueuer") == [("queued", 1)]
        knownstate_db_clock.jump(1)
        c = await worker(dsn)
        [held_by_c] = await dequeue(c)  # a third worker takes the job B is running
        assert held_by_c.id == held_by_b.id
        await close_all()

    asyncio.run(scenario())


def test_a_stale_workers_heartbeat_lands_on_the_job_another_worker_runs(
    knownstate_db, knownstate_db_clock
):
    """lease-fence (a lesser one): A's heartbeat, on its timer and overdue after the pause,
    stamps the lease of the job B now holds, as if A still owned it."""
    dsn = knownstate_db(schema())

    async def scenario():
        a, b, held_by_a, held_by_b = await stale_and_repicked(dsn, knownstate_db_clock)
        [(picked_by_b,)] = rows(dsn, "SELECT heartbeat FROM pgqueuer")
        knownstate_db_clock.jump(5)
        await a.update_heartbeat([held_by_a.id])  # A, stale, beats for the job
        [(beaten,)] = rows(dsn, "SELECT heartbeat FROM pgqueuer")
        assert (beaten - picked_by_b).total_seconds() >= 5  # A's beat landed on B's job
        await close_all()

    asyncio.run(scenario())


def test_an_owner_that_never_paused_finishes_alone(knownstate_db, knownstate_db_clock):
    """The control: without a stale worker, the owner's completion is the only one."""
    dsn = knownstate_db(schema())

    async def scenario():
        a, b = await worker(dsn), await worker(dsn)
        await a.enqueue("run", b"work")
        [held] = await dequeue(a)
        assert await dequeue(b) == []  # a live heartbeat: nobody re-picks it
        await a.log_jobs([(held, "successful", None)])
        await close_all()

    asyncio.run(scenario())
    assert rows(dsn, "SELECT status::text FROM pgqueuer_log ORDER BY id")[-1] == ("successful",)
