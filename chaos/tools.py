"""Finding the external programs knownstate drives, with one clear line when one is missing."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = Path(os.environ.get("KNOWNSTATE_TOOLS", PROJECT_ROOT / "tools"))


class MissingTool(RuntimeError):
    """A program knownstate needs is not installed."""


def _override(variable: str, what: str, is_dir: bool = False) -> Path | None:
    """The path an override variable names, if set: it must exist (a file, or with ``is_dir`` a
    directory), else MissingTool naming the variable. An override is never silently passed
    over for a tool found elsewhere."""
    value = os.environ.get(variable)
    if not value:
        return None
    path = Path(value)
    if not (path.is_dir() if is_dir else path.is_file()):
        kind = "directory" if is_dir else "file"
        raise MissingTool(
            f"{variable}={value}: no such {kind}: point it at {what}, or unset it to use the one "
            "`make setup` installs"
        )
    return path


def _pg_bindir() -> Path | None:
    env = _override("KNOWNSTATE_PG_BINDIR", "PostgreSQL's bin directory", is_dir=True)
    if env:
        return env
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
    overridden = os.environ.get("KNOWNSTATE_PG_BINDIR")
    if bindir is not None and overridden and not (bindir / name).exists():
        raise MissingTool(
            f"KNOWNSTATE_PG_BINDIR={bindir}: it has no {name!r}: point it at the bin directory "
            "of a PostgreSQL installation (the one with initdb and postgres)"
        )
    if bindir is None or not (bindir / name).exists():
        raise MissingTool(
            f"PostgreSQL server binary {name!r} not found: run `make setup` "
            "(apt-get install postgresql-15) or set KNOWNSTATE_PG_BINDIR"
        )
    return str(bindir / name)


def libfaketime() -> str:
    env = _override("KNOWNSTATE_LIBFAKETIME", "libfaketime.so.1")
    if env:
        return str(env)
    candidates = [
        Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
        Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
        Path("/usr/lib/faketime/libfaketime.so.1"),
        Path("/usr/local/lib/faketime/libfaketime.so.1"),
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    raise MissingTool(
        "libfaketime not found: run `make setup` (apt-get install libfaketime) "
        "or set KNOWNSTATE_LIBFAKETIME to libfaketime.so.1"
    )


def toxiproxy_server() -> str:
    env = _override("KNOWNSTATE_TOXIPROXY", "a toxiproxy-server program")
    if env:
        return str(env)
    if (TOOLS_DIR / "bin" / "toxiproxy-server").exists():
        return str(TOOLS_DIR / "bin" / "toxiproxy-server")
    found = shutil.which("toxiproxy-server")
    if found:
        return found
    raise MissingTool(
        "toxiproxy-server not found: run `make setup` (builds Toxiproxy v2.12.0 "
        "with Go into tools/bin) or set KNOWNSTATE_TOXIPROXY"
    )


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies,
    so a killed harness never leaves a server behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    """Start a program in its own session (a terminal's Ctrl-C is ours to pass on) that dies
    with us. Signals are held while it forks: a handler that raised inside the fork's hooks
    would have its interrupt printed and dropped by Python, and the run would go on."""
    with deferred_signals():
        return subprocess.Popen(args, start_new_session=True, preexec_fn=die_with_parent, **kwargs)


@contextlib.contextmanager
def deferred_signals():
    """Hold Ctrl-C and SIGTERM until the block is done, then deliver them: for what must not be
    left half done (creating a schema and recording it, dropping the run's schemas, a fork).
    Only the main thread can hold them; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    kept = {
        sig: signal.signal(sig, lambda signum, frame: held.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])


class Interrupted(KeyboardInterrupt):
    """A signal stopped the command (SIGINT: Ctrl-C; SIGTERM: a CI job's timeout)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.signal = name


class _Stop:
    """The signal that stopped the command, and whether the command has caught it yet."""

    signal: str | None = None
    caught = False


def on_signal(signum, frame) -> None:
    """The handler for SIGINT and SIGTERM: the first one stops the run (like Ctrl-C); once the
    command has caught it, later ones are ignored, so the servers are stopped and the reports
    written."""
    if _Stop.caught:
        print("knownstate: still stopping (servers, reports)...", file=sys.stderr, flush=True)
        return
    _Stop.signal = _Stop.signal or signal.Signals(signum).name
    raise Interrupted(_Stop.signal)


def interrupt_caught() -> None:
    """The command has caught the interrupt and is stopping: later signals are ignored."""
    _Stop.caught = True


def reset_interrupt() -> None:
    _Stop.signal, _Stop.caught = None, False


def raise_if_interrupted() -> None:
    """At the start of a step: a signal whose interrupt Python dropped (raised inside a
    destructor or a fork hook, where it is printed and ignored) stops the run here."""
    if _Stop.signal is not None and not _Stop.caught:
        raise Interrupted(_Stop.signal)


def running_as_root() -> bool:
    return os.geteuid() == 0
