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


def test_a_stale_write_carrying_the_newest_token_is_derived_where_a_fence_on_a_token_is():
    """Derived by the check, not from SQL: a library that names none gets it too, behind a
    fence on the claim's token that a lapsed run meets again; not where nothing is claimed
    again, nor behind a fence without a token (which would let the write land anyway)."""
    from knownstate.chaos.adapter import Adapter
    from knownstate.chaos.genericbuild import WIRE_GUARDS, derived_mutants
    from knownstate.model.describe import Fence
    from knownstate.model.outbox import DESCRIPTION

    wire = {name for name, _, _ in WIRE_GUARDS}  # of its claim's lock: another test's

    def names(**update):
        mutants = derived_mutants(DESCRIPTION.model_copy(update=update), Adapter)
        return [m.name for m in mutants if m.name not in wire]

    assert names() == ["stale-write-takes-current-token"]
    assert names(fence=Fence(kind="claim")) == ["stale-write-takes-current-token"]
    for kind in ("status", "row-lock", "unless-terminal", "none"):
        assert names(fence=Fence(kind=kind)) == [], kind
    assert names(lease=None) == []
