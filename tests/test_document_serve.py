"""``knownstate serve``: the document server on its own, on a throwaway PostgreSQL, stopped by
Ctrl-C with everything it started. The guide it prints (create, share, read, save) is followed
over real HTTP."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psycopg
import pytest
from polling import poll

from knownstate.chaos import serve
from knownstate.impl.ports import free_port


def _descendants(pid: int) -> set[int]:
    out, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    stat = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[1]) == parent and stat[0] != "Z":
                    out.add(int(p))
                    frontier.append(int(p))
    return out


@pytest.fixture
def served():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "knownstate.chaos.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, "")], daemon=True
    ).start()
    seen, deadline = [], time.monotonic() + 60
    try:
        while not any("Ctrl-C" in line for line in seen):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        yield proc, f"http://127.0.0.1:{port}", "".join(seen), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_serve_runs_the_guide_it_prints_and_stops_clean_on_ctrl_c_with_exit_130(served):
    proc, url, text, rest = served
    assert f"the document API on {url}" in text
    assert "stand-in for authentication, not authentication" in text
    started = _descendants(proc.pid)
    assert started, "no throwaway PostgreSQL under the serve process"
    commands = [line.strip() for line in serve.guide(url)]
    assert any("/acl/bob" in c for c in commands) and "ID" in text
    with httpx.Client(base_url=url, timeout=10) as http:
        body = {
            "kind": "record",
            "schema": {"attributes": {"title": "text"}},
            "content": {"title": "hello"},
            "writerId": "cli",
            "saveSeq": 1,
        }
        r = http.post("/api/desk/files", headers={"X-User": "alice"}, json=body)
        assert r.status_code == 201
        doc = r.json()["id"]
        assert http.get(f"/api/desk/files/{doc}", headers={"X-User": "bob"}).status_code == 404
        r = http.put(
            f"/api/desk/files/{doc}/acl/bob", headers={"X-User": "alice"}, json={"canWrite": True}
        )
        assert r.json() == {"id": doc, "user": "bob", "canWrite": True}
        assert http.get(f"/api/desk/files/{doc}", headers={"X-User": "bob"}).json()["version"] == 1
        r = http.put(
            f"/api/desk/files/{doc}",
            headers={"X-User": "bob"},
            json={"expectedVersion": 1, "content": {"title": "hi"}, "writerId": "b", "saveSeq": 1},
        )
        assert r.json() == {"id": doc, "version": 2, "replayed": False}
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130  # README: interrupted (Ctrl-C)
    out = "".join(rest.get(timeout=10) for _ in range(rest.qsize() or 1))
    assert "stopped" in out, out
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in started)


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_serve_and_everything_it_started_with_exit_143(served):
    proc, url, _, rest = served
    started = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143  # README: terminated by SIGTERM
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in started)


def run_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "knownstate.chaos.cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cannot_start(out: subprocess.CompletedProcess, code: int, words: str) -> None:
    assert out.returncode == code, out.stdout + out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert words in line, out.stderr
    if code == 3:
        assert line.startswith("knownstate serve: cannot start: ") and not out.stdout, out
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_serve_says_what_to_do_when_nothing_answers():
    out = run_serve("--dsn", "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1")
    cannot_start(out, 3, "is not answering")


@pytest.fixture
def password_user(knownstate_cluster):
    """A role that must give its password (scram): a line of its own first in pg_hba.conf."""
    hba = knownstate_cluster.data / "pg_hba.conf"
    kept = hba.read_text()
    with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
        admin.execute("drop role if exists knownstate_pw")
        admin.execute("create role knownstate_pw login password 'the-right-one'")
        hba.write_text("host all knownstate_pw 127.0.0.1/32 scram-sha-256\n" + kept)
        admin.execute("select pg_reload_conf()")
    yield f"host=127.0.0.1 port={knownstate_cluster.port} user=knownstate_pw dbname=postgres"
    hba.write_text(kept)
    with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
        admin.execute("select pg_reload_conf()")
        admin.execute("drop role if exists knownstate_pw")


def test_a_wrong_password_is_named_as_such_and_never_printed(password_user):
    out = run_serve("--dsn", f"{password_user} password=Wrong-Secret")
    cannot_start(out, 3, "check the DSN's password")
    assert "password authentication failed" in out.stderr and "Wrong-Secret" not in out.stderr


def test_a_dsn_host_that_does_not_resolve_is_named(knownstate_cluster):
    out = run_serve("--dsn", "host=nosuch.invalid user=postgres dbname=postgres connect_timeout=2")
    cannot_start(out, 3, "cannot resolve host nosuch.invalid")


def test_a_malformed_dsn_is_exit_2():
    cannot_start(run_serve("--dsn", "host=db password=Wrong-Secret junk"), 2, "not a DSN")


def test_a_listen_host_that_does_not_resolve_or_a_port_taken_is_named(knownstate_cluster):
    cannot_start(
        run_serve("--dsn", knownstate_cluster.dsn(), "--host", "nosuch.invalid"),
        3,
        "cannot listen on host 'nosuch.invalid': it does not resolve",
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "knownstate.chaos.cli",
                "serve",
                "--dsn",
                knownstate_cluster.dsn(),
            ]
            + ["--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    cannot_start(out, 3, f"port {port} is taken")


def test_tables_of_the_same_names_are_refused_and_a_schema_of_ones_own_is_served(knownstate_db):
    dsn = knownstate_db("create table documents (id int primary key, note text)")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("insert into documents values (1, 'the application''s own row')")
    cannot_start(run_serve("--dsn", dsn), 3, "not knownstate's")
    assert "--schema" in run_serve("--dsn", dsn).stderr
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "knownstate.chaos.cli", "serve", "--dsn", dsn]
        + ["--schema", "docs", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def created() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                body = {
                    "kind": "record",
                    "schema": {"attributes": {"title": "text"}},
                    "content": {"title": "in docs"},
                    "writerId": "cli",
                    "saveSeq": 1,
                }
                r = httpx.post(f"{url}/api/desk/files", headers={"X-User": "alice"}, json=body)
                return r.status_code == 201
            assert proc.poll() is None, proc.stdout.read()
            return False

        poll("serve answers on its schema", created)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("select * from public.documents").fetchall() == [
            (1, "the application's own row")
        ]
        assert conn.execute("select count(*) from docs.documents").fetchone()[0] == 1
