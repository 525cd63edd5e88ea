"""procrastinate 3.10.0 as it is: its description and an adapter calling its own JobManager."""

from procrastinate import PsycopgConnector, jobs, manager, schema
from procrastinate.exceptions import AlreadyEnqueued
from psycopg.rows import dict_row

from knownstate.chaos.adapter import Adapter, Claimed, LentPool, LostRaceSignals
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
    claim=Claim(how="one todo job, FOR UPDATE SKIP LOCKED", most=1, unscheduled="always"),
    lease=Lease(
        seconds="30s",
        heartbeat="10s",
        per="worker",
        taken_back_by=("reclaim",),
        requeue_clock="application",  # a re-queue: retry_job(job) stamps utcnow()
        reaps="one-by-one",  # get_stalled_jobs, then retry_job per job
    ),
    fence=Fence(kind="unless-terminal", how="finish_job matches the job id, 'todo' or 'doing'"),
    receipts="the job row (and its procrastinate_events)",
)
RUN = {"queue": "default", "task_name": "run", "lock": None}
READ = """SELECT j.args->>'key' AS key, j.status::text AS status,
    CASE WHEN j.status = 'doing' THEN w.last_heartbeat + make_interval(secs => %s) END lease_until
    FROM procrastinate_jobs j LEFT JOIN procrastinate_workers w ON w.id = j.worker_id"""


class ProcrastinateAdapter(Adapter):
    schema = schema.SchemaManager.get_schema()  # what SchemaManager.apply_schema runs
    # finish_job and retry_job RAISE when the job is not in a status they take
    lost_race = LostRaceSignals(values=(), sqlstates=("P0001",), errors=(AlreadyEnqueued,))

    async def jm(self, conn):  # a JobManager whose pool is the gate's connection
        connector = PsycopgConnector()
        await connector.open_async(pool=LentPool(conn))
        return manager.JobManager(connector)

    async def enqueue(self, conn, key):
        job = jobs.Job(**RUN, queueing_lock=key, task_kwargs={"key": key})  # one waiting per key
        return (await (await self.jm(conn)).defer_job_async(job)).id

    async def start(self, conn, worker):  # a procrastinate Worker registers as it starts
        return await (await self.jm(conn)).register_worker()

    async def claim(self, conn, batch, worker):
        job = await (await self.jm(conn)).fetch_job(queues=None, worker_id=self.started[worker])
        return [] if job is None else [Claimed(job.task_kwargs["key"], None, job)]

    async def extend_lease(self, conn, job):  # the worker's beat, on its timer
        await (await self.jm(conn)).update_heartbeat(job.handle.worker_id)

    async def complete(self, conn, job):
        await (await self.jm(conn)).finish_job(job.handle, jobs.Status.SUCCEEDED, False)

    async def fail(self, conn, job, permanent):  # a task without retry= (the default)
        await (await self.jm(conn)).finish_job(job.handle, jobs.Status.FAILED, False)

    async def reclaim_stale(self, conn):  # procrastinate's documented retry_stalled_jobs task
        jm = await self.jm(conn)
        stalled = await jm.get_stalled_jobs(seconds_since_heartbeat=self.timing.lease)
        return [await jm.retry_job(job) or job.task_kwargs["key"] for job in stalled]

    def read(self, conn):
        return conn.cursor(row_factory=dict_row).execute(READ, [self.timing.lease]).fetchall()


ProcrastinateKind = kind(PROCRASTINATE, ProcrastinateAdapter)
# stale holders never write, a holder whose worker's beat lapsed among them
ProcrastinateOwnersOnly = kind(PROCRASTINATE, ProcrastinateAdapter, owners_only="under-lease")
