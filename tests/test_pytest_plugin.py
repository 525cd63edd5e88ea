"""knownstate's pytest plugin and ``knownstate init-kind``, as a user meets them: a scaffolded
kind's package whose tests pass in a pytest run of its own, and the plugin's fixtures — a fresh
database, the database clock, the application clock, Toxiproxy, ``check_run_kind`` failing a
test with the gate's report — used from a user's test file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest

from knownstate.chaos.cli import main

pytestmark = pytest.mark.slow

FIXTURES = textwrap.dedent("""
    import psycopg
    import pytest

    from knownstate.chaos.generic import kind
    from demo_queue_kind import binding


    def test_a_fresh_database_the_clocks_and_toxiproxy(knownstate_db, knownstate_db_clock,
                                                       knownstate_app_clock, knownstate_toxiproxy):
        dsn = knownstate_db("CREATE TABLE t (x int)")
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("select count(*) from t").fetchone() == (0,)
            before = conn.execute("select now()").fetchone()[0]
            knownstate_db_clock.jump(3600)
            after = conn.execute("select now()").fetchone()[0]
        assert (after - before).total_seconds() >= 3599
        start = knownstate_app_clock.now()
        knownstate_app_clock.advance(90)
        assert (knownstate_app_clock.now() - start).total_seconds() == 90
        assert knownstate_toxiproxy.client().version()


    class Unfenced(binding.DemoQueueAdapter):
        queries = {k: q.replace(" AND attempts = %(attempt)s", "")
                   for k, q in binding.DemoQueueAdapter.queries.items()}
        guards = {}


    UnfencedKind = kind(binding.DESCRIPTION.model_copy(update={"name": "demo-unfenced"}),
                        Unfenced)


    def test_check_run_kind_fails_the_test_with_the_gates_report(check_run_kind):
        with pytest.raises(pytest.fail.Exception) as failed:
            check_run_kind(UnfencedKind, shrinks=0)  # the report of a failure, not its shrink
        report = str(failed.value)
        assert "demo-unfenced: FAILED" in report and "lease-fence" in report, report
        assert "replay: knownstate verify --kind test_fixtures:UnfencedKind" in report, report
""")


def test_init_kind_scaffolds_a_package_whose_tests_pass_and_the_fixtures_work(tmp_path):
    assert main(["init-kind", "demo-queue", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "demo-queue"
    assert (root / "demo_queue_kind" / "binding.py").exists()
    (root / "tests" / "test_fixtures.py").write_text(FIXTURES)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--knownstate-seed", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0 and "4 passed" in run.stdout, run.stdout[-4000:] + run.stderr
    # progress reaches the terminal while pytest captures the test's output
    assert "demo-queue seed 1: " in run.stdout and "still to observe" in run.stdout, run.stdout


def test_the_scaffolds_mutant_test_passes_for_a_library_with_no_named_sql(tmp_path):
    """A library runs SQL of its own: its adapter names no queries, so the gate derives no
    mutant from its SQL. Behind a fence on the claim's attempt it derives one of its own (a
    stale write carrying the newest claim's token), so the scaffold's test of the fence runs,
    and passes, for a library too (issue 20, item 10: it skipped)."""
    assert main(["init-kind", "lib-queue", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "lib-queue"
    binding = root / "lib_queue_kind" / "binding.py"
    named = re.compile(r"    queries = queue\.QUERIES.*?\n    guards = \{.*?\}\n", re.S)
    text, n = named.subn("", binding.read_text())  # no named SQL, no guard in it: a library's
    assert n == 1
    own = "queue.Jobs(conn, config, queue.QUERIES)"  # the SQL it runs is its own
    text = text.replace("queue.Jobs(conn, config, self.queries)", own)
    assert own in text
    binding.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "fence"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "1 passed" in run.stdout, out[-4000:]


def test_init_kind_refuses_a_bad_name_or_an_existing_folder(tmp_path, capsys):
    assert main(["init-kind", "Bad_Name", "--dir", str(tmp_path)]) == 2
    assert "lower-case letters, digits and dashes" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert main(["init-kind", "taken", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err


NORMAL_USER_TEST = textwrap.dedent("""
    import psycopg


    def test_a_fresh_database_for_a_user_who_may_not_create_databases(knownstate_db):
        dsn = knownstate_db("CREATE TABLE t (x int)")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("insert into t values (1)")
            assert conn.execute("select count(*) from t").fetchone() == (1,)
            assert conn.execute("select current_user").fetchone() == ("ks_plain",)
""")


def test_the_database_fixture_works_for_a_user_who_may_not_create_databases(
    knownstate_cluster, tmp_path
):
    """The README's recommended set-up: a normal user with CONNECT and CREATE on one database,
    as --dsn needs. knownstate_db gives each test a schema of its own there, and drops it."""
    with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
        admin.execute("drop database if exists ks_plain_app with (force)")
        admin.execute("drop role if exists ks_plain")
        admin.execute("create role ks_plain login nocreatedb")
        admin.execute("create database ks_plain_app")
        admin.execute("grant create on database ks_plain_app to ks_plain")
    try:
        (tmp_path / "test_normal_user.py").write_text(NORMAL_USER_TEST)
        dsn = f"host=127.0.0.1 port={knownstate_cluster.port} user=ks_plain dbname=ks_plain_app"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            + ["--knownstate-dsn", dsn, "test_normal_user.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr
        with psycopg.connect(knownstate_cluster.dsn("ks_plain_app"), autocommit=True) as conn:
            left = conn.execute("select nspname from pg_namespace where nspname like 'ks_%'")
            assert left.fetchall() == []
    finally:
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
            admin.execute("drop database if exists ks_plain_app with (force)")
            admin.execute("drop role if exists ks_plain")


def test_a_malformed_knownstate_dsn_is_a_usage_error_naming_it(tmp_path):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["--knownstate-dsn", "host=db password=Hidden-1 junk", "test_nothing.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 4, run.stdout + run.stderr
    assert "--knownstate-dsn: not a DSN" in run.stderr and "Hidden-1" not in run.stderr


def test_this_suite_loads_the_plugin_once(pytestconfig):
    """tests/conftest.py names the plugin (``pytest_plugins``) that its entry point also loads:
    it is registered once, under the entry point's name."""
    from knownstate.chaos import pytest_plugin

    plugins = pytestconfig.pluginmanager.list_name_plugin()
    assert [name for name, p in plugins if p is pytest_plugin] == ["knownstate"]


def test_the_clock_fixture_starts_at_true_time_and_running_after_a_check_left_it_held(
    knownstate_cluster, request, monkeypatch
):
    """A check holds the database clock after its last step, a week back. A test after it on the
    same server that read ``now()`` and then held the clock itself would, at its first release,
    take back all the real time since the check's hold: its stamps came out minutes before its
    start (heartbeat_at=-177 where the model said 7)."""
    from knownstate.chaos import cluster

    clock = knownstate_cluster.clock
    if clock is None:
        pytest.skip("the database clock can move only on the throwaway cluster with libfaketime")
    monkeypatch.setattr(cluster, "HOLD_GRAIN", 0.0)  # every hold taken back, however short
    clock.reset(-7 * 86_400)
    clock.hold()  # what a check's last step leaves
    start = time.monotonic()
    while time.monotonic() == start:
        pass  # real time passes while it is held
    given = request.getfixturevalue("knownstate_db_clock")
    given.release()
    assert (given.offset, given.held_total) == (0, 0)


def test_the_heavy_files_this_suite_starts_first_are_its_files():
    """A file renamed or removed would silently lose its place in the order (conftest.HEAVY)."""
    from conftest import HEAVY

    here = Path(__file__).resolve().parent
    assert HEAVY and all((here / name).is_file() for name in HEAVY), sorted(HEAVY)


def test_this_suite_loads_the_plugin_with_plugin_autoloading_off():
    here = "tests/test_pytest_plugin.py::test_this_suite_loads_the_plugin_once"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", here],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:] + run.stderr
