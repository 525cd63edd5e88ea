"""The webhook queue with its fence taken out: a deliberate bug the gate must catch.

Its writes still check ``status = 'delivering'`` but no longer the claimed attempt. A worker
that stalls past its lease, while the reaper takes its delivery back and another worker claims
it again, then overwrites the new owner's delivery. The description still promises the attempt
fence; the gate refuses the system, naming the ``lease-fence`` invariant::

    knownstate verify --kind webhook_kind.unfenced:UnfencedWebhookKind

(Not registered as an entry point: installing the example must not add a failing kind to
``knownstate verify``.)
"""

from knownstate.chaos.generic import kind

from .binding import WEBHOOK, WebhookAdapter

FENCE = " AND attempts = %(attempt)s"


class UnfencedAdapter(WebhookAdapter):
    queries = {name: sql.replace(FENCE, "") for name, sql in WebhookAdapter.queries.items()}
    guards = {k: v for k, v in WebhookAdapter.guards.items() if k != "fence"}


UnfencedWebhookKind = kind(WEBHOOK.model_copy(update={"name": "webhook-unfenced"}), UnfencedAdapter)
