"""Webhook deliveries: a queue on PostgreSQL, asyncio all the way (psycopg 3, httpx).

A producer publishes an event under its ``event_key`` (the idempotency key: publishing the same
event twice is one delivery). Workers claim due deliveries (``FOR UPDATE SKIP LOCKED``, bumping
``attempts``: the claimed attempt is the worker's token), POST each to its endpoint with the
event key as ``Idempotency-Key``, and record the outcome: ``delivered``, ``rejected`` (a 4xx:
for good), or a retry with exponential backoff (``dead`` after ``max_attempts``). A worker
extends its lease with a heartbeat; a reaper takes back deliveries whose lease lapsed. Every
write a worker makes matches its claimed attempt, so a worker that stalled past its lease
cannot overwrite the delivery another worker re-claimed. The POST is at least once; the
receiver de-duplicates on the Idempotency-Key.

This module is the system under check: it knows nothing of knownstate.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import httpx
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb

SCHEMA = """
CREATE TABLE webhook_delivery (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_key       text        NOT NULL UNIQUE,
    endpoint        text        NOT NULL,
    payload         jsonb       NOT NULL DEFAULT '{}',
    status          text        NOT NULL DEFAULT 'pending' CHECK (status IN
                        ('pending', 'delivering', 'delivered', 'rejected', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_until     timestamptz,
    last_error      text
);
"""

QUERIES = {
    "publish": """
        INSERT INTO webhook_delivery (event_key, endpoint, payload)
        VALUES (%(key)s, %(endpoint)s, %(payload)s)
        ON CONFLICT (event_key) DO NOTHING RETURNING id""",
    "claim": """
        WITH due AS (
            SELECT id FROM webhook_delivery
            WHERE status = 'pending' AND next_attempt_at <= now()
            ORDER BY id LIMIT %(batch)s
            FOR UPDATE SKIP LOCKED)
        UPDATE webhook_delivery d
        SET status = 'delivering', attempts = d.attempts + 1,
            lease_until = now() + make_interval(secs => %(lease)s)
        FROM due WHERE d.id = due.id
        RETURNING d.id, d.event_key, d.attempts, d.endpoint, d.payload""",
    "heartbeat": """
        UPDATE webhook_delivery SET lease_until = now() + make_interval(secs => %(lease)s)
        WHERE id = %(id)s AND status = 'delivering' AND attempts = %(attempt)s""",
    "delivered": """
        UPDATE webhook_delivery SET status = 'delivered', lease_until = NULL
        WHERE id = %(id)s AND status = 'delivering' AND attempts = %(attempt)s""",
    "failed": """
        UPDATE webhook_delivery SET
            status = CASE WHEN %(permanent)s THEN 'rejected'
                          WHEN attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
            next_attempt_at = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s
                THEN next_attempt_at
                ELSE now() + make_interval(
                    secs => least(%(cap)s, %(base)s * 2 ^ (attempts - 1))) END,
            lease_until = NULL, last_error = %(error)s
        WHERE id = %(id)s AND status = 'delivering' AND attempts = %(attempt)s
        RETURNING status""",
    "reap": """
        UPDATE webhook_delivery SET
            status = CASE WHEN attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
            next_attempt_at = now(), lease_until = NULL, last_error = 'lease expired'
        WHERE status = 'delivering' AND lease_until <= now()
        RETURNING event_key""",
}

DELIVERED, RETRY, REJECTED = "delivered", "retry", "rejected"
TLS = ssl.create_default_context()  # loading the CA bundle costs ~0.2 s: once, not per POST


@dataclass(frozen=True)
class Config:
    lease: int = 300
    heartbeat: int = 60
    max_attempts: int = 5
    backoff_base: int = 60
    backoff_cap: int = 3600


@dataclass(frozen=True)
class Delivery:
    id: int
    event_key: str
    attempt: int
    endpoint: str
    payload: dict


class Deliveries:
    """The queue's operations, each one transaction on the caller's connection."""

    def __init__(
        self, conn: AsyncConnection, config: Config = Config(), queries: dict[str, str] = QUERIES
    ):
        self.conn, self.config, self.q = conn, config, queries

    async def _run(self, name: str, params: dict) -> list[tuple]:
        async with self.conn.transaction():
            cur = await self.conn.execute(self.q[name], params)
            return await cur.fetchall() if cur.description else [()] * cur.rowcount

    async def publish(self, event_key: str, endpoint: str, payload: dict) -> int | None:
        """The delivery's id; None when the event was already published (the same delivery)."""
        rows = await self._run(
            "publish", {"key": event_key, "endpoint": endpoint, "payload": Jsonb(payload)}
        )
        return rows[0][0] if rows else None

    async def claim(self, batch: int) -> list[Delivery]:
        rows = await self._run("claim", {"batch": batch, "lease": self.config.lease})
        return sorted((Delivery(*r) for r in rows), key=lambda d: d.id)

    async def heartbeat(self, d: Delivery) -> bool:
        """False: the delivery is no longer this worker's."""
        params = {"id": d.id, "attempt": d.attempt, "lease": self.config.lease}
        return bool(await self._run("heartbeat", params))

    async def delivered(self, d: Delivery) -> bool:
        return bool(await self._run("delivered", {"id": d.id, "attempt": d.attempt}))

    async def failed(self, d: Delivery, permanent: bool, error: str) -> str | None:
        """The delivery's new status; None when it is no longer this worker's."""
        c = self.config
        rows = await self._run(
            "failed",
            {
                "id": d.id,
                "attempt": d.attempt,
                "permanent": permanent,
                "error": error,
                "max_attempts": c.max_attempts,
                "base": c.backoff_base,
                "cap": c.backoff_cap,
            },
        )
        return rows[0][0] if rows else None

    async def reap(self) -> list[str]:
        """Take back deliveries whose lease lapsed; their event keys."""
        rows = await self._run("reap", {"max_attempts": self.config.max_attempts})
        return [r[0] for r in rows]


async def deliver(d: Delivery, url: str | None = None, timeout: float = 5.0) -> str:
    """POST the event to its endpoint (or ``url``): delivered, retry (5xx) or rejected (4xx).
    Raises httpx.TransportError when no answer came (the receiver may still have it)."""
    async with httpx.AsyncClient(timeout=timeout, verify=TLS) as client:
        r = await client.post(
            url or d.endpoint, json=d.payload, headers={"Idempotency-Key": d.event_key}
        )
    if r.status_code < 300:
        return DELIVERED
    return REJECTED if 400 <= r.status_code < 500 else RETRY
