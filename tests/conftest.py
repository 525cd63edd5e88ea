"""Fixtures, in the manner of psycopg's test suite: real servers, started once per session, reset
between tests, nothing left running afterwards; each fixture defined once.

The real parts are knownstate's own pytest plugin's (``chaos/pytest_plugin.py``, documented in
``docs/pytest.md``), the fixtures a user's suite gets: ``knownstate_cluster`` (a throwaway
PostgreSQL under libfaketime), ``knownstate_toxiproxy`` (the Toxiproxy server),
``knownstate_env`` (the real parts of a verify run, on those two), ``knownstate_db`` (a factory
``knownstate_db(schema_sql) -> dsn`` of empty databases), ``knownstate_db_clock`` (the
database's clock, back to true time after the test). Here only what this suite alone needs:

- ``toxiproxy``: the Toxiproxy client; every proxy healed after each test.
"""

from __future__ import annotations

import pytest

# The plugin by its entry point's name (pyproject.toml, ``pytest11``): when pytest has already
# loaded it from the entry point this is a no-op, and with plugin autoloading off pytest loads
# it from the entry point here. Either way it is registered once.
pytest_plugins = ("knownstate",)


@pytest.fixture
def toxiproxy(knownstate_toxiproxy):
    api = knownstate_toxiproxy.client()
    yield api
    if knownstate_toxiproxy.running:
        api.reset()
