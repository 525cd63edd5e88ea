"""Fixtures, in the manner of psycopg's test suite: real servers, started once per session, reset
between tests, nothing left running afterwards; each fixture defined once.

The real parts are knownstate's own pytest plugin's (``chaos/pytest_plugin.py``, documented in
``docs/pytest.md``), the fixtures a user's suite gets: ``knownstate_cluster`` (a throwaway
PostgreSQL under libfaketime), ``knownstate_toxiproxy`` (the Toxiproxy server),
``knownstate_env`` (the real parts of a verify run, on those two), ``knownstate_db`` (a factory
``knownstate_db(schema_sql) -> dsn`` of empty databases), ``knownstate_db_clock`` (the
database's clock, at true time when the test starts and after it). Here only what this suite
alone needs:

- ``toxiproxy``: the Toxiproxy client; every proxy healed after each test.

And the order the files start in (:data:`HEAVY`).
"""

from __future__ import annotations

import pytest

# The plugin by its entry point's name (pyproject.toml, ``pytest11``): when pytest has already
# loaded it from the entry point this is a no-op, and with plugin autoloading off pytest loads
# it from the entry point here. Either way it is registered once.
pytest_plugins = ("knownstate",)

HEAVY = {
    "test_example_webhook.py": 466,
    "test_example_queues.py": 356,
    "test_check_document_session.py": 183,
    "test_environment.py": 166,
    "test_cli.py": 118,
    "test_browser_check.py": 109,
    "test_check_branch_reset.py": 86,
    "test_generic_check.py": 82,
    "test_check_outbox.py": 80,
    "test_pytest_plugin.py": 67,
    "test_check_approved_plan.py": 64,
    "test_race_mutants.py": 62,
    "test_hostile.py": 51,
    "test_any_database.py": 50,
    "test_bench.py": 41,
    "test_soak.py": 41,
}
"""The suite's heaviest files, in seconds of one worker (the sum of a file's lines in ``make
test`` with ``--durations=0``, idle 2-core machine, three workers, 2026-12-06): they start
first, the heaviest first, so no worker begins a long file while the others run out of work
(longest processing time first). xdist's own order (``--loadscope-reorder``, off in the
Makefile) puts the files with most tests first, and these have few long ones: they came last,
and one worker ran on about 110 s after the others (the same figures, scheduled: 872 s against
775 s). An order only: a file not named runs after these, in collection order, and no test
depends on it; stale figures cost minutes, never a verdict."""


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(sorted(HEAVY, key=HEAVY.__getitem__, reverse=True))}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's order


@pytest.fixture
def toxiproxy(knownstate_toxiproxy):
    api = knownstate_toxiproxy.client()
    yield api
    if knownstate_toxiproxy.running:
        api.reset()
