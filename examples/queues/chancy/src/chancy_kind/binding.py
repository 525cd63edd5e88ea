"""chancy 0.26.0 as it is: its description and an adapter calling its own Worker and Recovery."""

from chancy import Chancy, Job, Queue, Worker
from chancy.executors.asyncex import AsyncExecutor
from chancy.migrate import Migrator
from chancy.plugins.recovery import Recovery
from psycopg.rows import dict_row

from knownstate.chaos.adapter import Adapter, Claimed, LentPool, recorded_migration
from knownstate.chaos.generic import kind
from knownstate.model.describe import Claim, Fence, Lease, Retry, RunKind

CHANCY = RunKind(
    name="chancy",
    owned=("running",),
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> running",
        "retrying -claim-> running",
        "running -extend_lease-> running",
        "running -complete-> succeeded",
        "running -retry-> retrying",
        "running -give_up-> failed",
        "running -reclaim-> pending",
    ),
    claim=Claim(how="due pending or retrying jobs, SKIP LOCKED", unscheduled="application"),
    lease=Lease(
        seconds="90s",
        heartbeat="30s",
        per="worker",  # chancy_workers.last_seen, by announce_worker; Recovery reads it
        taken_back_by=("reclaim",),
        lapsed_workers="forgotten",  # announce_worker deletes every expired worker's row
        requeue_clock="unchanged",  # Recovery leaves scheduled_at as it was
    ),
    fence=Fence(kind="claim", answers=False, how="each update matches the job id and its claim_id"),
    # without its Retry plugin a failed job is due again at once; Recovery allows one attempt more
    retry=Retry(max_attempts=2, counts="executions", decided_by="worker", taken_back="one-more"),
    receipts="the job row",
    keys="producers",  # a job's kwargs hold the key; chancy keeps none (no unique_key given)
)


class ChancyAdapter(Adapter):
    read_query = """SELECT j.kwargs->>'key' AS key, j.state AS status, j.taken_by AS holder,
        j.attempts, j.max_attempts, j.scheduled_at AS due,
        CASE WHEN j.state = 'running' THEN COALESCE(w.expires_at, now()) END AS lease_until
        FROM chancy_jobs j LEFT JOIN chancy_workers w ON w.worker_id = j.taken_by"""
    holders = True
    schema = recorded_migration(Migrator("chancy", "chancy.migrations", prefix="chancy_").migrate)

    def worker(self, conn, worker_id: str) -> Worker:  # a chancy Worker whose pool is the gate's
        app = Chancy("", no_default_plugins=True)
        app.pool = LentPool(conn)
        return Worker(app, worker_id=worker_id, heartbeat_timeout=self.timing.lease)

    async def enqueue(self, conn, key):  # stamped by the application's clock, the gate's
        job = Job(func="run", kwargs={"key": key}, scheduled_at=self.now())
        job = job.with_max_attempts(self.timing.max_attempts)
        return (await self.worker(conn, "producer").chancy.push(job)).identifier

    async def start(self, conn, worker):  # a Worker announces itself as it starts
        await self.worker(conn, worker).announce_worker(conn)

    async def claim(self, conn, batch, worker):
        jobs = await self.worker(conn, worker).fetch_jobs(Queue("default"), conn, up_to=batch)
        return [Claimed(j.kwargs["key"], j.attempts, (worker, j)) for j in jobs]

    async def extend_lease(self, conn, job):  # the worker's beat, on its timer
        await self.worker(conn, job.handle[0]).announce_worker(conn)

    async def complete(self, conn, job, exc=None):  # the executor's outcome, the worker's flush
        me = self.worker(conn, job.handle[0])
        await AsyncExecutor(me, Queue("default")).on_job_completed(job=job.handle[1], exc=exc)
        await me.flush()

    async def fail(self, conn, job, permanent):  # the work raised: retried, or failed at the limit
        await self.complete(conn, job, RuntimeError("the work failed"))

    async def reclaim_stale(self, conn):  # the Recovery plugin's pass, on the leader
        async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            return await Recovery.recover(me := self.worker(conn, "leader"), me.chancy, cur)


class KeptWorkers(ChancyAdapter):  # the control's: the workers table kept through a crash
    schema = ChancyAdapter.schema + "ALTER TABLE chancy_workers SET LOGGED;\n"


ChancyKind = kind(CHANCY, ChancyAdapter)
ChancyOwnersOnly = kind(CHANCY, KeptWorkers, owners_only=True)  # the control
