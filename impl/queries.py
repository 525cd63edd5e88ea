"""Named SQL queries, loaded from the ``.sql`` files beside this module.

A query file holds short queries, each under a header line ``-- name --`` followed by
comment lines that say what it does and why its guard is there::

    -- claim_due --
    -- Claim up to %(batch)s due deliveries; SKIP LOCKED so two workers never wait on each other.
    UPDATE ...
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_HEADER = re.compile(r"^-- ([a-z_0-9]+) --$", re.M)


@cache
def load(filename: str) -> dict[str, str]:
    return parse(resources.files("knownstate.impl").joinpath("sql", filename).read_text(), filename)


def parse(text: str, filename: str = "<queries>") -> dict[str, str]:
    """The named queries in ``text`` (a run kind of a user's own keeps its SQL this way too)."""
    parts = _HEADER.split(text)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        if name in out:
            raise ValueError(f"{filename}: query {name!r} defined twice")
        out[name] = body.strip()
    return out


def schema(filename: str) -> str:
    return resources.files("knownstate.impl").joinpath("sql", filename).read_text()
