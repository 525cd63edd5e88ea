"""The mutant catalogue itself, without a database: every mutant declares an invariant its check
can name (a mutant is caught only when the failure names it), and each still applies to the
reference (an SQL edit whose text vanished would silently turn a mutant into the reference)."""

from __future__ import annotations

import pytest

from knownstate.chaos import kinds
from knownstate.chaos.mutants import Mutant, catalogue_problems


@pytest.mark.parametrize("kind", kinds.names())
def test_every_declared_invariant_is_one_the_check_can_name(kind):
    check = kinds.check(kind)
    assert catalogue_problems(check, kinds.mutants(kind)) == []
    for m in kinds.mutants(kind):
        assert issubclass(m.machine(check), check)


def test_a_declared_invariant_the_check_never_names_is_refused():
    check = kinds.check("outbox")
    bogus = Mutant("x", "outbox", "retry-politeness", "a typo", lambda c: c)
    [problem] = catalogue_problems(check, [bogus])
    assert "retry-politeness" in problem and "retry-policy" in problem
