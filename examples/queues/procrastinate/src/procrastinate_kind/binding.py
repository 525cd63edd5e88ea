"""procrastinate 3.10.0 as it is: its description and an adapter calling its own JobManager."""

import contextlib

from procrastinate import PsycopgConnector, exceptions, jobs
from procrastinate.manager import JobManager
from procrastinate.schema import SchemaManager
from psycopg.rows import dict_row

from knownstate.chaos.adapter import Adapter, Claimed, LostRaceSignals
from knownstate.chaos.generic import kind
from knownstate.model.describe import Claim, Fence, Lease, RunKind

PROCRASTINATE = RunKind(
    name="procrastinate",
    owned=("doing",),
    transitions=(
        "(new) -enqueue-> todo",
        "todo -claim-> doing",
        "doing -extend_lease-> doing",
        "doing -complete-> succeeded",
        "doing -fail_permanent-> failed",
        "doing -reclaim-> todo",
    ),
    claim=Claim(how="one todo job due, FOR UPDATE SKIP LOCKED, stamped with the worker", most=1),
    lease=Lease(seconds="30s", heartbeat="10s", per="worker", taken_back_by=("reclaim",),
                requeue_clock="application"),  # retry_job(job) stamps utcnow()
    fence=Fence(kind="unless-terminal", how="finish_job matches the job id, 'todo' or 'doing'"),
    receipts="the job row (and its procrastinate_events)",
    commits="transaction",
)
READ = """SELECT j.args->>'key' AS key, j.status::text AS status,
    CASE WHEN j.status = 'doing' THEN w.last_heartbeat + make_interval(secs => %s) END
        AS lease_until
    FROM procrastinate_jobs j LEFT JOIN procrastinate_workers w ON w.id = j.worker_id"""


class GatePool:
    """What procrastinate asks of its psycopg pool: a connection per query, in a transaction
    of its own (psycopg_pool's ``async with conn``): the gate's connection."""

    def __init__(self, conn):
        self.conn = conn

    @contextlib.asynccontextmanager
    async def connection(self):
        async with self.conn.transaction():
            yield self.conn


class ProcrastinateAdapter(Adapter):
    schema = SchemaManager.get_schema()  # what SchemaManager.apply_schema runs
    lost_race = LostRaceSignals(  # finish_job RAISEs; a key waiting already: AlreadyEnqueued
        values=(), sqlstates=("P0001",), errors=(exceptions.AlreadyEnqueued,)
    )

    async def manager(self, conn) -> JobManager:
        connector = PsycopgConnector()
        await connector.open_async(pool=GatePool(conn))
        return JobManager(connector)

    async def enqueue(self, conn, key):
        job = jobs.Job(queue="default", task_name="run", lock=None, queueing_lock=key,
                       task_kwargs={"key": key})
        return (await (await self.manager(conn)).defer_job_async(job)).id

    async def claim(self, conn, batch, worker):  # a procrastinate Worker: registered, then fetching
        ids, jm = self.__dict__.setdefault("ids", {}), await self.manager(conn)
        if worker not in ids:
            ids[worker] = await jm.register_worker()
        job = await jm.fetch_job(queues=None, worker_id=ids[worker])
        return [] if job is None else [Claimed(job.task_kwargs["key"], None, job)]

    async def extend_lease(self, conn, job):  # the worker's beat, on its timer
        await (await self.manager(conn)).update_heartbeat(job.handle.worker_id)

    async def complete(self, conn, job):
        await (await self.manager(conn)).finish_job(job.handle, jobs.Status.SUCCEEDED, False)

    async def fail(self, conn, job, permanent):  # a task without retry= (the default)
        await (await self.manager(conn)).finish_job(job.handle, jobs.Status.FAILED, False)

    async def reclaim_stale(self, conn):  # procrastinate's documented retry_stalled_jobs task
        jm = await self.manager(conn)
        stalled = await jm.get_stalled_jobs(seconds_since_heartbeat=self.timing.lease)
        for job in stalled:
            await jm.retry_job(job)
        return [job.task_kwargs["key"] for job in stalled]

    def read(self, conn):
        return conn.cursor(row_factory=dict_row).execute(READ, [self.timing.lease]).fetchall()


ProcrastinateKind = kind(PROCRASTINATE, ProcrastinateAdapter)
OWNERS_ONLY = PROCRASTINATE.model_copy(update={"name": "procrastinate-owners-only"})
ProcrastinateOwnersOnly = kind(OWNERS_ONLY, ProcrastinateAdapter, owners_only=True)  # control
