"""The reset between examples (``Workspace.truncate``) on real PostgreSQL: it leaves what
``truncate ... restart identity cascade`` leaves — every table empty, the sequences the tables
own back to their start, any other sequence where it was — by DELETE (children before their
parents) where that does no more than TRUNCATE would, and by TRUNCATE once in
``TRUNCATE_EVERY`` resets and wherever DELETE could do more (a user trigger, a cycle of
foreign keys). Which one ran is read from the server: TRUNCATE gives a table a new file
(``pg_class.relfilenode``), DELETE does not.
"""

from __future__ import annotations

import pytest

from knownstate.chaos import workspace
from knownstate.chaos.check import Env
from knownstate.chaos.toxi import ToxiproxyServer

SCHEMA = """
create table parent (id bigint generated always as identity primary key, note text);
create table child (id serial primary key, parent_id bigint not null references parent (id));
create table solo (k text primary key);
create sequence free_counter;
"""


@pytest.fixture
def env(knownstate_cluster):
    """An Env of its own on the session's PostgreSQL, with a Toxiproxy server of its own."""
    with ToxiproxyServer() as toxiproxy:
        env = Env(knownstate_cluster, toxiproxy)
        yield env
        env.close()


def _fill(ws) -> None:
    ws.query("insert into parent (note) values ('a'), ('b')")
    ws.query("insert into child (parent_id) values (1), (2), (2)")
    ws.query("insert into solo values ('x')")
    ws.query("select nextval('free_counter'), nextval('free_counter')")


def _files(ws) -> dict[str, int]:
    return dict(
        ws.query(
            "select c.relname, c.relfilenode from pg_class c join pg_namespace n "
            "on n.oid = c.relnamespace where n.nspname = %s and c.relkind = 'r'",
            (ws.name,),
        )
    )


def test_the_reset_leaves_what_truncate_restart_identity_leaves(env, monkeypatch):
    monkeypatch.setattr(workspace, "TRUNCATE_EVERY", 3)
    ws = env.workspace("reset-check", SCHEMA)
    assert ws.clear_sql is not None  # the cheap path applies to this schema
    for reset in (1, 2, 3):
        _fill(ws)
        files = _files(ws)
        ws.truncate()
        for table in ("parent", "child", "solo"):
            assert ws.query(f"select count(*) from {table}") == [(0,)], (reset, table)
        # the owned sequences restart, as RESTART IDENTITY does; a free one goes on
        assert ws.query("insert into parent (note) values ('c') returning id") == [(1,)]
        assert ws.query("insert into child (parent_id) values (1) returning id") == [(1,)]
        assert ws.query("select nextval('free_counter')") == [(3 * reset,)]
        ws.query("delete from child; delete from parent")
        ws.query("select setval('parent_id_seq', 1, false), setval('child_id_seq', 1, false)")
        # DELETE keeps each table's file; the third reset is a TRUNCATE, which gives new ones
        assert (_files(ws) == files) == (reset != 3), reset
    ws.drop()


@pytest.mark.parametrize(
    "extra",
    [
        "create function note() returns trigger language plpgsql as "
        "$$ begin insert into solo values (old.note); return old; end $$; "
        "create trigger noted before delete on parent for each row execute function note();",
        "alter table parent add column child_id int references child (id);",  # a cycle
    ],
    ids=["a user trigger", "a cycle of foreign keys"],
)
def test_where_delete_could_do_more_the_reset_is_a_truncate(env, extra):
    ws = env.workspace("reset-check", SCHEMA + extra)
    assert ws.clear_sql is None
    _fill(ws)
    files = _files(ws)
    ws.truncate()
    assert ws.query("select count(*) from parent") == ws.query("select count(*) from solo")
    assert ws.query("select count(*) from solo") == [(0,)]
    assert _files(ws) != files
    ws.drop()
