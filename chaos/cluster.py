"""Where the checks get a PostgreSQL server.

``PostgresCluster`` is a throwaway cluster the harness owns: ``initdb`` into a temp
directory (as the ``postgres`` user when running as root), the server started under
libfaketime so its ``now()`` can jump (:class:`DbClock`), ``crash()`` = SIGKILL of the
postmaster's whole process group, ``restart()`` on the same data, and everything stopped
and removed on exit (also after Ctrl-C or an exception).

``ExternalDatabase`` wraps a DSN someone else runs (``--dsn`` / ``DATABASE_URL``): no clock
faults, no crash; the checks report those fault kinds unavailable instead of skipping them.

``ContainerDatabase`` starts PostgreSQL with testcontainers when a Docker engine answers.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from . import tools


class ClusterError(RuntimeError):
    """The PostgreSQL server could not be started or stopped."""


class Unavailable(RuntimeError):
    """This fault cannot be injected on this database (it is not one the harness owns)."""


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _wait_gone(pids: list[int], deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)]
        if not alive:
            return
        time.sleep(0.01)
    raise ClusterError(f"PostgreSQL processes {alive} did not exit after SIGKILL")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


class DbClock:
    """The database server's clock, moved through libfaketime's timestamp file.

    The file holds a relative offset (``+300`` = five minutes ahead). libfaketime re-reads it on
    every time call (``FAKETIME_NO_CACHE``), so a jump takes effect at once in every backend,
    without changing any SQL. The clock keeps ticking; only the offset moves."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0.0
        self._write()

    @property
    def offset(self) -> float:
        """Seconds the server's clock is ahead of real time (negative: behind)."""
        return self._offset

    def jump(self, seconds: float) -> None:
        self._offset += seconds
        self._write()

    def reset(self, to: float = 0.0) -> None:
        """Back to ``to`` seconds from real time (the harness starts every example a week back)."""
        if self._offset != to:
            self._offset = to
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self._offset:+.0f}\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)


def _wait_ready(dsn: str, proc: subprocess.Popen | None, log: Path | None, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-800:] if log and log.exists() else ""
            raise ClusterError(f"postgres exited with code {proc.returncode} while starting; log tail:\n{tail}")
        try:
            with psycopg.connect(dsn, connect_timeout=2, autocommit=True) as c:
                c.execute("select 1")
            return
        except psycopg.OperationalError as e:
            last = e
            time.sleep(0.01)
    raise ClusterError(f"postgres did not accept connections within {deadline_s:.0f}s: {last}")


class PostgresCluster:
    """A PostgreSQL cluster in a temp directory, owned by the harness."""

    owns_server = True

    def __init__(self, *, faketime: bool = True, settings: dict[str, str] | None = None):
        self.faketime = faketime
        self.settings = settings or {}
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.clock: DbClock | None = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None
        self.crashes = 0

    # -- life cycle --------------------------------------------------------------
    def start(self) -> "PostgresCluster":
        initdb = tools.pg_binary("initdb")
        self._postgres = tools.pg_binary("postgres")
        ld = tools.libfaketime() if self.faketime else None
        self._dir = Path(tempfile.mkdtemp(prefix="knownstate-pg-"))
        try:
            self._user = self._run_as()
            if self._user:
                pw = pwd.getpwnam(self._user)
                os.chown(self._dir, pw.pw_uid, pw.pw_gid)
            self.data = self._dir / "data"
            out = subprocess.run([initdb, "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync",
                                  "-E", "UTF8", "--locale=C"], capture_output=True, text=True,
                                 user=self._user, cwd=self._dir)
            if out.returncode != 0:
                raise ClusterError(f"initdb failed: {out.stderr.strip()[-500:]}")
            if ld:
                self.clock = DbClock(self._dir / "faketime")
                if self._user:
                    os.chown(self.clock.path, pw.pw_uid, pw.pw_gid)
            self._ld = ld
            self.port = tools.free_port()
            self._launch()
            return self
        except BaseException:
            self.stop()
            raise

    def _run_as(self) -> str | None:
        if not tools.running_as_root():
            return None
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise ClusterError("running as root, and there is no `postgres` user to run the server as: "
                               "create it (useradd postgres) or run as a normal user") from None
        return "postgres"

    def _launch(self) -> None:
        assert self._dir is not None and self.port is not None
        conf = {
            "listen_addresses": self.host, "port": str(self.port), "unix_socket_directories": str(self._dir),
            "fsync": "off", "full_page_writes": "off", "synchronous_commit": "on",
            "max_connections": "200", "shared_buffers": "128MB", "autovacuum": "off",
            # Checkpoint often: crash recovery replays the WAL since the last one, and a check
            # crashes the server hundreds of times (a restart stays a tenth of a second).
            "checkpoint_timeout": "30s", "max_wal_size": "64MB", "min_wal_size": "32MB",
            "log_min_messages": "fatal", "logging_collector": "off",
        }
        conf.update(self.settings)
        args = [self._postgres, "-D", str(self.data)]
        for k, v in conf.items():
            args += ["-c", f"{k}={v}"]
        env = dict(os.environ)
        if self._ld:
            env.update(LD_PRELOAD=self._ld, FAKETIME_TIMESTAMP_FILE=str(self.clock.path),
                       FAKETIME_NO_CACHE="1", FAKETIME_DONT_FAKE_MONOTONIC="1")
        self._log = self._dir / "postgres.log"
        with open(self._log, "ab") as log:
            if self._user:
                os.chown(self._log, pwd.getpwnam(self._user).pw_uid, -1)
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self._dir,
                                          user=self._user, start_new_session=True,
                                          preexec_fn=tools.die_with_parent)
        _wait_ready(self.dsn(), self._proc, self._log)

    def crash(self) -> None:
        """SIGKILL the postmaster and every backend at once: what a machine crash leaves is what
        recovery sees. Backends call setsid(), so they are found by parentage, not process group."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGSTOP)  # no new backend between listing and killing
        victims = [self._proc.pid, *_descendants(self._proc.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._proc.wait()
        _wait_gone(victims)
        self._proc = None
        self.crashes += 1

    def restart(self) -> None:
        """Start the server again on the same data (runs crash recovery after a crash)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._launch()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, chars: int = 600) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:]
        except (AttributeError, OSError):
            return ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            victims = [proc.pid, *_descendants(proc.pid)]
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            _wait_gone(victims)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


    def __enter__(self) -> "PostgresCluster":
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- addresses -----------------------------------------------------------
    def dsn(self, dbname: str = "postgres", host: str | None = None, port: int | None = None) -> str:
        return f"host={host or self.host} port={port or self.port} user=postgres dbname={dbname}"

    def describe(self) -> str:
        clock = "libfaketime clock" if self.clock else "real clock"
        return f"throwaway PostgreSQL on {self.host}:{self.port} ({clock})"


class ExternalDatabase:
    """A server someone else runs. The checks use it as it is; crash and clock faults are unavailable."""

    owns_server = False
    clock = None

    def __init__(self, dsn: str):
        self._dsn = dsn
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        self.host = info.get("host", "127.0.0.1")
        self.port = int(info.get("port", 5432))
        self._info = info

    def start(self) -> "ExternalDatabase":
        _wait_ready(self._dsn, None, None, deadline_s=10)
        return self

    def stop(self) -> None:
        pass

    def crash(self) -> None:
        raise Unavailable("database crash is unavailable on an external DSN (the harness does not own the server)")

    restart = crash

    @property
    def running(self) -> bool:
        return True

    def dsn(self, dbname: str | None = None, host: str | None = None, port: int | None = None) -> str:
        info = dict(self._info)
        if dbname:
            info["dbname"] = dbname
        if host:
            info["host"] = host
        if port:
            info["port"] = str(port)
        return psycopg.conninfo.make_conninfo(**info)

    def describe(self) -> str:
        return f"external PostgreSQL at {self.host}:{self.port} (clock and crash faults unavailable)"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def docker_available() -> str | None:
    """None when a Docker engine answers, else the reason it does not."""
    if not shutil.which("docker"):
        return "no docker command on this machine"
    out = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if out.returncode != 0:
        return "no Docker engine reachable (`docker info` failed: " + (out.stderr.strip().splitlines() or ["?"])[-1] + ")"
    return None


class ContainerDatabase(ExternalDatabase):
    """PostgreSQL 15 in a container started by testcontainers (needs a Docker engine)."""

    def __init__(self, image: str = "postgres:15"):
        self.image = image
        self._container = None

    def start(self) -> "ContainerDatabase":
        reason = docker_available()
        if reason:
            raise Unavailable(reason)
        from testcontainers.postgres import PostgresContainer

        self._container = PostgresContainer(self.image, username="postgres", password="postgres", dbname="postgres")
        self._container.start()
        host = self._container.get_container_host_ip()
        port = self._container.get_exposed_port(5432)
        super().__init__(f"host={host} port={port} user=postgres password=postgres dbname=postgres")
        return super().start()

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None


def open_database(dsn: str | None = None, *, faketime: bool = True):
    """The database a check runs on: the given DSN, else $DATABASE_URL, else a throwaway cluster."""
    dsn = dsn or os.environ.get("DATABASE_URL")
    return ExternalDatabase(dsn) if dsn else PostgresCluster(faketime=faketime)
