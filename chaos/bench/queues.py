"""The queues the outbox bench drains, kept full between windows, and the loops that drain
them: ours (the reference worker loop) and the peer queues that are installed (pgqueuer,
procrastinate: the ``bench`` extra), each driven the way its own worker runs a job."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import psycopg

from knownstate.impl import outbox as ob
from knownstate.model.outbox import Claim

from .measure import Loops

PEERS = ("pgqueuer", "procrastinate")
OURS = "outbox"  # the reference worker loop, batched completion, no-op effect
PAYLOAD_SQL = "jsonb_build_object('event', 'bench', 'n', g)"


class Queue:
    """One queue's tables, kept full between windows (never during one): no window runs dry."""

    name = ""
    tables: tuple[str, ...] = ()
    waiting_sql = ""

    def __init__(self, dsn: str):
        self.dsn = dsn

    def install(self) -> None:
        raise NotImplementedError

    def add(self, n: int) -> None:
        raise NotImplementedError

    def _sql(self, sql: str, params=None) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def top_up(self, need: int) -> None:
        """Make sure at least ``need`` jobs wait."""
        missing = need - self._sql(self.waiting_sql)[0][0]
        if missing > 0:
            self.add(missing)

    def reset(self) -> None:
        """Empty this queue's tables: every batch size starts from the same state."""
        self._sql(f"TRUNCATE {', '.join(self.tables)} RESTART IDENTITY CASCADE")

    def analyze(self) -> None:
        """Statistics gathered with nothing in flight: the case that could mislead a planner into
        a partial index of in-flight rows for each fenced write (see fenced_write_plans)."""
        for t in self.tables:
            self._sql(f"ANALYZE {t}")


class OutboxQueue(Queue):
    name = OURS
    tables = ("outbox_delivery",)
    waiting_sql = "SELECT count(*) FROM outbox_delivery WHERE status = 'pending'"

    def install(self) -> None:
        self._sql("DROP TABLE IF EXISTS outbox_delivery")
        self._sql(ob.SCHEMA)

    def add(self, n: int) -> None:
        self._sql(
            f"INSERT INTO outbox_delivery (payload) SELECT {PAYLOAD_SQL} "
            "FROM generate_series(1, %s) g",
            (n,),
        )


class PgqueuerQueue(Queue):
    """pgqueuer's tables, installed by its ``Queries.install()`` with its default durability
    (every table logged), filled by its batch ``Queries.enqueue``."""

    name = "pgqueuer"
    entrypoint = "bench"

    def __init__(self, dsn: str):
        super().__init__(dsn)
        from pgqueuer.queries import Queries

        names = Queries.__dataclass_fields__["qbe"].default_factory().qualified
        self.tables = (names.queue_table, names.queue_table_log)
        self.waiting_sql = f"SELECT count(*) FROM {names.queue_table} WHERE status = 'queued'"

    def _run(self, fn) -> None:
        from pgqueuer.queries import Queries

        async def run() -> None:
            async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                await fn(Queries.from_psycopg_connection(conn))

        asyncio.run(run())

    def install(self) -> None:
        self._run(lambda queries_: queries_.install())

    def add(self, n: int) -> None:
        async def add(queries_) -> None:
            for k in range(0, n, 10_000):
                m = min(10_000, n - k)
                await queries_.enqueue([self.entrypoint] * m, [None] * m, [0] * m)

        self._run(add)


class ProcrastinateQueue(Queue):
    """procrastinate's schema (``apply_schema``), filled by its ``batch_defer_jobs``."""

    name = "procrastinate"
    tables = ("procrastinate_jobs", "procrastinate_events", "procrastinate_workers")
    waiting_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo'"

    def app(self):
        """An App on a pool of one connection (each bench loop gets its own)."""
        import procrastinate

        connector = procrastinate.PsycopgConnector(conninfo=self.dsn, min_size=1, max_size=1)
        return procrastinate.App(connector=connector)

    def _run(self, fn) -> None:
        async def run() -> None:
            app = self.app()
            async with app.open_async():
                await fn(app)

        asyncio.run(run())

    def install(self) -> None:
        self._run(lambda app: app.schema_manager.apply_schema_async())

    def add(self, n: int) -> None:
        from procrastinate.jobs import Job

        async def add(app) -> None:
            for k in range(0, n, 5_000):
                jobs = [
                    Job(queue="bench", lock=None, queueing_lock=None, task_name="bench")
                    for _ in range(min(5_000, n - k))
                ]
                await app.job_manager.batch_defer_jobs_async(jobs)

        self._run(add)


PEER_QUEUES: dict[str, type[Queue]] = {
    "pgqueuer": PgqueuerQueue,
    "procrastinate": ProcrastinateQueue,
}


def peer_versions(peers: Iterable[str]) -> dict[str, str | None]:
    """Each peer's installed version, or None when it is not installed (then it is not measured)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for p in peers:
        if p not in PEER_QUEUES:
            raise ValueError(f"unknown peer {p!r}: choose from {', '.join(PEERS)}")
        try:
            __import__(p)
            out[p] = metadata.version(p)
        except ImportError:
            out[p] = None
    return out


@dataclass
class Tally:
    """What one loop did besides finishing jobs: transactions, turns that found nothing."""

    tx: int = 0
    empty: int = 0


def outbox_loops(
    dsn: str, n: int, batch: int, per_row: bool, send: Callable[[Claim, dict], str], name: str
):
    """The reference worker loops (:class:`~knownstate.impl.outbox.OutboxWorker`), a thread
    each. Returns the loops, the workers (for their stats) and each loop's tally."""
    store = ob.OutboxStore()
    workers: list[ob.OutboxWorker | None] = [None] * n
    tallies = [Tally() for _ in range(n)]

    def make(i: int) -> Callable[[], int]:
        # The worker connects (and sets up its connection) itself, in the unmeasured warm-up.
        worker = workers[i] = ob.OutboxWorker(
            lambda: psycopg.connect(dsn), store, send, batch=batch, per_row=per_row
        )
        tally = tallies[i]

        def step() -> int:  # one turn of the reference loop: OutboxWorker.run() without the close
            sent = worker.stats.done
            got = worker.turn()
            tally.tx += 1 + (got if per_row else min(got, 1))
            if got == 0:
                tally.empty += 1  # the queue ran dry in a window: the figure is starved (reported)
                time.sleep(0.001)
            return worker.stats.done - sent

        return step

    def close(i: int) -> None:
        if workers[i] is not None:
            workers[i].drop()

    return Loops(n, make, close, name), workers, tallies


def _async_loops(n: int, setup: Callable, name: str) -> tuple[Loops, list[Tally]]:
    """Loops for an asyncio library, each thread with its own event loop. ``setup(i)`` (run in
    it) returns ``(turn, close)``: ``turn()`` a coroutine answering (jobs done, transactions),
    ``close()`` what lets go of the connection (a coroutine)."""
    tallies = [Tally() for _ in range(n)]
    closers: dict[int, tuple[asyncio.AbstractEventLoop, Callable | None]] = {}

    def make(i: int) -> Callable[[], int]:
        loop = asyncio.new_event_loop()
        closers[i] = (loop, None)
        turn, close = loop.run_until_complete(setup(i))
        closers[i] = (loop, close)
        tally = tallies[i]

        def step() -> int:
            done, tx = loop.run_until_complete(turn())
            tally.tx += tx
            if not done:
                tally.empty += 1
                time.sleep(0.001)
            return done

        return step

    def close(i: int) -> None:
        loop, closer = closers.pop(i, (None, None))
        if loop is not None:
            with contextlib.suppress(Exception):
                if closer is not None:
                    loop.run_until_complete(closer())
            loop.close()

    return Loops(n, make, close, name), tallies


def pgqueuer_loops(dsn: str, n: int, batch: int) -> tuple[Loops, list[Tally]]:
    """pgqueuer's batch: ``Queries.dequeue`` (one statement) then, for the whole batch,
    ``Queries.log_jobs`` (one statement), on its psycopg driver: what its QueueManager runs per
    batch, without the asyncio tasks, heartbeats and buffers around them (its best case)."""
    import uuid
    from datetime import timedelta

    from pgqueuer.ports.repository import EntrypointExecutionParameter
    from pgqueuer.queries import Queries

    entrypoints = {PgqueuerQueue.entrypoint: EntrypointExecutionParameter(concurrency_limit=0)}
    heartbeat = timedelta(seconds=30)

    async def setup(i: int):
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        queries_ = Queries.from_psycopg_connection(conn)
        manager = uuid.uuid4()

        async def turn() -> tuple[int, int]:
            jobs = await queries_.dequeue(
                batch_size=batch,
                entrypoints=entrypoints,
                queue_manager_id=manager,
                global_concurrency_limit=None,
                heartbeat_timeout=heartbeat,
            )
            if not jobs:
                return 0, 1
            await queries_.log_jobs([(job, "successful", None) for job in jobs])
            return len(jobs), 2

        return turn, conn.close

    return _async_loops(n, setup, "pgqueuer")


def procrastinate_loops(dsn: str, n: int) -> tuple[Loops, list[Tally]]:
    """procrastinate's job manager: ``fetch_job`` then ``finish_job``, as its worker runs each
    job (without the worker's event and heartbeat tasks: its best case). It fetches one job per
    query; it has no batch."""
    from procrastinate.jobs import Status

    async def setup(i: int):
        app = ProcrastinateQueue(dsn).app()
        await app.open_async()
        manager = app.job_manager
        worker_id = await manager.register_worker()

        async def turn() -> tuple[int, int]:
            job = await manager.fetch_job(queues=None, worker_id=worker_id)
            if job is None:
                return 0, 1
            await manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
            return 1, 2

        return turn, app.close_async

    return _async_loops(n, setup, "procrastinate")
