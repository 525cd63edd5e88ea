"""A write frozen inside its transaction (``schedules.frozen``), the write a worker about to
freeze makes (``FaultAnswers.next_write``), and what a run must see of it
(``genericbuild.required_events``). Pure Python: the schedule is a function of its draws."""

from __future__ import annotations

from knownstate.chaos import schedules
from knownstate.chaos.adapter import OK, RETRY
from knownstate.chaos.blocks import frozen_retaken
from knownstate.chaos.genericbuild import required_events
from knownstate.chaos.genericfaults import FaultAnswers
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


class _Held:
    def __init__(self, result: str | None = None) -> None:
        self.result = result


class _Holder(FaultAnswers):
    """A described queue's faults with worker 0 holding runs ``held`` (key: the answer its call
    was read as, or None before its call); a call's answer is read as the adapter reads it."""

    receiver = object()  # it calls out

    def __init__(self, held: dict[str, str | None]) -> None:
        self.held = [{k: _Held(r) for k, r in held.items()}]
        self.calls: list[tuple[str, int]] = []

    def _mine(self, w: int, sent: bool | None) -> list[str]:
        return [k for k, h in self.held[w].items() if sent is None or (h.result is None) != sent]

    def _send(self, w: int, key: str, answer: int) -> tuple[str, int]:
        return key, answer

    def do(self, w: int, call: tuple[str, int]) -> None:
        key, answer = call
        self.calls.append(call)
        self.held[w][key].result = OK if answer == 200 else RETRY


class _First:
    """Draws the first of everything."""

    def draw(self, strategy, label=None):
        return 0


def test_a_worker_about_to_freeze_inside_its_write_calls_first_for_a_completion_to_freeze():
    """A worker whose only call failed freezes inside the write that records the failure, and
    the frozen completion (the write a fence exists for) never happens: one that also holds a
    run it has not called for makes that call first, answered 200, and freezes completing it.
    Only a frozen stall does (a worker resuming after its runs were taken back makes its next
    write as it would), and only where no call of its was answered 200 already."""
    failed_and_unsent = {"a": RETRY, "b": None}
    frozen = _Holder(failed_and_unsent)
    assert frozen.next_write(0, _First(), frozen=True) == frozenset({"b"})
    assert frozen.calls == [("b", 200)]

    resuming = _Holder(failed_and_unsent)
    assert resuming.next_write(0, _First(), frozen=False) == frozenset({"a"})
    assert resuming.calls == []

    answered = _Holder({"a": OK, "b": None})
    assert answered.next_write(0, _First(), frozen=True) == frozenset({"a"})
    assert answered.calls == []
