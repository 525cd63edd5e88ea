"""The gate under a hostile (or only unlucky) user: what a user names or has in the environment
is never replaced, leaked, hung on or misread.

- **report paths of every file type**: a regular file is written whole, keeping its mode; a
  symbolic link is followed (the link stays a link); a FIFO, a character device and a stream
  the process holds (``/dev/stdout`` through a link, ``/dev/fd/1``) are written to, never
  replaced; a path that cannot take a file (in ``/proc``, a socket, a disk) is refused before
  anything starts (exit 2); a write that fails after the run (``/dev/full``) is one line and
  exit 3, never a traceback. Device nodes are made in a temp folder (as root) so that a
  regression can only ever replace those, never the machine's ``/dev``;
- **libpq's PG* variables** reach no connection to the throwaway cluster: the verdict with
  ``PGOPTIONS``, ``PGSSLMODE`` and ``PGTZ`` set is the verdict without them;
- **secrets**: a password in ``--dsn`` is in no report, message or log line;
- **malformed input**: a DSN that does not parse and a negative seed are exit 2 with one line;
- **tool overrides** naming a missing file fail loudly, naming the variable;
- **leftovers**: after ``kill -KILL`` of a running ``verify``, the next run sweeps what the
  first left in the temp folder, and only what belongs to a dead run; what libfaketime left of a
  SIGKILLed server (shared memory named by its pid, which would stop a later server given that
  pid from starting) is gone before the next server starts, a server keeps its dynamic shared
  memory in its data directory, not in /dev/shm where a kill would leave it, and the System V
  segment a killed server leaves goes with its folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from gate_fakes import Engine, FakeEnv, machine_of, result
from polling import poll

from knownstate.chaos import cli, tools
from knownstate.chaos.leftovers import alive
from knownstate.chaos.cluster import ExternalDatabase, Refused
from knownstate.chaos.outpath import OutputError
from knownstate.chaos.report import Report, Unit, path_problem, write_reports
from knownstate.chaos.tools import MissingTool

KNOWNSTATE = [sys.executable, "-m", "knownstate.chaos.cli"]


def _doc() -> dict:
    unit = Unit(0, "outbox", 1)
    rep = Report("verify", ["knownstate", "verify"], "ci", [1], [unit], 1)
    return rep.document()


def _device(tmp_path: Path, name: str, minor: int) -> str:
    """A character device like /dev/null (minor 3) or /dev/full (minor 7): made in the temp
    folder when running as root, so that nothing a test does can replace the machine's own."""
    if not tools.running_as_root():
        return f"/dev/{name}"
    path = tmp_path / name
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    return str(path)


# ---------------------------------------------------------------------------------------
# Report paths: every file type a user can name.
# ---------------------------------------------------------------------------------------


def test_a_regular_file_is_replaced_whole_and_keeps_its_mode(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    target.chmod(0o640)
    write_reports(_doc(), str(target), None)
    assert json.loads(target.read_text())["command"] == "verify"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_symbolic_link_is_followed_and_stays_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "r.json"
    target.write_text("old")
    (tmp_path / "hop").symlink_to(target)
    link = tmp_path / "r.json"
    link.symlink_to(tmp_path / "hop")
    dangling = tmp_path / "new.xml"
    dangling.symlink_to(tmp_path / "real" / "created.xml")
    write_reports(_doc(), str(link), str(dangling))
    assert link.is_symlink() and (tmp_path / "hop").is_symlink() and dangling.is_symlink()
    assert json.loads(target.read_text())["command"] == "verify"
    assert (tmp_path / "real" / "created.xml").read_text().startswith("<?xml")
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["created.xml", "r.json"]


def test_a_fifo_is_written_to_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert path_problem(str(fifo), "JSON report") is None
    write_reports(_doc(), str(fifo), None)
    reader.join(timeout=30)
    assert not reader.is_alive(), "the FIFO's reader never saw the end of the report"
    assert json.loads(got[0])["command"] == "verify"
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_a_character_device_is_written_to_and_stays_a_device(tmp_path):
    null = _device(tmp_path, "null", 3)
    assert path_problem(null, "JSON report") is None
    write_reports(_doc(), null, null)
    assert stat.S_ISCHR(os.stat(null).st_mode)


def _write_to_stdout(path: str, stdout) -> subprocess.CompletedProcess:
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_hostile import _doc; "
        "from knownstate.chaos.report import write_reports; "
        "print('printed before the report'); "
        f"write_reports(_doc(), {path!r}, None)"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
    )


@pytest.mark.parametrize("how", ["link to /dev/stdout", "/dev/fd/1"])
def test_the_standard_output_is_written_to_in_order_through_a_pipe_or_into_a_file(tmp_path, how):
    path = "/dev/fd/1"
    if how == "link to /dev/stdout":
        path = str(tmp_path / "out.json")
        os.symlink("/dev/stdout", path)
    piped = _write_to_stdout(path, subprocess.PIPE)
    assert piped.returncode == 0, piped.stderr
    head, _, rest = piped.stdout.partition("\n")
    assert head == "printed before the report"
    assert json.loads(rest)["command"] == "verify"
    into = tmp_path / "captured.txt"
    with open(into, "w") as f:
        redirected = _write_to_stdout(path, f)
    assert redirected.returncode == 0, redirected.stderr
    head, _, rest = into.read_text().partition("\n")
    assert head == "printed before the report" and json.loads(rest)["command"] == "verify"
    if how == "link to /dev/stdout":
        assert os.readlink(path) == "/dev/stdout"


@pytest.fixture
def gate(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(cli, "Env", FakeEnv)
    monkeypatch.setattr(cli, "_machine", machine_of)

    def run(argv: list[str]):
        engine = Engine(lambda kind, mutant, seed, state: result(kind, seed))
        monkeypatch.setattr(cli, "run_check", engine)
        return cli.main(argv), engine

    return run


def test_a_path_that_takes_no_file_is_exit_2_before_anything_starts(gate, tmp_path, capsys):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.sock"))
    try:
        for flag, path, words in [
            ("--junit", "/proc/knownstate-report.xml", "no file can be created"),
            ("--json", str(tmp_path / "s.sock"), "is a socket"),
            ("--json", str(tmp_path), "is a directory"),
        ]:
            code, engine = gate(["verify", "outbox", "--seed", "1", flag, path])
            err = capsys.readouterr().err
            assert code == 2 and words in err, err
            assert len(err.strip().splitlines()) == 1 and not engine.calls, err
    finally:
        sock.close()
    assert not os.path.exists("/proc/knownstate-report.xml")


def test_a_report_that_cannot_be_written_after_the_run_is_one_line_and_exit_3(
    gate, tmp_path, capsys
):
    full = _device(tmp_path, "full", 7)
    good = tmp_path / "r.xml"
    code, engine = gate(["verify", "outbox", "--seed", "1", "--json", full, "--junit", str(good)])
    captured = capsys.readouterr()
    assert code == 3 and engine.calls, captured.err
    assert f"cannot write the JSON report to {full}" in captured.err
    assert "Traceback" not in captured.err
    assert good.read_text().startswith("<?xml"), "the other report is still written"
    assert stat.S_ISCHR(os.stat(full).st_mode)
    with pytest.raises(OutputError, match="No space left"):
        write_reports(_doc(), full, None)


# ---------------------------------------------------------------------------------------
# libpq's PG* variables: never on the throwaway cluster; named when they break a --dsn.
# ---------------------------------------------------------------------------------------

HOSTILE_ENV = {
    "PGOPTIONS": "-c statement_timeout=1",
    "PGSSLMODE": "require",
    "PGAPPNAME": "hostile",
    "PGHOSTADDR": "192.0.2.1",
    "PGTARGETSESSIONATTRS": "read-only",
    "PGREQUIREAUTH": "password",
    "PGCHANNELBINDING": "require",
    "PGGSSENCMODE": "require",
    "PGCLIENTENCODING": "LATIN1",
    "PGCONNECT_TIMEOUT": "1",
}


def test_the_throwaway_clusters_connections_read_no_pg_variable(knownstate_cluster, monkeypatch):
    for name, value in HOSTILE_ENV.items():
        monkeypatch.setenv(name, value)
    with psycopg.connect(knownstate_cluster.dsn(), connect_timeout=10) as conn:
        settings = conn.execute(
            "select current_setting('statement_timeout'), current_setting('client_encoding'), "
            "current_setting('application_name'), inet_server_addr()::text"
        ).fetchone()
    assert settings == ("0", "UTF8", "", "127.0.0.1/32")


def test_a_dsn_refused_because_of_a_pg_variable_names_it_at_once(knownstate_cluster, monkeypatch):
    monkeypatch.setenv("PGSSLMODE", "require")
    plain = f"host=127.0.0.1 port={knownstate_cluster.port} user=postgres dbname=postgres"
    with pytest.raises(Refused, match="PGSSLMODE=require") as refused:
        ExternalDatabase(plain).preflight(deadline_s=60)
    assert "SSL" in str(refused.value) and len(str(refused.value).splitlines()) == 1


@pytest.mark.slow
def test_the_gates_verdict_is_the_same_with_and_without_pg_variables(tmp_path):
    """The acceptance of issue 18: PGOPTIONS, PGSSLMODE and PGTZ (and PGDATESTYLE, which no DSN
    can override) change nothing on the throwaway cluster."""
    argv = ["verify", "outbox", "--seed", "1", "--examples", "3", "--no-example-db"]
    runs = {}
    for name, extra in [
        ("plain", {}),
        ("hostile", {**HOSTILE_ENV, "PGTZ": "Asia/Tokyo", "PGDATESTYLE": "SQL, DMY"}),
    ]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        out = subprocess.run(
            [*KNOWNSTATE, *argv, "--json", str(tmp_path / f"{name}.json")],
            capture_output=True,
            text=True,
            timeout=600,
            env={**env, "CI": "true", **extra},
            cwd=tmp_path,
        )
        doc = json.loads((tmp_path / f"{name}.json").read_text())
        runs[name] = (
            out.returncode,
            doc["outcome"],
            [(r["kind"], r["status"], r["failure"], r["invariants"]) for r in doc["runs"]],
        )
        if extra:
            assert "PGOPTIONS" in out.stderr and "ignored" in out.stderr, out.stderr
    assert runs["hostile"] == runs["plain"]
    assert runs["plain"][0] in (0, 1) and runs["plain"][2][0][2] is None, runs


# ---------------------------------------------------------------------------------------
# Secrets and malformed input.
# ---------------------------------------------------------------------------------------

SECRET = "s3cret-Pw"


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://runner:{SECRET}@127.0.0.1:1/app",
        f"host=127.0.0.1 port=1 user=runner password={SECRET} dbname=app",
        f"postgresql://runner@127.0.0.1:1/app?password={SECRET}",
    ],
)
def test_a_password_in_the_dsn_is_in_no_report_or_line_printed(gate, tmp_path, capsys, dsn):
    argv = ["verify", "outbox", "--seed", "1", "--dsn", dsn, "--json", "r.json", "--junit", "r.xml"]
    code, engine = gate(argv)
    out = capsys.readouterr()
    assert code == 0 and engine.calls
    written = (tmp_path / "r.json").read_text() + (tmp_path / "r.xml").read_text()
    assert SECRET not in out.out + out.err + written
    doc = json.loads((tmp_path / "r.json").read_text())
    assert "--dsn" in doc["argv"] and "***" in " ".join(doc["argv"])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["verify", "--dsn", f"host=db password={SECRET} trailing"], "not a DSN"),
        (["verify", "--dsn", f"postgresql://u:{SECRET}@db:99999/app"], "not a port number"),
        (["mutants", "--dsn", f"postgresql://u:{SECRET}%ZZ@db/app"], "not a DSN"),
        (["serve", "--dsn", f"host=db password={SECRET} trailing"], "not a DSN"),
        (["verify", "--seed", "-5"], "not a seed"),
        (["mutants", "--seed", "1e3"], "not a seed"),
        (["soak", "outbox", "--seed", "-5"], "not a seed"),
    ],
)
def test_a_malformed_dsn_or_seed_is_exit_2_naming_it_and_no_secret(capsys, argv, words):
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert words in err.strip().splitlines()[-1] and SECRET not in err, err


# ---------------------------------------------------------------------------------------
# Tool overrides.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable, find",
    [
        ("KNOWNSTATE_TOXIPROXY", tools.toxiproxy_server),
        ("KNOWNSTATE_LIBFAKETIME", tools.libfaketime),
        ("KNOWNSTATE_PG_BINDIR", lambda: tools.pg_binary("initdb")),
    ],
)
def test_a_tool_override_naming_a_missing_file_fails_naming_the_variable(
    monkeypatch, tmp_path, variable, find
):
    monkeypatch.setenv(variable, str(tmp_path / "missing"))
    with pytest.raises(MissingTool, match=variable) as missing:
        find()
    assert str(tmp_path / "missing") in str(missing.value)


# ---------------------------------------------------------------------------------------
# Leftovers: what a run killed with SIGKILL leaves is swept by the next, and only that.
# ---------------------------------------------------------------------------------------

MAKE_AND_WAIT = (
    "import sys; from knownstate.chaos import leftovers; "
    "print(leftovers.make('knownstate-test-'), flush=True); sys.stdin.read()"
)


@pytest.fixture
def temp_dir(monkeypatch):
    """A temp directory of the test's own (readable by the postgres user when root)."""
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="hostile-tmp-", dir="/tmp")
    os.chmod(where, 0o755)
    monkeypatch.setenv("TMPDIR", where)
    yield Path(where)
    shutil.rmtree(where, ignore_errors=True)


def _owner(temp_dir: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKE_AND_WAIT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, Path(proc.stdout.readline().strip())


def test_the_sweep_removes_only_the_folders_of_dead_runs(temp_dir):
    from knownstate.chaos import leftovers

    dead, dead_folder = _owner(temp_dir)
    alive, alive_folder = _owner(temp_dir)
    (dead_folder / "data").mkdir()
    squatter = subprocess.Popen(["cat"], stdin=subprocess.PIPE, cwd=dead_folder / "data")
    unowned = temp_dir / "knownstate-pg-made-by-an-older-knownstate"
    unowned.mkdir()
    try:
        dead.kill()
        dead.wait(timeout=30)
        assert leftovers.sweep(str(temp_dir)) == [dead_folder]
        assert not dead_folder.exists() and alive_folder.exists() and unowned.exists()
        assert squatter.wait(timeout=30) == -signal.SIGKILL
    finally:
        alive.stdin.close()
        alive.wait(timeout=30)
        squatter.kill()
        squatter.wait(timeout=30)


def test_the_faketime_sweep_removes_only_what_processes_that_are_gone_left(tmp_path):
    from knownstate.chaos import leftovers

    gone = subprocess.Popen(["true"])
    gone.wait(timeout=30)
    mine = os.getpid()
    names = [f"faketime_shm_{gone.pid}", f"sem.faketime_sem_{gone.pid}"]
    kept = [f"faketime_shm_{mine}", f"sem.faketime_sem_{mine}", "faketime_shm_x", "PostgreSQL.1"]
    for name in names + kept:
        (tmp_path / name).write_bytes(b"")
    assert leftovers.sweep_faketime(tmp_path) == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_what_libfaketime_left_in_dev_shm_is_gone_when_a_server_starts_again(tmp_path, monkeypatch):
    """libfaketime makes a shared memory object and a semaphore named by the pid of the server
    process it first runs in, with O_EXCL, and removes them when that process exits: one killed
    with SIGKILL (an injected crash) leaves them, and a server process that got that pid later
    could not start (CI: the startup process, "shm_open failed: File exists", so the server
    exited 1). A leftover of a process that is gone goes before the server starts again."""
    from knownstate.chaos import leftovers
    from knownstate.chaos.cluster import PostgresCluster

    gone = subprocess.Popen(["true"])
    gone.wait(timeout=30)
    # /dev/shm stands in a folder of its own: another run's sweep must not remove them first
    monkeypatch.setattr(leftovers, "SHM", tmp_path)
    left = [tmp_path / f"faketime_shm_{gone.pid}", tmp_path / f"sem.faketime_sem_{gone.pid}"]
    with PostgresCluster() as db:
        for path in left:
            path.write_bytes(b"")
        db.crash()
        assert all(p.exists() for p in left)
        db.restart()
        assert not any(p.exists() for p in left)


def test_a_server_keeps_no_shared_memory_in_dev_shm_that_a_kill_would_leave():
    """What a server maps from /dev/shm outlives it when it is killed with SIGKILL (as every
    injected crash kills it) and its folder removed: 1 MB a server, before. The throwaway
    server keeps its dynamic shared memory in its data directory instead."""
    from knownstate.chaos.cluster import PostgresCluster

    with PostgresCluster(faketime=False) as db:
        maps = Path(f"/proc/{db._proc.pid}/maps").read_text()
        assert "/dev/shm/" not in maps and f"{db.data}/pg_dynshmem/" in maps, maps


def _segment(data: Path) -> tuple[int, int]:
    """The System V segment (key, id) a server's ``postmaster.pid`` names."""
    key, shmid = (data / "postmaster.pid").read_text().splitlines()[6].split()
    return int(key), int(shmid)


def _segment_key(shmid: int) -> int | None:
    """The key of the segment ``shmid`` (IPC_STAT), or None when there is none."""
    import ctypes

    stat = ctypes.create_string_buffer(256)
    if ctypes.CDLL(None).shmctl(shmid, 2, stat) != 0:
        return None
    return ctypes.c_int.from_buffer(stat).value


def test_a_server_killed_and_removed_leaves_no_shared_memory_segment():
    """A server killed with SIGKILL (a crash left as it was at the end of a run) leaves the
    System V segment PostgreSQL keeps as its interlock: one more each time, until the kernel's
    limit (kernel.shmmni) refuses new servers. Removing its folder removes the segment too."""
    from knownstate.chaos.cluster import PostgresCluster

    with PostgresCluster(faketime=False) as db:
        key, shmid = _segment(db.data)
        assert _segment_key(shmid) == key
        db.crash()
        assert _segment_key(shmid) == key, "a SIGKILLed server leaves it"
    assert _segment_key(shmid) != key


def test_the_sweep_removes_the_shared_memory_segment_a_dead_runs_server_left(temp_dir):
    """A run killed with its server leaves the segment its ``postmaster.pid`` names: the sweep
    of its folder removes it (here a segment made for the test, named as a server names it)."""
    import ctypes
    import random

    from knownstate.chaos import leftovers

    key = random.randrange(1 << 20, 1 << 30)
    shmid = ctypes.CDLL(None).shmget(key, 56, 0o1000 | 0o2000 | 0o600)  # IPC_CREAT|IPC_EXCL
    assert shmid >= 0 and _segment_key(shmid) == key
    try:
        dead, folder = _owner(temp_dir)
        (folder / "data").mkdir()
        fields = ["1", str(folder / "data"), "0", "5432", str(folder), "127.0.0.1"]
        (folder / "data" / "postmaster.pid").write_text("\n".join([*fields, f"{key} {shmid}"]))
        dead.kill()
        dead.wait(timeout=30)
        assert leftovers.sweep(str(temp_dir)) == [folder]
        assert _segment_key(shmid) != key
    finally:
        if _segment_key(shmid) == key:
            ctypes.CDLL(None).shmctl(shmid, 0, None)


@pytest.mark.slow
def test_after_kill_9_of_verify_the_next_run_leaves_nothing_of_the_first(temp_dir, tmp_path):
    """The acceptance of issue 18: kill -KILL of a running verify, then one more run."""
    env = {**os.environ, "CI": "true", "TMPDIR": str(temp_dir)}
    first = subprocess.Popen(
        [*KNOWNSTATE, "verify", "outbox", "--seed", "1", "--no-example-db"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        for line in first.stdout:
            if "examples," in line or "steps," in line:  # a progress line: the run is under way
                break
        started = _descendants(first.pid)
        folders = sorted(temp_dir.glob("knownstate-*"))
        assert started and folders, (started, folders)
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    poll("every process of the killed run is gone", lambda: not [p for p in started if alive(p)])
    assert all(f.exists() for f in folders), "SIGKILL leaves the folders (the next run sweeps)"
    second = subprocess.run(
        [*KNOWNSTATE, "verify", "outbox", "--seed", "2", "--examples", "1", "--no-example-db"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert second.returncode in (0, 1), second.stdout + second.stderr
    assert list(temp_dir.iterdir()) == [], list(temp_dir.iterdir())
    assert not [p for p in started if alive(p)]


def _descendants(pid: int) -> list[int]:
    from knownstate.chaos.cluster import _descendants as descendants

    return descendants(pid)


# ---------------------------------------------------------------------------------------
# soak: reports on every exit, with real seconds and a replay command.
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_soak_that_passes_reports_its_real_seconds_and_how_to_run_it_again(tmp_path):
    out = subprocess.run(
        [*KNOWNSTATE, "soak", "outbox", "--seconds", "5", "--seed", "3", "--json", "r.json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "CI": "true"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["outcome"] == "passed" and doc["seconds"] >= 5, doc["seconds"]
    assert doc["runs"][0]["seconds"] >= 5
    assert doc["runs"][0]["replay"] == "knownstate soak outbox --seconds 5 --seed 3"


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_soak_stopped_by_a_signal_writes_both_reports(tmp_path, sig, code):
    proc = subprocess.Popen(
        [*KNOWNSTATE, "soak", "outbox", "--seconds", "120", "--seed", "3"]
        + ["--json", "r.json", "--junit", "r.xml"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CI": "true"},
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if "faults now:" in line:  # a progress line: the soak is under way
                break
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["outcome"] == "interrupted" and doc["exit_code"] == code
    assert doc["runs"][0]["status"] == "interrupted" and doc["seconds"] > 0
    assert doc["soak"]["replay"] == "knownstate soak outbox --seconds 120 --seed 3"
    assert "<error" in (tmp_path / "r.xml").read_text()


# ---------------------------------------------------------------------------------------
# init-kind: the next step it prints runs the pytest that has the plugin.
# ---------------------------------------------------------------------------------------


def test_init_kind_names_the_pytest_of_the_python_knownstate_runs_in(tmp_path, capsys):
    assert cli.main(["init-kind", "demo-queue", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{sys.executable} -m pytest" in out, out
    test = (tmp_path / "demo-queue" / "tests" / "test_demo_queue_kind.py").read_text()
    assert 'profile="quick"' in test
