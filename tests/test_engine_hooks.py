"""The engine's extension point is documented in one place: every hook a built-in check gives
is in the table of :mod:`knownstate.chaos.engine`'s docstring, and the two engines are siblings
over one base, neither redefining the other. Fast: no real parts."""

from __future__ import annotations

import re

from hypothesis.stateful import RuleBasedStateMachine

from knownstate.chaos import engine, kinds
from knownstate.chaos.check import KindCheck
from knownstate.chaos.engine import Engine
from knownstate.chaos.replay import ReplayCheck

ENGINES = (Engine, KindCheck, ReplayCheck)
NOT_HOOKS = {"model_agrees", "fail"}  # the engine's own invariant and door, never given


def documented() -> set[str]:
    """The names in the first column of the table in the engine's docstring."""
    lines = engine.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("==")]
    width = lines[rules[0]].index(" ")
    rows = lines[rules[0] : rules[-1]]
    return {n for line in rows for n in re.findall(r"``(\w+)", line[:width])}


def hooks_given(check: type) -> set[str]:
    """Public names a check class (and its bases up to an engine) defines over an engine's."""
    base = set(dir(KindCheck)) | set(dir(ReplayCheck))
    base -= set(dir(RuleBasedStateMachine))  # Hypothesis's own (teardown, ...)
    given: set[str] = set()
    for cls in check.__mro__:
        if cls in ENGINES or cls is object:
            break
        given |= {n for n in vars(cls) if n in base and not n.startswith("_")}
    return given - NOT_HOOKS


def test_every_hook_a_built_in_check_gives_is_in_the_engine_table():
    table = documented()
    missing = {
        name: sorted(hooks_given(kinds.check(name)) - table)
        for name in kinds.built_in()
        if hooks_given(kinds.check(name)) - table
    }
    assert not missing, f"hooks given but not in chaos/engine.py's table: {missing}"


def test_the_two_engines_are_siblings_over_one_base():
    assert issubclass(KindCheck, Engine) and issubclass(ReplayCheck, Engine)
    assert not issubclass(ReplayCheck, KindCheck) and not issubclass(KindCheck, ReplayCheck)


def test_every_built_in_model_is_a_run_model():
    """What the engine asks of a model (:class:`RunModel`): each durable kind's model has it, and
    its copy is independent (the engine keeps several after a step nobody knows the outcome of)."""
    from knownstate.model.approved_plan import ApprovedPlanModel
    from knownstate.model.branch_reset import BranchResetModel
    from knownstate.model.contract import RunModel
    from knownstate.model.outbox import DESCRIPTION as OUTBOX
    from knownstate.model.generic import GenericModel
    from knownstate.model.outbox import OutboxModel

    for model in (OutboxModel(), ApprovedPlanModel(), BranchResetModel(), GenericModel(OUTBOX)):
        assert isinstance(model, RunModel), type(model).__name__
        twin = model.copy()
        assert type(twin) is type(model) and twin is not model
        twin.transitions.append(("run", "a", "event", "b"))
        twin.advance(60)
        assert model.transitions == [], f"{type(model).__name__}.copy() shares its transition log"
