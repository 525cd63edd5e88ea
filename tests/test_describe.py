"""A run kind described as data (``knownstate.model.describe``): fast, pure.

An inconsistent description is refused when it is defined, and the refusal names what to
change; a consistent one gives the contract the invariants read (the built-in models compute
their CONTRACT from their descriptions), and specs/contract.md is generated from the
descriptions.
"""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from knownstate.model.contract import ExternalEffect, LeaseClock
from knownstate.model.describe import Claim, Fence, Lease, Retry, RunKind, seconds

QUEUE = dict(
    name="jobs",
    statuses=("pending", "running", "done", "failed", "dead"),
    initial="pending",
    owned=("running",),
    terminal=("done", "failed", "dead"),
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> running",
        "running -extend_lease-> running",
        "running -complete-> done",
        "running -fail_permanent-> failed",
        "running -retry-> pending",
        "running -give_up-> dead",
        "running -reclaim-> pending",
        "running -reclaim_dead-> dead",
    ),
    claim=Claim(how="SKIP LOCKED"),
    lease=Lease(seconds="5m", heartbeat="1m", taken_back_by=("reclaim", "reclaim_dead")),
    fence=Fence(kind="attempt"),
    receipts="the row",
    retry=Retry(max_attempts=3, base="1m", cap="1h"),
)


def refused(**changes) -> str:
    with pytest.raises(ValidationError) as e:
        RunKind(**{**QUEUE, **changes})
    return str(e.value)


def test_a_consistent_description_gives_its_contract():
    c = RunKind(**QUEUE).contract()
    assert c.kind == "jobs" and c.owned == {"running"} and c.terminal == {"done", "failed", "dead"}
    assert c.table.next("running", "retry") == "pending" and c.retries
    assert c.lease_clock is LeaseClock.DATABASE and c.external_effect is ExternalEffect.NONE
    assert "300 s" in c.lease and "60 s" in c.lease and "3 attempts" in c.retry_policy


@pytest.mark.parametrize(
    "changes, hint",
    [
        (dict(initial="waiting"), "initial status 'waiting' is not among statuses"),
        (
            dict(transitions=QUEUE["transitions"] + ("running -cancel-> canceled",)),
            "status 'canceled' is not among statuses",
        ),
        (
            dict(transitions=QUEUE["transitions"] + ("done -retry-> pending",)),
            "terminal status 'done' has a transition out of it",
        ),
        (
            dict(transitions=QUEUE["transitions"] + ("running -complete-> failed",)),
            "event 'complete' from 'running' leads both to 'done' and to 'failed'",
        ),
        (dict(transitions=QUEUE["transitions"][1:]), "no transition creates a run in 'pending'"),
        (dict(statuses=QUEUE["statuses"] + ("parked",)), "status 'parked' is never reached"),
        (dict(owned=("done",)), "is both owned and terminal"),
        (
            dict(lease=Lease(seconds=300, taken_back_by=("reap",))),
            "Lease(taken_back_by) names event 'reap', which no transition has",
        ),
        (
            dict(lease=Lease(seconds=300, heartbeat=200, taken_back_by=("reclaim",))),
            "beat at least twice per lease",
        ),
        (dict(retry=None), "no retry policy, but 'running -retry-> pending' tries the run again"),
        (dict(retry=Retry(max_attempts=3, base="10m", cap="1m")), "the cap bounds the wait"),
        (dict(lease=None, transitions=QUEUE["transitions"][:5]), "fence 'attempt' without a lease"),
        (dict(external_key=True), "an idempotency key goes with an external call"),
        (dict(transitions=("pending -> running",)), "write it as 'source -event-> target'"),
    ],
)
def test_an_inconsistent_description_is_refused_with_a_hint(changes, hint):
    assert hint in refused(**changes)


def test_statuses_initial_and_terminal_default_to_what_the_transitions_say():
    said = {k: v for k, v in QUEUE.items() if k not in ("statuses", "initial", "terminal")}
    assert RunKind(**said) == RunKind(**QUEUE)
    # said anyway, they are checked as written: a terminal status with a way out is refused
    assert "has a transition out of it" in refused(terminal=("done", "running"))


def test_a_status_that_can_never_end_is_refused():
    stuck = QUEUE["transitions"] + ("pending -park-> parked",)
    assert "status 'parked' can never end" in refused(
        statuses=QUEUE["statuses"] + ("parked",), transitions=stuck
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        (90, 90),
        ("90s", 90),
        ("5m", 300),
        ("2h", 7200),
        ("1d", 86400),
        (dt.timedelta(minutes=5), 300),
        (300.0, 300),
    ],
)
def test_durations_are_read_in_the_users_units(value, expected):
    assert seconds(value) == expected


@pytest.mark.parametrize("value", ["5 minutes", -1, 0, 1.5, True, "m"])
def test_a_duration_that_is_not_one_is_refused(value):
    with pytest.raises(ValueError):
        seconds(value)


def test_no_fence_is_allowed_and_described():
    d = RunKind(**{**QUEUE, "fence": Fence(kind="none")})
    assert d.contract().fence.startswith("none")
