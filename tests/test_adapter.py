"""What every adapter meets (``knownstate.chaos.adapter``), and how kinds are found
(``knownstate.chaos.kinds``).

Lost-race signals and wrapped driver errors are recognised as a library gives them; rows read
back from a log table fill in for deleted ones; every COMMIT on a worker's connection — sync or
async, ``commit()`` or the end of a ``transaction()`` block — meets the armed fault, on a real
PostgreSQL; a kind is found through the entry point group or ``--kind``, and one that cannot be
found is one line saying what to do.
"""

from __future__ import annotations

import asyncio
import textwrap

import psycopg
import pytest

from knownstate.chaos import kinds
from knownstate.chaos.adapter import (
    AsyncTxConnection,
    LostRaceSignals,
    Row,
    TxConnection,
    merge_log,
    unwrap,
)
from knownstate.chaos.cli import main
from knownstate.model.contract import LostRace, Won


class LibraryError(Exception):
    """A queue library's own error, wrapping the driver's."""


class NotOwner(Exception):
    """A queue library's way to say a write matched nothing."""


def test_lost_race_signals_as_libraries_give_them():
    signals = LostRaceSignals(errors=(NotOwner,), sqlstates=("P0001",), messages=("not yours",))
    for lost in (None, False, 0, [], (), "UPDATE 0", "INSERT 0 0", LostRace("fenced")):
        assert signals.returned(lost), lost
    for won in (1, True, [("k",)], "UPDATE 1", Won(), "delivered", 7):
        assert not signals.returned(won), won
    assert signals.raised(NotOwner())
    assert signals.raised(Exception("job 3 is not yours any more"))
    assert not signals.raised(Exception("something else"))
    strict = LostRaceSignals(values=(), empty=False)
    assert not strict.returned(None) and not strict.returned(0) and strict.returned("UPDATE 0")


def test_a_plpgsql_raise_wrapped_by_a_library_is_a_lost_race(knownstate_cluster):
    """A function that RAISEs (SQLSTATE P0001) when the caller lost the run, the driver's error
    wrapped in the library's own: unwrapped, recognised by its SQLSTATE."""
    signals = LostRaceSignals(sqlstates=("P0001",))
    with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
        try:
            try:
                conn.execute("DO $$ BEGIN RAISE EXCEPTION 'fenced'; END $$")
            except psycopg.Error as e:
                raise LibraryError("could not complete job") from e
        except LibraryError as wrapped:
            assert isinstance(unwrap(wrapped), psycopg.errors.RaiseException)
            assert signals.raised(wrapped)
            assert not LostRaceSignals().raised(wrapped)


def test_a_queue_that_deletes_finished_rows_reads_them_back_from_its_log():
    live = [Row("2", "running", 1), {"key": 3, "status": "pending"}]
    log = [
        {"key": "1", "status": "running"},
        {"key": "1", "status": "done"},
        {"key": "2", "status": "pending"},
    ]
    got = {r.key: r.status for r in merge_log(live, log)}
    assert got == {"1": "done", "2": "running", "3": "pending"}


class _Owner:
    """What a worker is to its connection: the fault armed for its next COMMIT, and the
    statements a mutant's edits changed."""

    def __init__(self):
        self.before_commit = None
        self.seen: list[str] = []
        self.edited = 0

    def arm(self, what: str) -> None:
        self.before_commit = lambda conn: self.seen.append(what)


def test_every_commit_of_a_sync_connection_meets_the_armed_fault(knownstate_cluster):
    with TxConnection.connect(knownstate_cluster.dsn()) as conn:
        owner = conn.owner = _Owner()
        owner.arm("transaction block")
        with conn.transaction():
            conn.execute("select 1")
        owner.arm("commit()")
        conn.execute("select 1")
        conn.commit()
        assert owner.seen == ["transaction block", "commit()"] and not conn.in_commit


def test_every_commit_of_an_async_connection_meets_the_armed_fault(knownstate_cluster):
    async def run() -> list[str]:
        conn = await AsyncTxConnection.connect(knownstate_cluster.dsn())
        try:
            owner = conn.owner = _Owner()
            owner.arm("async transaction block")
            async with conn.transaction():
                await conn.execute("select 1")
            owner.arm("await commit()")
            await conn.execute("select 1")
            await conn.commit()
            return owner.seen
        finally:
            await conn.close()

    assert asyncio.run(run()) == ["async transaction block", "await commit()"]


def _rows_seen_from_outside(dsn: str, seen: list) -> None:
    with psycopg.connect(dsn, autocommit=True) as other:
        seen.append(other.execute("SELECT count(*) FROM stamped").fetchone()[0])


def test_in_autocommit_the_armed_fault_meets_the_next_statement_before_it_leaves(
    knownstate_cluster,
):
    """A library that insists on autocommit sends no COMMIT: each statement commits on its own,
    so the fault meets the next one, before the server has it (nothing of it committed yet);
    not a setting, not a BEGIN, and inside a transaction block its COMMIT, as before."""
    dsn = knownstate_cluster.dsn()
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("DROP TABLE IF EXISTS stamped; CREATE TABLE stamped (n int)")
    seen: list = []

    def hook(conn) -> None:
        _rows_seen_from_outside(dsn, seen)

    with TxConnection.connect(dsn, autocommit=True) as conn:
        owner = conn.owner = _Owner()
        owner.before_commit = hook
        conn.autocommit = True  # a setting: no statement, the fault stays armed
        assert owner.before_commit is hook
        conn.execute("INSERT INTO stamped VALUES (1)")
        assert seen == [0] and owner.before_commit is None  # met before the INSERT, once
        conn.execute("INSERT INTO stamped VALUES (2)")
        owner.before_commit = hook
        with conn.transaction():  # a block in autocommit: BEGIN ... COMMIT
            conn.execute("INSERT INTO stamped VALUES (3)")
            assert owner.before_commit is hook  # not at BEGIN, not at the statement
        assert seen == [0, 2]  # at its COMMIT, the block's row not yet visible

    async def run() -> None:
        conn = await AsyncTxConnection.connect(dsn, autocommit=True)
        try:
            owner = conn.owner = _Owner()
            owner.before_commit = hook
            await conn.execute("INSERT INTO stamped VALUES (4)")
            assert owner.before_commit is None
        finally:
            await conn.close()

    asyncio.run(run())
    assert seen == [0, 2, 3]


def test_a_statement_in_autocommit_whose_answer_never_comes_is_indeterminate(knownstate_cluster):
    """The fault cuts the connection as the statement leaves: the driver's error is a lost
    connection, which on a connection in autocommit the gate calls indeterminate."""
    with TxConnection.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
        owner = conn.owner = _Owner()
        owner.before_commit = lambda c: c.pgconn.finish()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("select 1")
        assert conn.autocommit and owner.before_commit is None


def test_a_commit_whose_answer_never_comes_stays_in_commit(knownstate_cluster):
    """The gate reads ``in_commit`` to call a lost connection indeterminate, not lost."""
    with TxConnection.connect(knownstate_cluster.dsn()) as conn:
        owner = conn.owner = _Owner()

        def die(c):
            c.pgconn.finish()

        owner.before_commit = die
        conn.execute("select 1")
        with pytest.raises(psycopg.OperationalError):
            conn.commit()
        assert conn.in_commit


def test_a_mutants_edits_apply_to_what_its_operation_sends_and_nothing_else(knownstate_cluster):
    """A library keeps its SQL to itself: a derived mutant edits what the worker sends while it
    runs one operation (the claim), through any cursor, and leaves the rest as written; each
    statement it changed is counted on the worker, none it left as sent."""
    from knownstate.chaos.genericbuild import WIRE_GUARDS

    query = "SELECT current_query() AS q /* FOR UPDATE OF jobs SKIP LOCKED */"
    with TxConnection.connect(knownstate_cluster.dsn(), autocommit=True) as conn:
        owner = conn.owner = _Owner()
        owner.sql_edits = {"claim": tuple(edit for _, edit, _ in WIRE_GUARDS[:1])}
        owner.op = "enqueue"
        assert "SKIP LOCKED" in conn.execute(query).fetchone()[0]
        owner.op = "claim"
        assert "FOR UPDATE OF jobs */" in conn.execute(query).fetchone()[0]
        assert "FOR UPDATE OF jobs */" in psycopg.RawCursor(conn).execute(query).fetchone()[0]
        conn.execute("SELECT 1")  # sent in the claim, matched by no edit: not counted
        assert owner.edited == 2
        owner.sql_edits = {"claim": (WIRE_GUARDS[1][1],)}
        assert conn.execute(query).fetchone()[0].endswith("AS q /* */")  # the whole lock
        assert owner.edited == 3


# ---------------------------------------------------------------------------------------
# Kinds found, not forked.
# ---------------------------------------------------------------------------------------

MODULE = textwrap.dedent("""
    from knownstate.chaos.kinds.outbox import OutboxCheck

    class MyKind(OutboxCheck):
        kind = "my-outbox"

    class Other(OutboxCheck):
        kind = "other-outbox"

    NotACheck = 42
""")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A package on sys.path that registers kinds through the entry point group, as an
    installed distribution does (its dist-info read by importlib.metadata)."""
    (tmp_path / "mykinds.py").write_text(MODULE)
    info = tmp_path / "mykinds-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mykinds\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[knownstate.kinds]\nmy-outbox = mykinds:MyKind\nbroken = mykinds_missing:Thing\n"
        "misnamed = mykinds:MyKind\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    kinds._named.clear()


def test_a_kind_registered_by_an_installed_package_is_found(plugin):
    assert {"my-outbox", "broken", "misnamed"} <= set(kinds.names())
    assert kinds.check("my-outbox").kind == "my-outbox"
    assert kinds.argument("my-outbox") == "my-outbox"


@pytest.mark.parametrize(
    "name, says",
    [
        ("broken", "no module 'mykinds_missing'"),
        ("misnamed", "loads a check of kind 'my-outbox': name the entry point 'my-outbox'"),
    ],
)
def test_a_registered_kind_that_cannot_be_loaded_is_one_clear_line(plugin, name, says):
    with pytest.raises(kinds.KindNotFound) as e:
        kinds.check(name)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert "package mykinds 1.0" in str(e.value) or "no module" in str(e.value)


def test_a_kind_named_on_the_command_line_is_replayed_by_the_same_name(plugin):
    assert kinds.load("mykinds:Other") == "other-outbox"
    assert "other-outbox" in kinds.names() and kinds.check("other-outbox").kind == "other-outbox"
    assert kinds.argument("other-outbox") == "--kind mykinds:Other"
    assert kinds.load("mykinds:MyKind") == "my-outbox"  # registered already: its name suffices
    assert kinds.argument("my-outbox") == "my-outbox"


@pytest.mark.parametrize(
    "spec, says",
    [
        ("mykinds", "write it as package.module:Thing"),
        ("nowhere:Kind", "no module 'nowhere'"),
        ("mykinds:Missing", "module 'mykinds' has no 'Missing'"),
        ("mykinds:NotACheck", "is a int, not a check"),
    ],
)
def test_a_bad_kind_option_exits_2_with_one_line(plugin, capsys, spec, says):
    assert main(["verify", "--kind", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_a_bad_registered_kind_stops_the_command_before_any_server_starts(plugin, capsys):
    assert main(["verify", "broken"]) == 2
    assert "no module 'mykinds_missing'" in capsys.readouterr().err
