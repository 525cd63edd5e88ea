"""The shared contract on its own: fast, pure, no I/O.

The transition table is data: ``next`` looks a step up, an illegal step raises a typed error that
names the kind, the status and the event, and the table renders its own Mermaid diagram. Then the
six invariants of the seed: for each, a hand-made pair of views that violates it (and only it) is
caught under that invariant's name, and a good pair passes with no violation at all.
"""

from __future__ import annotations

import pytest

from knownstate.model.contract import (
    CREATED,
    INVARIANTS,
    Contract,
    ExternalEffect,
    IllegalTransition,
    LeaseClock,
    Repeat,
    RetryView,
    RunView,
    StepView,
    TransitionTable,
    Write,
    check_invariants,
)

# A toy run kind, small enough to reason about by eye: queued -> running -> done | failed,
# running -> queued when reclaimed.
TOY = TransitionTable(
    "toy",
    [
        (CREATED, "submit", "queued"),
        ("queued", "start", "running"),
        ("running", "heartbeat", "running"),
        ("running", "finish", "done"),
        ("running", "crash", "failed"),
        ("running", "reclaim", "queued"),
    ],
)


def contract(effect: ExternalEffect = ExternalEffect.NONE, retries: bool = True) -> Contract:
    return Contract(
        kind="toy",
        table=TOY,
        terminal=frozenset({"done", "failed"}),
        claim="c",
        lease="l",
        lease_clock=LeaseClock.DATABASE,
        reaper="r",
        fence="f",
        receipts="rc",
        retry_policy="none",
        external_effect=effect,
        retries=retries,
        owned=frozenset({"running"}),
    )


def run(status: str, token: int = 1, steps: dict | None = None, **kw) -> RunView:
    return RunView(run_id="r1", status=status, fence_token=token, steps=steps or {}, **kw)


def one(step: StepView) -> dict:
    return {"s0": step}


def names(violations) -> list[str]:
    return sorted({v.invariant for v in violations})


# ---------------------------------------------------------------------------
# TransitionTable
# ---------------------------------------------------------------------------


def test_next_follows_the_table_row_by_row():
    for t in TOY.transitions:
        assert TOY.next(t.source, t.event) == t.target
    assert TOY.next("running", "heartbeat") == "running"  # a self-loop is a transition too


@pytest.mark.parametrize(
    "status, event",
    [
        ("queued", "finish"),  # a real event, from the wrong status
        ("done", "reclaim"),  # nothing leaves a terminal status
        (CREATED, "start"),  # a run that does not exist yet cannot start
        ("running", "teleport"),  # an event the kind does not have
    ],
)
def test_an_illegal_transition_raises_naming_kind_status_and_event(status, event):
    before = dict(TOY._next)
    with pytest.raises(IllegalTransition) as info:
        TOY.next(status, event)
    err = info.value
    assert (err.kind, err.status, err.event) == ("toy", status, event)
    assert "toy" in str(err) and repr(status) in str(err) and repr(event) in str(err)
    assert TOY._next == before  # a lookup never mutates the table


def test_a_table_refuses_two_targets_for_one_source_and_event():
    with pytest.raises(ValueError, match="two targets"):
        TransitionTable("bad", [("a", "go", "b"), ("a", "go", "c")])


def test_edges_allows_and_statuses():
    assert TOY.edges() == frozenset(
        {
            (CREATED, "queued"),
            ("queued", "running"),
            ("running", "running"),
            ("running", "done"),
            ("running", "failed"),
            ("running", "queued"),
        }
    )
    assert TOY.allows("running", "queued") and TOY.allows(CREATED, "queued")
    assert not TOY.allows("queued", "done") and not TOY.allows("done", "running")
    # statuses in first-seen order, without the creation pseudo-status
    assert TOY.statuses() == ("queued", "running", "done", "failed")
    assert contract().statuses == TOY.statuses()
    assert contract().is_terminal("done") and not contract().is_terminal("running")


def test_mermaid_is_generated_from_the_table():
    lines = TOY.mermaid().splitlines()
    assert lines[0] == "stateDiagram-v2"
    assert lines[1:] == [
        "    [*] --> queued: submit",
        "    queued --> running: start",
        "    running --> running: heartbeat",
        "    running --> done: finish",
        "    running --> failed: crash",
        "    running --> queued: reclaim",
    ]


# ---------------------------------------------------------------------------
# The six invariants: each violation caught by name; good steps pass.
# ---------------------------------------------------------------------------


def test_the_six_invariants_of_the_seed_and_three_guarantees_of_its_contract_table():
    assert list(INVARIANTS) == [
        "conditional-transition",
        "lease-fence",
        "receipt-with-effect",
        "stable-step-identity",
        "terminal-answers-from-receipts",
        "external-effect-semantics",
        "claim",
        "lease",
        "retry-policy",
    ]


JUDGED_BY_THE_ENGINE = {"claim"}
"""Judged by the check engine from what an operation did, not from views: a claim waiting on
another worker's lock (seen by the server while it happens), a claim whose choice of runs differs
from the contract's (chaos.check, ``apply(guarantee=...)``)."""


GOOD_STEPS = [
    # (description, before, after, writes, repeats, effect)
    ("creation", {}, {"r1": run("queued", 0)}, [], [], ExternalEffect.NONE),
    ("claim", {"r1": run("queued", 0)}, {"r1": run("running", 1)}, [], [], ExternalEffect.NONE),
    ("a self-loop", {"r1": run("running")}, {"r1": run("running")}, [], [], ExternalEffect.NONE),
    (
        "the owner finishes with its receipt",
        {"r1": run("running", steps=one(StepView()))},
        {"r1": run("done", steps=one(StepView(receipts=1, effects=1)))},
        [Write("r1", 1, accepted=True, owner_current=True)],
        [],
        ExternalEffect.NONE,
    ),
    (
        "a stale owner refused",
        {"r1": run("running", 2)},
        {"r1": run("running", 2)},
        [Write("r1", 1, accepted=False, owner_current=False)],
        [],
        ExternalEffect.NONE,
    ),
    (
        "a repeat answered from receipts",
        {"r1": run("done", steps=one(StepView(1, 1)))},
        {"r1": run("done", steps=one(StepView(1, 1)))},
        [],
        [Repeat("r1", reexecuted=False)],
        ExternalEffect.NONE,
    ),
    (
        "a frozen payload's own step",
        {"r1": run("running")},
        {"r1": run("running", steps={"0": StepView(1, 1)}, valid_step_ids=frozenset({"0", "1"}))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "at-least-once: the external call arrived before the record",
        {"r1": run("running", steps=one(StepView(external_calls=1)))},
        {"r1": run("done", steps=one(StepView(1, 1, external_calls=1)))},
        [],
        [],
        ExternalEffect.AT_LEAST_ONCE,
    ),
    (
        "at-least-once: a stale owner repeats the call after the run ended "
        "(the documented duplicate)",
        {"r1": run("done", steps=one(StepView(1, 1, external_calls=1)))},
        {"r1": run("done", steps=one(StepView(1, 1, external_calls=2)))},
        [],
        [],
        ExternalEffect.AT_LEAST_ONCE,
    ),
    (
        "a retry that waits its backoff",
        {"r1": run("running")},
        {"r1": run("queued", retry=RetryView(1, 3, waiting=True, due_in=60, owed=60))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "a lapsed lease reclaimed, due at once",
        {"r1": run("running")},
        {"r1": run("queued", retry=RetryView(1, 3, waiting=True, due_in=0, owed=0))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "create once, then poll",
        {"r1": run("running", external_creations=1)},
        {"r1": run("done", external_creations=1)},
        [],
        [],
        ExternalEffect.CREATE_ONCE_THEN_POLL,
    ),
]


@pytest.mark.parametrize(
    "desc, before, after, writes, repeats, effect", GOOD_STEPS, ids=[g[0] for g in GOOD_STEPS]
)
def test_good_steps_pass(desc, before, after, writes, repeats, effect):
    assert check_invariants(contract(effect), before, after, writes, repeats) == []


BAD_STEPS = [
    # (invariant that must be named, description, before, after, writes, repeats, effect)
    (
        "conditional-transition",
        "a move the table does not have",
        {"r1": run("queued")},
        {"r1": run("done")},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "conditional-transition",
        "a run born in the wrong status",
        {},
        {"r1": run("running")},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "lease-fence",
        "the current owner's write refused by the fence",
        {"r1": run("running")},
        {"r1": run("running")},
        [Write("r1", 1, accepted=False, owner_current=True)],
        [],
        ExternalEffect.NONE,
    ),
    (
        "lease",
        "a claim whose lease was stamped by another clock",
        {"r1": run("queued", 1)},
        {"r1": run("running", 2, lease_left=0, lease_granted=300)},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "lease-fence",
        "a claim that keeps the fence token of the owner before",
        {"r1": run("queued", 1)},
        {"r1": run("running", 1)},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "lease-fence",
        "a stale owner's write accepted",
        {"r1": run("running", 2)},
        {"r1": run("running", 2)},
        [Write("r1", 1, accepted=True, owner_current=False)],
        [],
        ExternalEffect.NONE,
    ),
    (
        "receipt-with-effect",
        "an effect without its receipt",
        {"r1": run("running")},
        {"r1": run("running", steps=one(StepView(receipts=0, effects=1)))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "receipt-with-effect",
        "a receipt without its effect",
        {"r1": run("running")},
        {"r1": run("running", steps=one(StepView(receipts=1, effects=0)))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "receipt-with-effect",
        "a run that disappeared",
        {"r1": run("running")},
        {},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "stable-step-identity",
        "a step applied twice",
        {"r1": run("running")},
        {"r1": run("running", steps=one(StepView(receipts=2, effects=2)))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "stable-step-identity",
        "a step id that is a call counter, not a payload position",
        {"r1": run("running")},
        {"r1": run("running", steps={"7": StepView(1, 1)}, valid_step_ids=frozenset({"0", "1"}))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "terminal-answers-from-receipts",
        "a repeat request that re-executed",
        {"r1": run("done")},
        {"r1": run("done")},
        [],
        [Repeat("r1", reexecuted=True)],
        ExternalEffect.NONE,
    ),
    (
        "terminal-answers-from-receipts",
        "a terminal run whose receipts changed",
        {"r1": run("done", steps=one(StepView(1, 1)))},
        {"r1": run("done", steps={"s0": StepView(1, 1), "s1": StepView(1, 1)})},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "terminal-answers-from-receipts",
        "a call repeated after the end, where calls are not at-least-once",
        {"r1": run("done", steps=one(StepView(1, 1, external_calls=1)))},
        {"r1": run("done", steps=one(StepView(1, 1, external_calls=2)))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "external-effect-semantics",
        "an external operation created twice",
        {"r1": run("running", external_creations=1)},
        {"r1": run("running", external_creations=2)},
        [],
        [],
        ExternalEffect.CREATE_ONCE_THEN_POLL,
    ),
    (
        "retry-policy",
        "a retry due before its backoff",
        {"r1": run("running")},
        {"r1": run("queued", retry=RetryView(1, 3, waiting=True, due_in=0, owed=60))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "retry-policy",
        "tried again past the maximum attempts",
        {"r1": run("running")},
        {"r1": run("queued", retry=RetryView(3, 3, waiting=True, due_in=240, owed=240))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "retry-policy",
        "waiting past the maximum attempts, seen after several moves at once",
        {"r1": run("queued", retry=RetryView(3, 3, waiting=True, due_in=240, owed=240))},
        {"r1": run("queued", retry=RetryView(3, 3, waiting=True, due_in=240, owed=240))},
        [],
        [],
        ExternalEffect.NONE,
    ),
    (
        "retry-policy",
        "a failed step that does not end a run without retries",
        {"r1": run("running")},
        {"r1": run("running", steps=one(StepView(failed=1)))},
        [],
        [],
        ExternalEffect.NONE,
        False,
    ),
    (
        "external-effect-semantics",
        "recorded as done but the external call never arrived",
        {"r1": run("running", steps=one(StepView()))},
        {"r1": run("done", steps=one(StepView(1, 1, external_calls=0)))},
        [],
        [],
        ExternalEffect.AT_LEAST_ONCE,
    ),
]


BAD_STEPS = [b if len(b) == 8 else (*b, True) for b in BAD_STEPS]  # the last: whether it retries


@pytest.mark.parametrize(
    "invariant, desc, before, after, writes, repeats, effect, retries",
    BAD_STEPS,
    ids=[f"{b[0]}: {b[1]}" for b in BAD_STEPS],
)
def test_each_violation_is_caught_under_its_invariants_name(
    invariant, desc, before, after, writes, repeats, effect, retries
):
    found = check_invariants(contract(effect, retries), before, after, writes, repeats)
    assert names(found) == [invariant], [str(v) for v in found]
    assert all("r1" in v.message for v in found)
    assert all(str(v).startswith(f"{invariant}: ") for v in found)


def test_every_invariant_has_a_violation_that_is_caught():
    assert {b[0] for b in BAD_STEPS} == set(INVARIANTS) - JUDGED_BY_THE_ENGINE


def test_a_terminal_status_that_changes_breaks_two_invariants():
    found = check_invariants(contract(), {"r1": run("done")}, {"r1": run("running")})
    assert names(found) == ["conditional-transition", "terminal-answers-from-receipts"]


def test_every_violation_of_a_step_is_reported_not_only_the_first():
    before = {"r1": run("queued"), "r2": RunView("r2", "running", 3)}
    after = {"r1": run("done", steps=one(StepView(receipts=0, effects=2)))}
    found = check_invariants(
        contract(), before, after, [Write("r2", 2, accepted=True, owner_current=False)]
    )
    assert names(found) == [
        "conditional-transition",
        "lease-fence",
        "receipt-with-effect",
        "stable-step-identity",
    ]
    assert any("r2 disappeared" in v.message for v in found)
