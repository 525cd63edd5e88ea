"""The linearizability checker (knownstate.chaos.linearize), pure: no database.

What a wrong checker would get wrong, each pinned here: an order that breaks real time, an
outcome the model does not give, rows no order produces, an indeterminate operation forced to
have happened (or not), parts checked together that must be checked apart (and rows nobody
touched), the longest explained prefix in the report. A brute-force oracle (every permutation)
judges small random histories with the checker, with and without partitions.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knownstate.chaos import linearize as lin
from knownstate.chaos.bench import linearize as figure
from knownstate.chaos.linearize import UNKNOWN, FinalState, Operation, check
from knownstate.model.contract import LostRace, Won
from knownstate.model.outbox import Claim, Config, OutboxModel


class Registers:
    """A pure model of independent registers: ``put(k, v)`` and ``get(k)``."""

    def __init__(self, values=None):
        self.values = dict(values or {})
        self.transitions = []

    def copy(self) -> "Registers":
        other = Registers(self.values)
        other.transitions = list(self.transitions)
        return other

    def put(self, k, v):
        self.values[k] = v
        self.transitions.append(("put", k, v))
        return Won()

    def get(self, k):
        return Won(self.values.get(k))


def op(client, label, apply, call, ret, output=UNKNOWN, key=None) -> Operation:
    return Operation(client, label, apply, call, ret, output, key)


def put(client, k, v, call, ret, key=True):
    return op(client, f"put({k}, {v})", lambda m: m.put(k, v), call, ret, Won(), k if key else None)


def get(client, k, seen, call, ret, key=True):
    return op(client, f"get({k})", lambda m: m.get(k), call, ret, Won(seen), k if key else None)


# ---------------------------------------------------------------------------------------
# Orders, outcomes, real time.
# ---------------------------------------------------------------------------------------


def test_two_overlapping_claims_of_one_row_cannot_both_win_it():
    model = OutboxModel(Config())
    model.enqueue(1)
    one = Won((Claim(1, 1),))
    fine = [
        op("w0", "claim(1)", lambda m: m.claim(1), 0, 5, one),
        op("w1", "claim(1)", lambda m: m.claim(1), 1, 4, Won(())),
    ]
    verdict = check(fine, model)
    assert verdict.ok
    assert [o.client for o in verdict.order] == ["w0", "w1"]
    both = [dataclasses.replace(fine[1], output=one), fine[0]]
    verdict = check(both, model)
    assert verdict.ok is False
    text = "\n".join(verdict.explain())
    assert "not linearizable" in text
    assert "longest linearizable prefix (1 of 2)" in text
    assert "observed Won(value=(Claim(id=1, attempt=1),)), the model answers Won(value=())" in text


def test_the_states_an_operation_met_are_those_of_the_order_found_not_of_the_start():
    """w1's read overlaps w0's put and saw its value: in the order that explains it, the read met
    the state after the put (a judgment of the read by the state before the block would be
    wrong). Started from two possible states, the first operation may have met either."""
    model = Registers({"x": 0})
    history = [put("w0", "x", 1, 0, 5), get("w1", "x", 1, 1, 4)]
    verdict = check(history, model)
    met = lin.states_met(verdict.order, [model])
    assert [m.values for m in met["w0"]] == [{"x": 0}]
    assert [m.values for m in met["w1"]] == [{"x": 1}]
    either = [model, Registers({"x": 2})]
    met = lin.states_met(check(history, either).order, either)
    assert sorted(m.values["x"] for m in met["w0"]) == [0, 2]


def test_real_time_order_is_respected():
    """A get that returned before the put was called cannot see the put's value; overlapping,
    it can."""
    model = Registers()
    apart = [get("r", "x", 1, 0, 1), put("w", "x", 1, 2, 3)]
    assert check(apart, model).ok is False
    overlapping = [get("r", "x", 1, 0, 3), put("w", "x", 1, 1, 2)]
    verdict = check(overlapping, model)
    assert verdict.ok and [o.client for o in verdict.order] == ["w", "r"]


def test_every_operation_some_order_cannot_go_on_with_is_named_not_only_the_longest_prefix():
    """x starts at 0; w0 puts 1 while r reads 0 and w1 reads 2, all overlapping. Put first, r's
    read is refused (the model answers 1); r first, w1's is (the model answers 0, or 1 after the
    put). Both are dead ends, whichever prefix the search found longest."""
    model = Registers({"x": 0})
    ok = [put("w0", "x", 1, 0, 10), get("r", "x", 0, 1, 9), get("w1", "x", 1, 2, 8)]
    assert check(ok, model).ok
    bad = ok[:2] + [get("w1", "x", 2, 2, 8)]
    verdict = check(bad, model)
    assert verdict.ok is False
    assert {o.client for o, _, _ in verdict.refused_anywhere} == {"r", "w1"}
    answers = {o.client: raw for o, raw, _ in verdict.refused_anywhere}
    states = {o.client: [m.values for m in ms] for o, _, ms in verdict.refused_anywhere}
    assert states["r"] == [{"x": 1}] and {"x": 0} in states["w1"]
    assert answers["r"] == (Won(1),) and set(answers["w1"]) == {Won(0), Won(1)}
    # the longest prefix names only some of them
    assert {o.client for o, _ in verdict.next_refused} < {"r", "w1"}


def test_the_first_operation_refused_in_the_order_they_ended_is_named():
    """All called together: w0 puts 1 and returns first, then w1 puts 2, then r reads 3, which
    no order explains. Taken in the order they ended, r is refused where x is 2 (the model
    answers 2); listed first, or after w0 only, it would meet 0 or 1."""
    model = Registers({"x": 0})
    bad = [get("r", "x", 3, 0, 9), put("w0", "x", 1, 0, 3), put("w1", "x", 2, 0, 5)]
    verdict = check(bad, model)
    assert verdict.ok is False
    (refused,) = verdict.refused_in_end_order
    assert refused[0].client == "r" and refused[1] == (Won(2),)
    assert [m.values for m in refused[2]] == [{"x": 2}]


def test_a_model_that_raises_refuses_the_operation_and_the_report_says_so():
    model = OutboxModel(Config())
    bad = [op("w0", "lookup(9)", lambda m: m.deliveries[9], 0, 1, Won())]
    verdict = check(bad, model)
    assert verdict.ok is False
    assert "the model raises KeyError" in "\n".join(verdict.explain())


def test_several_candidate_initial_states_are_all_tried():
    after = Registers({"x": 1})
    history = [get("r", "x", 1, 0, 1)]
    assert check(history, Registers()).ok is False
    verdict = check(history, [Registers(), after])
    assert verdict.ok and [m.values for m in verdict.final_states] == [{"x": 1}]


# ---------------------------------------------------------------------------------------
# Indeterminate operations and final rows.
# ---------------------------------------------------------------------------------------


def _rows(m: Registers):
    return tuple(sorted(m.values.items()))


def test_an_indeterminate_operation_may_or_may_not_have_happened():
    cut = op("w", "put(x, 1)", lambda m: m.put("x", 1), 0, None)
    for observed, ok in (((), True), ((("x", 1),), True), ((("x", 2),), False)):
        verdict = check([cut], Registers(), final=FinalState(observed, _rows))
        assert verdict.ok is ok, observed
    # It may also take effect after an operation that started later and returned.
    after = [cut, get("r", "x", None, 1, 2)]
    assert check(after, Registers(), final=FinalState((("x", 1),), _rows)).ok
    seen = [cut, get("r", "x", 1, 1, 2)]
    assert check(seen, Registers(), final=FinalState((("x", 1),), _rows)).ok
    assert check(seen, Registers(), final=FinalState((), _rows)).ok is False


def test_an_unobserved_outcome_of_an_operation_that_did_happen_matches_any_outcome():
    history = [op("w", "get(x)", lambda m: m.get("x"), 0, 1)]
    assert check(history, Registers({"x": 3})).ok


def test_outcomes_explained_but_rows_not_is_reported_with_both_rows():
    history = [put("a", "x", 1, 0, 3), put("b", "x", 2, 1, 2)]
    assert check(history, Registers(), final=FinalState((("x", 2),), _rows)).ok
    verdict = check(history, Registers(), final=FinalState((("x", 3),), _rows))
    assert verdict.ok is False
    text = "\n".join(verdict.explain())
    assert "no order ends in the observed rows" in text
    assert "observed: (('x', 3),)" in text


def test_the_final_states_are_those_that_match_the_rows():
    history = [op("w", "put(x, 1)", lambda m: m.put("x", 1), 0, None)]
    verdict = check(history, Registers(), final=FinalState((("x", 1),), _rows))
    assert [m.values for m in verdict.final_states] == [{"x": 1}]
    verdict = check(history, Registers())
    assert sorted(str(m.values) for m in verdict.final_states) == ["{'x': 1}", "{}"]


# ---------------------------------------------------------------------------------------
# Partitions (P-compositionality).
# ---------------------------------------------------------------------------------------


def _split(rows):
    return dict(rows)


def test_parts_are_checked_apart_and_rows_nobody_touched_must_be_unchanged():
    history = [
        put("a", "x", 1, 0, 3),
        get("b", "x", 1, 1, 2),
        put("c", "y", 5, 0, 1),
        get("d", "y", 5, 2, 3),
    ]
    final = FinalState((("x", 1), ("y", 5), ("z", 0)), _rows, _split)
    verdict = check(history, Registers({"z": 0}), partition=lambda o: o.key, final=final)
    assert verdict.ok and verdict.partitions == 2
    moved = FinalState((("x", 1), ("y", 5), ("z", 9)), _rows, _split)
    verdict = check(history, Registers({"z": 0}), partition=lambda o: o.key, final=moved)
    assert verdict.ok is False and verdict.key == "z" and verdict.final == (0, 9)
    broken = history[:3] + [get("d", "y", 6, 2, 3)]
    verdict = check(broken, Registers({"z": 0}), partition=lambda o: o.key)
    assert verdict.ok is False and verdict.key == "y"
    assert [o.label for o in verdict.part] == ["put(y, 5)", "get(y)"]


def test_a_partitioned_check_with_final_rows_needs_a_split():
    with pytest.raises(ValueError, match="FinalState.split"):
        check(
            [put("a", "x", 1, 0, 1)],
            Registers(),
            partition=lambda o: o.key,
            final=FinalState((), _rows),
        )


# ---------------------------------------------------------------------------------------
# Against a brute-force oracle.
# ---------------------------------------------------------------------------------------


def _ends(history, initial):
    """Every order of the operations that respects real time, each indeterminate one taken or
    skipped, that explains every outcome: the model it ends in."""
    n = len(history)
    maybe = [i for i, o in enumerate(history) if o.ret is None]
    for skipped in itertools.chain.from_iterable(
        itertools.combinations(maybe, k) for k in range(len(maybe) + 1)
    ):
        ops = [i for i in range(n) if i not in skipped]
        for order in itertools.permutations(ops):
            pos = {i: p for p, i in enumerate(order)}
            if any(
                history[a].ret is not None and history[a].ret < history[b].call and pos[a] > pos[b]
                for a in ops
                for b in ops
            ):
                continue
            m = initial.copy()
            explained = True
            for i in order:
                got = history[i].apply(m)
                o = history[i]
                if o.ret is not None and o.output is not UNKNOWN and got != o.output:
                    explained = False
                    break
            if explained:
                yield m


def _oracle(history, initial, observed) -> bool:
    """Does an order explain every outcome and end in the observed rows?"""
    return any(_rows(m) == observed for m in _ends(history, initial))


@st.composite
def histories(draw):
    n = draw(st.integers(1, 5))
    out = []
    for i in range(n):
        k = draw(st.sampled_from(["x", "y"]))
        call = draw(st.integers(0, 6))
        ret = None if draw(st.integers(0, 5)) == 0 else call + draw(st.integers(0, 4))
        if draw(st.booleans()):
            v = draw(st.integers(1, 2))
            out.append(
                op(
                    f"c{i}",
                    f"put({k}, {v})",
                    lambda m, k=k, v=v: m.put(k, v),
                    call,
                    ret,
                    Won() if ret is not None else UNKNOWN,
                    k,
                )
            )
        else:
            seen = draw(st.sampled_from([None, 1, 2]))
            out.append(
                op(
                    f"c{i}",
                    f"get({k})",
                    lambda m, k=k: m.get(k),
                    call,
                    ret,
                    Won(seen) if ret is not None else UNKNOWN,
                    k,
                )
            )
    rows = draw(st.sets(st.tuples(st.sampled_from(["x", "y"]), st.integers(1, 2)), max_size=2))
    observed = tuple(sorted(dict(rows).items()))
    return out, observed


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_checker_agrees_with_brute_force_with_and_without_parts(case):
    history, observed = case
    expected = _oracle(history, Registers(), observed)
    whole = check(history, Registers(), final=FinalState(observed, _rows))
    parts = check(
        history, Registers(), final=FinalState(observed, _rows, _split), partition=lambda o: o.key
    )
    assert whole.ok is expected
    assert parts.ok is expected
    if expected:
        assert _rows(whole.final_states[0]) == observed


@settings(max_examples=300, deadline=None)
@given(histories())
def test_every_end_gives_the_end_state_of_every_order_that_explains_the_history(case):
    """With ``every_end``, the states a check goes on from are those of every order, not only the
    first found: two puts that overlap may have ended either way, and the rows alone (here,
    none) need not tell which."""
    history, _ = case
    expected = {_rows(m) for m in _ends(history, Registers())}
    verdict = check(history, Registers(), every_end=True)
    assert verdict.ok is bool(expected)
    assert {_rows(m) for m in verdict.final_states} == expected


def test_without_every_end_only_the_first_orders_end_states_are_kept():
    racing = [put("a", "x", 1, 0, 5), put("b", "x", 2, 1, 4)]
    assert len(check(racing, Registers()).final_states) == 1
    ends = check(racing, Registers(), every_end=True).final_states
    assert sorted(_rows(m) for m in ends) == [(("x", 1),), (("x", 2),)]


# ---------------------------------------------------------------------------------------
# Fingerprints, the budget, a long history.
# ---------------------------------------------------------------------------------------


def test_fingerprints_ignore_the_transition_log_and_see_every_other_attribute():
    a, b = Registers(), Registers()
    a.put("x", 1)
    b.transitions.append("something else")
    b.values["x"] = 1
    assert lin.default_fingerprint(a) == lin.default_fingerprint(b)
    b.values["y"] = 0
    assert lin.default_fingerprint(a) != lin.default_fingerprint(b)


def test_a_search_out_of_time_is_undecided_not_a_verdict():
    history, initial, final = figure.outbox_history(200, 3, seed=1)
    verdict = check(history, initial, final=final, budget_s=0)
    assert verdict.ok is None and not verdict
    assert verdict.explain()[0].startswith("undecided")


def test_a_thousand_operation_history_is_linearizable_and_one_wrong_outcome_is_found():
    history, initial, final = figure.outbox_history(1000, 3, seed=0)
    fp = lambda m: (m.now, m.state(), m._next_id)  # noqa: E731
    verdict = check(history, initial, final=final, fingerprint=fp, copy=figure._outbox_copy)
    assert verdict.ok and len(verdict.order) == len(history)
    k = next(
        i
        for i, o in enumerate(history)
        if i > 500 and o.label.startswith("complete") and o.output == Won("sent")
    )
    history[k] = dataclasses.replace(history[k], output=LostRace("fenced"))
    verdict = check(history, initial, final=final, fingerprint=fp, copy=figure._outbox_copy)
    assert verdict.ok is False
    assert any(o is history[k] for o, _ in verdict.next_refused)


def test_bench_reports_a_figure():
    result = figure.bench(n_ops=100, clients=2, seed=0)
    assert result.ok and result.operations == 100
    assert "100 operations" in result.report()
