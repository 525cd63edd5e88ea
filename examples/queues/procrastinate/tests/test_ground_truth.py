"""What the gate finds in procrastinate 3.10.0, reproduced by hand: workers on connections of
their own, the library's own calls (``JobManager`` on its own ``PsycopgConnector`` pool), real
PostgreSQL whose clock the test moves (knownstate's pytest plugin: ``knownstate_db``,
``knownstate_db_clock``). No knownstate model, no binding.

A procrastinate worker registers (``register_worker``) and beats every 10 s
(``update_heartbeat``); a job it fetched is *stalled* once its worker's beat is older than
30 s, and procrastinate's documented ``retry_stalled_jobs`` task puts every stalled job back
(``get_stalled_jobs()``, then ``retry_job(job)`` for each). ``finish_job`` matches the job id
and lands while the job is ``todo`` or ``doing``; ``retry_job`` lands while it is ``doing`` or
``failed``. Each test is one finding.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from procrastinate import PsycopgConnector, jobs, manager, schema
from procrastinate.exceptions import ConnectorException

TIMEOUT = 30  # stalled_worker_timeout / get_stalled_jobs' seconds_since_heartbeat
OPEN: list[PsycopgConnector] = []


async def job_manager(dsn: str) -> manager.JobManager:
    """A process of its own: procrastinate's connector, its own pool, one connection."""
    connector = PsycopgConnector(conninfo=dsn, min_size=1, max_size=1)
    await connector.open_async()
    OPEN.append(connector)
    return manager.JobManager(connector)


async def close_all() -> None:
    while OPEN:
        await OPEN.pop().close_async()


@pytest.fixture(autouse=True)
def forget_connectors():
    yield
    OPEN.clear()  # a failed test's connectors died with its event loop


def status(dsn: str) -> list[tuple]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT status::text, worker_id FROM procrastinate_jobs").fetchall()


async def stalled_and_requeued(dsn: str, clock, wait_for_failure=None):
    """Worker A fetches the job and pauses past the timeout; the reaper re-queues it."""
    a, reaper = await job_manager(dsn), await job_manager(dsn)
    await a.defer_job_async(
        jobs.Job(queue="default", task_name="run", lock=None, queueing_lock=None)
    )
    a_id = await a.register_worker()
    held_by_a = await a.fetch_job(queues=None, worker_id=a_id)
    clock.jump(TIMEOUT + 1)  # A's pause: no beat for longer than the timeout
    [stalled] = await reaper.get_stalled_jobs(seconds_since_heartbeat=TIMEOUT)
    assert stalled.id == held_by_a.id
    if wait_for_failure is not None:
        await wait_for_failure(a, held_by_a)  # A, resuming, ends the job before the retry
    await reaper.retry_job(stalled)
    return a, held_by_a


@pytest.fixture
def dsn(knownstate_db, knownstate_db_clock):
    knownstate_db_clock.reset()  # the application's clock and the database's agree
    return knownstate_db(schema.SchemaManager.get_schema())


def test_a_stale_worker_finishes_the_job_the_reaper_re_queued(dsn, knownstate_db_clock):
    """lease-fence (the gate's counterexample): A's finish lands on the job the reaper put
    back in the queue: it is ``succeeded`` though A no longer held it."""

    async def scenario():
        a, held_by_a = await stalled_and_requeued(dsn, knownstate_db_clock)
        assert status(dsn) == [("todo", held_by_a.worker_id)]
        await a.finish_job(held_by_a, jobs.Status.SUCCEEDED, delete_job=False)
        await close_all()

    asyncio.run(scenario())
    assert [s for s, _ in status(dsn)] == ["succeeded"]


def test_a_stale_worker_finishes_the_job_another_worker_runs(dsn, knownstate_db_clock):
    """lease-fence: B fetched the re-queued job and runs it; A's finish lands on it, and B's own
    finish is then refused: the record is A's, for a run A had lost."""

    async def scenario():
        a, held_by_a = await stalled_and_requeued(dsn, knownstate_db_clock)
        b = await job_manager(dsn)
        b_id = await b.register_worker()
        held_by_b = await b.fetch_job(queues=None, worker_id=b_id)
        assert held_by_b.id == held_by_a.id and status(dsn) == [("doing", b_id)]
        await a.finish_job(held_by_a, jobs.Status.SUCCEEDED, delete_job=False)  # A, stale
        assert status(dsn) == [("succeeded", b_id)]  # B still runs it
        with pytest.raises(ConnectorException) as refused:  # B's own outcome: refused
            await b.finish_job(held_by_b, jobs.Status.FAILED, delete_job=False)
        assert 'not in "doing" or "todo"' in str(refused.value.__cause__)
        await close_all()

    asyncio.run(scenario())


def test_the_reaper_re_queues_a_job_that_failed_meanwhile(dsn, knownstate_db_clock):
    """terminal-answers-from-receipts: the reaper read the job as stalled; A, its owner (nobody
    took it since), resumes and fails it; the reaper's retry_job then takes ``failed`` back to
    ``todo``: an ended job runs again."""

    async def fail(a, held_by_a):
        await a.finish_job(held_by_a, jobs.Status.FAILED, delete_job=False)
        assert [s for s, _ in status(dsn)] == ["failed"]

    async def scenario():
        await stalled_and_requeued(dsn, knownstate_db_clock, wait_for_failure=fail)
        await close_all()

    asyncio.run(scenario())
    assert [s for s, _ in status(dsn)] == ["todo"]  # the failed job is back in the queue


def test_a_worker_that_beats_is_never_stalled(dsn, knownstate_db_clock):
    """The control: a worker beating within the timeout keeps its job; it finishes alone."""

    async def scenario():
        a, reaper = await job_manager(dsn), await job_manager(dsn)
        await a.defer_job_async(
            jobs.Job(queue="default", task_name="run", lock=None, queueing_lock=None)
        )
        a_id = await a.register_worker()
        held = await a.fetch_job(queues=None, worker_id=a_id)
        for _ in range(3):
            knownstate_db_clock.jump(TIMEOUT // 2)
            await a.update_heartbeat(a_id)
        assert list(await reaper.get_stalled_jobs(seconds_since_heartbeat=TIMEOUT)) == []
        await a.finish_job(held, jobs.Status.SUCCEEDED, delete_job=False)
        await close_all()

    asyncio.run(scenario())
    assert [s for s, _ in status(dsn)] == ["succeeded"]
