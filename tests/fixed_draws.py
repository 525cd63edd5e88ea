"""Stands in for Hypothesis's ``data`` where a schedule is a function of its draws."""

from __future__ import annotations


class FixedDraws:
    """Each draw takes the next of fixed values, whatever the strategy."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)
