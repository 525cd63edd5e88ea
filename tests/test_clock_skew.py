"""The application's clock kept within a bound of the database's (``RunKind.clock_skew``).

Hosts' clocks are kept within seconds of each other (NTP), and a library that mixes the two
clocks may be correct only within that bound. A description says it with ``clock_skew``; the
gate then draws each skew of the application's clock within it, and a jump of the database's
clock passes on both, so the two are never further apart. Unbounded (the default), the clocks
are apart by every jump and skew drawn, as before. The first tests are the description's; the
last runs the queue of ``tests/test_app_clock_lease.py`` on the real parts, with and without
the bound, and follows the distance between the two clocks through every trace.
"""

from __future__ import annotations

import re

import pytest

from knownstate.chaos.check import run_check
from knownstate.chaos.generic import kind
from knownstate.model.describe import Claim, Fence, Lease, RunKind
from tests.test_app_clock_lease import AppLease

LINES = (
    "(new) -enqueue-> queued",
    "queued -claim-> running",
    "running -extend_lease-> running",
    "running -complete-> done",
    "running -reclaim-> queued",
)


def described(
    clock_skew: str | None = None,
    lease_clock: str = "application",
    unscheduled: str = "always",
    name: str = "app-lease",
) -> RunKind:
    """The application-clock lease of ``tests/test_app_clock_lease.py``, bounded or not."""
    return RunKind(
        name=name,
        owned=("running",),
        transitions=LINES,
        claim=Claim(how="queued jobs, SKIP LOCKED", unscheduled=unscheduled),
        lease=Lease(
            seconds="1m",
            heartbeat="30s",
            clock=lease_clock,
            taken_back_by=("reclaim",),
            requeue_clock="unchanged",
        ),
        fence=Fence(kind="attempt"),
        receipts="the job row",
        clock_skew=clock_skew,
    )


# -- the description ------------------------------------------------------------------------


def test_a_bound_without_an_application_clock_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        described("5s", lease_clock="database")
    message = str(refused.value)
    assert "clock_skew=5 s without an application clock" in message
    assert "Claim(unscheduled='application') or Lease(clock='application')" in message
    described("5s", lease_clock="database", unscheduled="application")  # a schedule is one


def test_the_bound_parses_as_a_duration_and_defaults_to_unbounded():
    assert described("1m").clock_skew == 60 and described(5).clock_skew == 5
    assert described().clock_skew is None
    with pytest.raises(ValueError, match="positive whole number of seconds"):
        described("0s")


def test_the_contract_states_the_bound_where_the_application_clock_is_used():
    bound = "the application's clock within ±5 s of the database's"
    leased = described("5s").contract()
    assert leased.lease.endswith(f"; {bound}") and bound not in leased.claim
    scheduled = described("5s", lease_clock="database", unscheduled="application").contract()
    assert (
        scheduled.claim
        == f"queued jobs, SKIP LOCKED; due by the application's now at enqueue, {bound}"
    )
    assert bound not in scheduled.lease
    unbounded = described().contract()  # what every description without it says, unchanged
    assert unbounded.claim == "queued jobs, SKIP LOCKED"
    assert unbounded.lease == (
        "60 s claim lease stamped with the application clock, extended by a heartbeat every 30 s"
    )


# -- the real parts -------------------------------------------------------------------------

SKEW = re.compile(r"application clock ([+-]\d+)s")
JUMP = re.compile(r"^FAULT (?:db clock jump|time shift) ([+-]\d+)s")
STATED = re.compile(r"(\d+)s (ahead of|behind) the database's \(bound 60s, the described 5s")


def distances(trace: list[str]) -> list[tuple[int, int | None]]:
    """The distance between the two clocks after every line that moves one, counted from the
    amounts each moves (the application's ahead: positive), with what the line states, if
    it states it. A jump the application's clock moves with (the line after it) is one move;
    a stall passes on both clocks of an application-clock lease: it moves neither apart."""
    apart, seen = 0, []
    for i, line in enumerate(trace):
        skew, jump = SKEW.search(line), JUMP.match(line)
        if skew is None and jump is None:
            continue
        apart += int(skew.group(1)) if skew else -int(jump.group(1))
        if jump and i + 1 < len(trace) and "with it" in trace[i + 1]:
            continue
        stated = STATED.search(line)
        said = None
        if stated is not None:
            said = int(stated.group(1)) * (1 if stated.group(2) == "ahead of" else -1)
        seen.append((apart, said))
    return seen


BoundedKind = kind(described("5s", name="app-lease-skew-5s"), AppLease)
UnboundedKind = kind(described(name="app-lease-unbounded"), AppLease)


def test_the_bound_scales_with_the_other_durations_to_whole_quanta():
    """The model keeps every time in whole quanta of the check (60 s): 5 s beside a 1 m lease
    and a 30 s heartbeat scales all by 12; an unbounded description scales as it did."""
    assert BoundedKind.timing.scale == 12 and BoundedKind.timing.clock_skew == 60
    assert BoundedKind.timing.lease == 720
    assert UnboundedKind.timing.scale == 2 and UnboundedKind.timing.clock_skew is None


@pytest.mark.slow
def test_the_application_clock_stays_within_the_bound_and_without_it_does_not(knownstate_env):
    """Six examples of each at seed 1: bounded, every skew and every jump (on both clocks)
    leaves the clocks at most 5 described seconds apart (60 s at the check's scale, 12), the
    distance each line states being the one its amounts add up to; unbounded, the same
    queue's clocks drift minutes apart."""
    bounded: list[list[str]] = []
    r = run_check(
        BoundedKind, knownstate_env, seed=1, examples=6, require_all=False, traces=bounded
    )
    assert r.passed, r.failure
    assert r.stats.faults["app-clock-skew"] >= 1 and r.stats.faults["db-clock-jump"] >= 1
    seen = [d for trace in bounded for d in distances(trace)]
    assert all(apart == said for apart, said in seen if said is not None), seen
    assert any(said not in (None, 0) for _, said in seen), seen  # the clocks were set apart
    assert max(abs(apart) for apart, _ in seen) / BoundedKind.timing.scale <= 5, seen

    unbounded: list[list[str]] = []
    r = run_check(
        UnboundedKind, knownstate_env, seed=1, examples=6, require_all=False, traces=unbounded
    )
    assert r.passed, r.failure
    seen = [d for trace in unbounded for d in distances(trace)]
    assert max(abs(apart) for apart, _ in seen) / UnboundedKind.timing.scale > 5, seen
