"""Profiles the suite's checks run under, beside the gate's own (``knownstate.chaos.runner``)."""

from __future__ import annotations

from dataclasses import replace

from knownstate.chaos.runner import PROFILES

ONCE = replace(PROFILES["ci"], name="once", min_examples=1, times_each=1)
"""The CI profile, every requirement observed once: a reference's pass in this suite, each
event a test asserts being one of the kind's requirements. ``knownstate verify`` (``make
verify``) runs the CI profile, three times each; a third as many examples reach every one."""
