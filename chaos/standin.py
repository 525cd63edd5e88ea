"""Stand-ins in processes of their own, killable from outside like every real part.

A stand-in (the notification sink, the operations API) is a class with ``start()``, ``stop()``,
``host`` and ``port``: an HTTP server on loopback, and methods the check calls to plan answers
and read what it recorded. :class:`StandInProcess` runs one in a child process
(:mod:`.standin_child`: ``python -m knownstate.chaos.standin_child module:Class [ARG ...]``,
built as ``Class(*ARGS)``) and forwards every attribute it does not have itself to the child
over the child's stdin and stdout, one pickled frame each way: a method call returns what the
method returned in the child, or raises what it raised there; any other attribute is read in
the child. Only the two processes see the frames. The benchmarks run the servers they measure
(the sink, the document server) the same way.

Health like PostgreSQL's and Toxiproxy's: :attr:`StandInProcess.running` is whether the child
lives, and a call to a child that died raises :class:`StandInDied`, an
:class:`~knownstate.chaos.harness.EnvironmentFault` naming the part. The child dies with its
parent (PDEATHSIG), ignores the terminal's Ctrl-C (its parent stops it), and stops when its
stdin closes; :meth:`StandInProcess.stop` closes it, waits, and kills it if it has to.
"""

from __future__ import annotations

import contextlib
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from . import timings, tools
from .cluster import process_alive
from .harness import EnvironmentFault
from .standin_child import receive, send


class StandInDied(EnvironmentFault):
    """A stand-in's process died, and not by the harness."""


class StandInProcess:
    """``cls(*args)`` (a stand-in class, importable by module and name; its arguments strings)
    running in a child process."""

    START_S = 60.0
    """How long the child may take to import and start its server (a loaded CI machine)."""

    def __init__(self, name: str, cls: type, *args: str):
        self.name, self.cls, self.args = name, cls, args
        self.host: str | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._methods: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return process_alive(self.proc)

    def describe(self) -> str:
        return f"the {self.name} stand-in ({self.cls.__name__}, pid {self.pid})"

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> "StandInProcess":
        self._log = tempfile.TemporaryFile()
        target = f"{self.cls.__module__}:{self.cls.__qualname__}"
        self.proc = tools.spawn(
            [sys.executable, "-m", f"{__name__}_child", target, *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], self.START_S)
        try:
            if not ready:
                raise EOFError
            kind, self.host, self.port = receive(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError, ValueError):
            problem = f"{self.describe()} did not start within {self.START_S:.0f} s"
            self.stop()
            raise EnvironmentFault(f"{problem}: {self._log_tail()}") from None
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            proc.stdout.close()
        self.proc = None

    def __enter__(self) -> "StandInProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError, AttributeError):
            self._log.seek(0)
            text = self._log.read().decode(errors="replace").strip()
            return text.splitlines()[-1] if text else "no output"
        return "no output"

    # -- calls into the child ------------------------------------------------------------------
    def _ask(self, op: str, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        with timings.span("stand-in"):
            return self._ask_now(op, name, args, kwargs)

    def _ask_now(self, op: str, name: str, args: tuple, kwargs: dict | None) -> Any:
        proc = self.proc
        if proc is None:
            raise EnvironmentFault(f"{self.describe()} is not running: it was stopped")
        with self._lock:
            try:
                send(proc.stdin, (op, name, args, kwargs or {}))
                kind, value = receive(proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                raise self._died() from None
        if kind == "raise":
            raise value
        return kind, value

    def _died(self) -> EnvironmentFault:
        """What to raise when the child's pipe broke: it died (or stopped answering: killed)."""
        proc = self.proc
        try:
            code = proc.wait(timeout=5) if proc is not None else None
        except subprocess.TimeoutExpired:
            proc.kill()
            return StandInDied(f"{self.describe()} stopped answering its control pipe; killed")
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        return StandInDied(
            f"{self.describe()} died ({how}), and not by the harness: was it killed from outside?"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("name", "cls", "args", "proc"):
            raise AttributeError(name)
        if name not in self._methods:
            kind, value = self._ask("get", name)
            if kind == "value":
                return value
            self._methods.add(name)

        def call(*args, **kwargs):
            return self._ask("call", name, args, kwargs)[1]

        call.__name__ = name
        return call
