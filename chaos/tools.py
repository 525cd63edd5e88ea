"""Finding the external programs knownstate drives, with one clear line when one is missing."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = Path(os.environ.get("KNOWNSTATE_TOOLS", PROJECT_ROOT / "tools"))


class MissingTool(RuntimeError):
    """A program knownstate needs is not installed."""


def _pg_bindir() -> Path | None:
    env = os.environ.get("KNOWNSTATE_PG_BINDIR")
    if env:
        return Path(env)
    candidates = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if out.returncode == 0:
            candidates.append(Path(out.stdout.strip()))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for c in candidates:
        if (c / "postgres").exists() and (c / "initdb").exists():
            return c
    return None


def pg_binary(name: str) -> str:
    bindir = _pg_bindir()
    if bindir is None or not (bindir / name).exists():
        raise MissingTool(
            f"PostgreSQL server binary {name!r} not found: run `make setup` "
            "(apt-get install postgresql-15) or set KNOWNSTATE_PG_BINDIR")
    return str(bindir / name)


def libfaketime() -> str:
    env = os.environ.get("KNOWNSTATE_LIBFAKETIME")
    candidates = [Path(env)] if env else []
    candidates += [Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
                   Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
                   Path("/usr/lib/faketime/libfaketime.so.1"),
                   Path("/usr/local/lib/faketime/libfaketime.so.1")]
    for c in candidates:
        if c.exists():
            return str(c)
    raise MissingTool("libfaketime not found: run `make setup` (apt-get install libfaketime) "
                      "or set KNOWNSTATE_LIBFAKETIME to libfaketime.so.1")


def toxiproxy_server() -> str:
    env = os.environ.get("KNOWNSTATE_TOXIPROXY")
    for c in ([Path(env)] if env else []) + [TOOLS_DIR / "bin" / "toxiproxy-server"]:
        if c.exists():
            return str(c)
    found = shutil.which("toxiproxy-server")
    if found:
        return found
    raise MissingTool("toxiproxy-server not found: run `make setup` (builds Toxiproxy v2.12.0 "
                      "with Go into tools/bin) or set KNOWNSTATE_TOXIPROXY")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies,
    so a killed harness never leaves a server behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def running_as_root() -> bool:
    return os.geteuid() == 0
