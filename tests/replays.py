"""Two runs at one seed: the same traces, example by example. A difference names the first
example that ran differently and shows it as a diff (a whole list, truncated by pytest, hid
where branch-reset's seed 11 differed under load)."""

from __future__ import annotations

import difflib


def assert_same_traces(first: list[list[str]], again: list[list[str]]) -> None:
    assert first, "the first run traced no example"
    for i, (a, b) in enumerate(zip(first, again)):
        diff = "\n".join(difflib.unified_diff(a, b, "first", "again", lineterm=""))
        assert a == b, f"example {i} ran differently at the same seed:\n{diff}"
    assert len(first) == len(again), f"{len(first)} examples, then {len(again)}"
