"""A webhook-delivery queue on PostgreSQL, and its knownstate binding.

- :mod:`webhook_kind.deliveries`: the system (what a team already has): asyncio, psycopg 3's
  AsyncConnection, httpx. It knows nothing of knownstate.
- :mod:`webhook_kind.binding`: what the team writes to put it under the gate — a description
  and an adapter. Registered through the ``knownstate.kinds`` entry point as ``webhook``.
- :mod:`webhook_kind.unfenced`: the same system with its fence taken out of the SQL; the gate
  catches it (``knownstate verify --kind webhook_kind.unfenced:UnfencedWebhookKind``).
"""
