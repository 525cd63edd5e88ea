"""Row draws that mean the same row whatever came before (chaos/rows.py): pure, no parts."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.internal.conjecture.data import ConjectureData

from knownstate.chaos import rows


def replay(*choices):
    """A draw source that answers ``choices`` in order, as a replayed example does."""
    return ConjectureData.for_choices(list(choices))


def test_a_pick_survives_removing_any_option_not_picked():
    # shrinking deletes a step that made another run drawable: the same number still names the
    # run it named (drawn as a place in the list, 3 of these 4 picks moved to another run)
    options = ["run 1", "run 2", "run 3", "run 4", "run 5"]
    for n in range(500):
        picked = rows.rank(n, options, str)[0]
        for gone in options:
            if gone != picked:
                rest = [o for o in options if o != gone]
                assert rows.rank(n, rest, str)[0] == picked, (n, gone)


def test_a_draw_reads_the_same_bytes_however_many_options():
    # a list of one option drew nothing (st.sampled_from), which moved every later draw of the
    # example onto other bytes: the draw after it must read the same value either way
    for options in (["only"], ["a", "b"], ["a", "b", "c", "d"]):
        data = replay(12345, 7)
        rows.row(data, options, "row")
        assert data.draw(st.integers(0, 10)) == 7


def test_each_option_as_likely_and_a_repeated_one_as_often_as_it_is_repeated():
    counts = Counter(rows.rank(n, ["a", "b", "c"], str)[0] for n in range(3000))
    assert all(850 < counts[o] < 1150 for o in "abc"), counts
    # a run listed twice (the queued runs a start prefers) is drawn twice as often
    counts = Counter(rows.rank(n, [1, 2, 2], repr)[0] for n in range(3000))
    assert 1800 < counts[2] < 2200, counts
    weighted = Counter(
        rows.rank(n, ["x", "y"], str, lambda o: 2 if o == "x" else 1)[0] for n in range(3000)
    )
    assert 1800 < weighted["x"] < 2200, weighted


def test_a_preferred_class_two_times_in_three_and_an_empty_one_skipped():
    got = Counter()
    for k in range(300):
        got[rows.one_of_classes(replay(k, k * 7919), (["win"], ["win"], ["lose"]), "p")] += 1
    assert got == {"win": 200, "lose": 100}
    assert rows.one_of_classes(replay(2, 0), (["win"], ["win"], []), "p") == "win"


def test_several_rows_keep_their_order_and_their_count_in_range():
    for k in range(20):
        picked = rows.rows(replay(k, 99), ["w0", "w1", "w2"], 2, 3, "who", name=str)
        assert 2 <= len(picked) <= 3
        assert picked == sorted(picked)
    assert rows.rows(replay(1, 5), ["w0", "w1"], 2, 3, "who", name=str) == ["w0", "w1"]
