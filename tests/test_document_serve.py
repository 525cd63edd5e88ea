"""``knownstate serve``: the document server on its own, on a throwaway PostgreSQL, stopped by
Ctrl-C with everything it started. The guide it prints (create, share, read, save) is followed
over real HTTP."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

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


def test_serve_runs_the_guide_it_prints_and_stops_clean_on_ctrl_c(served):
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
    assert proc.wait(timeout=30) == 0
    out = "".join(rest.get(timeout=10) for _ in range(rest.qsize() or 1))
    assert "stopped" in out, out
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in started)


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_says_what_to_do_when_it_cannot_start():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "knownstate.chaos.cli",
            "serve",
            "--dsn",
            "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3
    assert re.search(r"knownstate serve: cannot start: .+", out.stdout), out.stdout + out.stderr
    assert len(out.stdout.strip().splitlines()) == 1
