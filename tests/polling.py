"""Waiting for state in tests: poll a predicate until it holds, with a deadline that is a
backstop (a loaded machine only makes the wait longer), never a sleep standing in for a state."""

from __future__ import annotations

import time


def poll(what: str, predicate, deadline_s: float = 30.0):
    """The predicate's first truthy value; AssertionError naming ``what`` after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)  # the poll's interval, not a wait for state
    raise AssertionError(f"timed out after {deadline_s:.0f}s waiting until {what}")
