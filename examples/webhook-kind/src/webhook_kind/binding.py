"""The webhook queue under knownstate's gate: a description and an adapter, nothing else."""

from knownstate.chaos.adapter import OK, PERMANENT, RETRY, Adapter, Claimed
from knownstate.chaos.generic import kind
from knownstate.model.describe import Claim, Fence, Lease, Retry, RunKind

from . import deliveries as lib

WEBHOOK = RunKind(
    name="webhook",
    owned=("delivering",),
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> delivering",
        "delivering -extend_lease-> delivering",
        "delivering -complete-> delivered",
        "delivering -fail_permanent-> rejected",
        "delivering -retry-> pending",
        "delivering -give_up-> dead",
        "delivering -reclaim-> pending",
        "delivering -reclaim_dead-> dead",
    ),
    claim=Claim(how="FOR UPDATE SKIP LOCKED over due deliveries, bumping attempts"),
    lease=Lease(seconds="5m", heartbeat="1m", taken_back_by=("reclaim", "reclaim_dead")),
    fence=Fence(kind="attempt", how="every write by a worker matches its claimed attempt"),
    receipts="the delivery row itself",
    retry=Retry(max_attempts=2, base="1m", cap="1h"),
    external="at-least-once",
    external_key=True,
    idempotency_key="event_key, unique: publishing an event twice is one delivery",
)


class WebhookAdapter(Adapter):
    schema = lib.SCHEMA
    queries = lib.QUERIES
    guards = {
        "fence": "AND attempts = %(attempt)s",
        "status": "AND status = 'delivering'",
        "lease": "AND lease_until <= now()",
        "skip_locked": "SKIP LOCKED",
        "lock": "FOR UPDATE SKIP LOCKED",
    }
    read_query = (
        "SELECT event_key AS key, status, attempts, next_attempt_at AS due, "
        "lease_until FROM webhook_delivery"
    )

    def queue(self, conn) -> lib.Deliveries:  # the description's durations, as the gate runs them
        t = self.timing
        config = lib.Config(t.lease, t.heartbeat, t.max_attempts, t.backoff_base, t.backoff_cap)
        return lib.Deliveries(conn, config, self.queries)

    async def enqueue(self, conn, key):
        return await self.queue(conn).publish(key, "https://hooks.invalid/", {"event": key})

    async def claim(self, conn, batch):
        return [Claimed(d.event_key, d.attempt, d) for d in await self.queue(conn).claim(batch)]

    async def extend_lease(self, conn, job):
        return await self.queue(conn).heartbeat(job.handle)

    async def complete(self, conn, job):
        return await self.queue(conn).delivered(job.handle)

    async def fail(self, conn, job, permanent):
        return await self.queue(conn).failed(job.handle, permanent, "webhook failed")

    async def reclaim_stale(self, conn):
        return await self.queue(conn).reap()

    async def send(self, job, url):
        answer = await lib.deliver(job.handle, url)
        return {lib.DELIVERED: OK, lib.RETRY: RETRY, lib.REJECTED: PERMANENT}[answer]


WebhookKind = kind(WEBHOOK, WebhookAdapter)
