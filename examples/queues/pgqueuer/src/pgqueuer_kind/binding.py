"""pgqueuer 1.6.0 as it is: its description and an adapter calling its own Queries."""

import uuid
from datetime import timedelta

from pgqueuer.adapters.persistence.qb import QueryBuilderEnvironment
from pgqueuer.core.executors import DatabaseRetryEntrypointExecutor as Retrying
from pgqueuer.core.executors import EntrypointExecutorParameters as Params
from pgqueuer.domain.errors import DuplicateJobError, RetryRequested
from pgqueuer.queries import EntrypointExecutionParameter, Queries
from psycopg.rows import dict_row

from knownstate.chaos.adapter import Adapter, Claimed, LostRaceSignals, merge_log
from knownstate.chaos.generic import kind
from knownstate.model.describe import Claim, Fence, Lease, Retry, RunKind

PGQUEUER = RunKind(
    name="pgqueuer",
    owned=("picked",),
    transitions=(
        "(new) -enqueue-> queued",
        "queued -claim-> picked",
        "picked -claim-> picked",
        "picked -extend_lease-> picked",
        "picked -complete-> successful",
        "picked -retry-> queued",
        "picked -give_up-> exception",
    ),
    claim=Claim(how="queued jobs due, and picked ones gone stale, SKIP LOCKED", reclaims=True),
    lease=Lease(seconds="30s", heartbeat="15s"),
    fence=Fence(kind="unless-terminal", answers=False, how="every write matches the job id only"),
    receipts="the job row, moved to pgqueuer_log when it ends",
    retry=Retry(max_attempts=2, base="1s", cap="5m", counts="retries", decided_by="worker"),
    commits="autocommit",
)
ANY = {"run": EntrypointExecutionParameter(concurrency_limit=0)}
LIVE = """SELECT id, dedupe_key AS key, status::text, attempts, execute_after AS due,
    heartbeat + make_interval(secs => %s) AS lease_until FROM pgqueuer"""
ENDED = """SELECT job_id AS id, (array_agg(status::text ORDER BY id DESC))[1] AS status,
    count(*) FILTER (WHERE status = 'queued') - 1 AS attempts FROM pgqueuer_log GROUP BY job_id"""


async def failing(job) -> None:
    raise RuntimeError("the work failed")


class PgqueuerAdapter(Adapter):
    schema = QueryBuilderEnvironment().build_install_query(create_schema=False)
    lost_race = LostRaceSignals(errors=(DuplicateJobError,))  # a key queued or picked already

    async def pgq(self, conn) -> Queries:
        await conn.set_autocommit(True)  # pgqueuer insists on it
        return Queries.from_psycopg_connection(conn)

    async def enqueue(self, conn, key):
        return await (await self.pgq(conn)).enqueue("run", key.encode(), dedupe_key=key)

    async def claim(self, conn, batch):
        lease = timedelta(seconds=self.timing.lease)
        jobs = await (await self.pgq(conn)).dequeue(batch, ANY, uuid.uuid4(), None, lease)
        return [Claimed(j.payload.decode(), j.attempts, j) for j in jobs]

    async def extend_lease(self, conn, job):
        await (await self.pgq(conn)).update_heartbeat([job.handle.id])

    async def complete(self, conn, job):
        await (await self.pgq(conn)).log_jobs([(job.handle, "successful", None)])

    async def fail(self, conn, job, permanent):  # as pgqueuer's QueueManager does
        t, s = self.timing, timedelta(seconds=1)
        policy = Retrying(Params(0, failing), t.max_attempts, t.backoff_base * s, t.backoff_cap * s)
        try:
            await policy.execute(job.handle, None)
        except RetryRequested as retry:
            return await (await self.pgq(conn)).retry_job(job.handle, retry.delay, None)
        except RuntimeError:
            await (await self.pgq(conn)).log_jobs([(job.handle, "exception", None)])

    def read(self, conn):  # an ended job is deleted: its log keeps its id, not our key
        keys = self.__dict__.setdefault("keys", {})  # job id -> key, seen while it was live
        live = conn.cursor(row_factory=dict_row).execute(LIVE, [self.timing.lease]).fetchall()
        keys.update((r["id"], r["key"]) for r in live)
        ended = conn.cursor(row_factory=dict_row).execute(ENDED).fetchall()
        return merge_log(live, [{**r, "key": keys[r["id"]]} for r in ended if r["id"] in keys])


PgqueuerKind = kind(PGQUEUER, PgqueuerAdapter)
PgqueuerOwnersOnly = kind(PGQUEUER, PgqueuerAdapter, owners_only=True)  # the control
