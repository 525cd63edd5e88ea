"""A write frozen inside its transaction (``schedules.frozen``) and what a run must see of it
(``genericbuild.required_events``). Pure Python: the schedule is a function of its draws."""

from __future__ import annotations

from knownstate.chaos import schedules
from knownstate.chaos.blocks import frozen_retaken
from knownstate.chaos.genericbuild import required_events
from knownstate.chaos.kinds.outbox import CHECKED, OutboxAdapter


class Drawn:
    """Draws as a seed might: the others in the order given, and a freeze whenever asked."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def draw(self, strategy, label: str):
        self.labels.append(label)
        return ["w1", "w2"] if "order" in label else 3


def test_a_write_never_freezes_right_after_its_begin():
    """Frozen after its BEGIN a write has read nothing: it would only run after the others, and
    a write that reads, then writes (the race a fence is for) would never be frozen between the
    two. It freezes after its first statement that is not a BEGIN."""
    data = Drawn()
    at = {"w1": "UPDATE ...", "w2": "UPDATE ..."}
    choose = schedules.frozen(data, "w0", ["w1", "w2"], pending=at.get)
    everyone = ["w0", "w1", "w2"]
    at["w0"] = "BEGIN (transaction block)"
    assert choose(everyone) == "w0"  # no freeze drawn after a BEGIN
    at["w0"] = "SELECT status, attempts ..."
    assert choose(everyone) == "w0"  # the read, then frozen
    at["w0"] = "UPDATE ..."
    assert choose(everyone) == "w1"  # the others run while it is frozen
    assert sum("freezes" in label for label in data.labels) == 1


def test_a_frozen_completion_whose_run_is_taken_back_and_claimed_is_required_of_a_fenced_kind():
    """A run of a kind whose holders' writes are fenced by a lease does not pass without a
    frozen completion whose run another worker took back and claimed meanwhile (a frozen
    heartbeat does not stand for it); an owners-only control (no stale holder writes) is not
    asked for one."""

    def labels(events) -> set[str]:
        return {getattr(e, "label", e) for e in events}

    mode = OutboxAdapter.mode()
    required = labels(required_events(CHECKED, mode))
    assert frozen_retaken("complete") in required
    assert frozen_retaken("extend_lease") not in required
    assert frozen_retaken("complete") not in labels(required_events(CHECKED, mode, True))
