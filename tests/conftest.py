"""Shared fixtures, in the manner of psycopg's test suite: real servers, started once per
session, reset between tests, nothing left running afterwards.

- ``pg``: a throwaway PostgreSQL cluster (under libfaketime) for the whole session.
- ``toxiproxy``: the real Toxiproxy server and its wrapped client; reset after each test.
- ``fresh_db``: a factory ``fresh_db(schema_sql) -> dsn`` giving an empty database of its own.
- ``check_env``: the real parts of a verify run (``knownstate.chaos.check.Env``), started once for
  every stateful check in the session.
"""

from __future__ import annotations

import itertools

import psycopg
import pytest

from knownstate.chaos.cluster import PostgresCluster
from knownstate.chaos.toxi import ToxiproxyServer

_db_names = itertools.count()


@pytest.fixture(scope="session")
def pg():
    with PostgresCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def check_env():
    from knownstate.chaos.check import Env

    with Env.open() as env:
        yield env


@pytest.fixture(scope="session")
def toxiproxy_server():
    with ToxiproxyServer() as server:
        yield server


@pytest.fixture
def toxiproxy(toxiproxy_server):
    api = toxiproxy_server.client()
    yield api
    if toxiproxy_server.running:
        api.reset()


@pytest.fixture
def fresh_db(pg):
    """Create an empty database, optionally with a schema applied; returns its DSN."""
    created = []

    def make(schema_sql: str | None = None) -> str:
        name = f"t{next(_db_names)}"
        with psycopg.connect(pg.dsn(), autocommit=True) as admin:
            admin.execute(f"create database {name}")
        created.append(name)
        dsn = pg.dsn(name)
        if schema_sql:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(schema_sql)
        return dsn

    yield make
    if pg.running:
        with psycopg.connect(pg.dsn(), autocommit=True) as admin:
            for name in created:
                admin.execute(f"drop database if exists {name} with (force)")
    if pg.clock:
        pg.clock.reset()
