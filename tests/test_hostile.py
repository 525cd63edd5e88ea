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
  first left in the temp folder, and only what belongs to a dead run.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from gate_fakes import Engine, FakeEnv, machine_of, result

from knownstate.chaos import cli, tools
from knownstate.chaos.report import Report, Unit, path_problem, write_reports
from knownstate.chaos.outpath import OutputError

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
