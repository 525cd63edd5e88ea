"""The webhook queue against the contract, under real faults, inside this package's own test
suite (knownstate's pytest plugin; ``pytest --knownstate-seed N`` replays a seed)."""

from webhook_kind.binding import WebhookKind


def test_the_webhook_queue_meets_the_contract(check_run_kind):
    check_run_kind(WebhookKind)


def test_the_gate_catches_a_delivery_recorded_without_the_fence(check_run_kind):
    """The mutant the gate derives from the adapter's SQL: 'delivered' without its attempt
    match. It must be caught, naming lease-fence."""
    check_run_kind(WebhookKind, mutant="no-fence-in-delivered")
