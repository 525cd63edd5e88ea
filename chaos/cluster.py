"""Where the checks get a PostgreSQL server.

``PostgresCluster`` is a throwaway cluster the harness owns: ``initdb`` into a temp
directory (as the ``postgres`` user when running as root), the server started under
libfaketime so its ``now()`` can jump (:class:`DbClock`), ``crash()`` = SIGKILL of the
postmaster's whole process group, ``restart()`` on the same data, and everything stopped
and removed on exit (also after Ctrl-C or an exception).

``ExternalDatabase`` wraps a DSN someone else runs (``--dsn``; ``DATABASE_URL`` only when the user
names it, ``--dsn env:DATABASE_URL``). The harness works only inside the database the DSN names,
in schemas it creates and drops; before anything runs, :meth:`ExternalDatabase.start` finds what
the DSN's user may not do there and names the grant (:class:`Refused`). The server's clock
cannot move and the server cannot crash: leases lapse by a time shift instead
(:mod:`.timeshift`), and what still cannot be reached is reported as not covered.

``ContainerDatabase`` starts PostgreSQL with testcontainers when a Docker engine answers.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psycopg

from knownstate.impl.ports import free_port

from . import dsn as dsns
from . import leftovers, tools


class ClusterError(RuntimeError):
    """The PostgreSQL server could not be started or stopped."""


class Unavailable(RuntimeError):
    """This fault cannot be injected on this database (it is not one the harness owns)."""


class Refused(ClusterError):
    """The database refuses something the harness needs (a connection, a privilege). The message
    is one line: what was refused, where, and the grant or fix that makes it work."""


def process_alive(proc: subprocess.Popen | None) -> bool:
    """Whether a child process still lives: not reaped, not a zombie, not exiting, and no
    SIGKILL pending. A process killed from outside closes its sockets while it exits, before it
    is a zombie; a peer can see that first. A pending SIGKILL and exiting (PF_EXITING) are set
    before any of it, so whoever saw a socket of ``proc`` close finds it dead here. One read of
    ``/proc/<pid>/stat`` (its ``signal`` field holds a pending SIGKILL: the kernel puts it on
    every thread of the process it kills)."""
    if proc is None or proc.returncode is not None:
        return False
    try:
        fd = os.open(f"/proc/{proc.pid}/stat", os.O_RDONLY)
        try:
            stat = os.read(fd, 4096).rsplit(b")", 1)[1].split()
        finally:
            os.close(fd)
    except OSError:
        stat = [b"X"]
    if stat[0] in (b"Z", b"X", b"x"):
        proc.poll()  # reap it
        return False
    return not int(stat[6]) & _PF_EXITING and not int(stat[28]) & _SIGKILL_BIT


_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


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


def _children(pid: int) -> list[int]:
    """The children of ``pid``, as the kernel lists them (``/proc/<pid>/task/*/children``): one
    read per thread instead of one per process of the machine. Falls back to reading every
    process's parent (:func:`_descendants`) when the kernel does not list them."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(child) for child in f.read().split()]
    except OSError:
        return _descendants(pid)
    return out


def _living_in(directory: Path) -> list[int]:
    """Every process whose working directory is ``directory``: a PostgreSQL server's processes
    live in its data directory, also the backends of a postmaster that is gone."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/cwd") == str(directory):
                    out.append(int(entry))
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


HOLD_GRAIN = 0.05
"""The shortest hold :meth:`DbClock.release` takes back; a shorter one the clock runs through."""


class DbClock:
    """The database server's clock, moved through libfaketime's timestamp file.

    The file holds a relative offset (``+300`` = five minutes ahead; fractions of a second
    too). libfaketime re-reads it on every time call (``FAKETIME_NO_CACHE``), so a jump takes
    effect at once in every backend, without changing any SQL. Stored timestamps never move
    (``shifted`` is always 0; compare :class:`~.timeshift.TimeShift`).

    The clock stands still between steps: :meth:`hold` marks the end of a step, and
    :meth:`release`, before the next one touches the database, moves the offset back by the
    real time that passed in between. So the server's ``now()`` advances only while steps run
    (plus the jumps), however long the checker, Hypothesis or a loaded machine takes between
    them, and it never goes back past a time a step could have seen: a row stamped in one step
    is never younger than ``now()`` in the next. ``held_total`` is how far the holds have set it
    back since the last :meth:`reset`."""

    label = "db clock jump"
    shifted = 0

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0.0
        self._base = 0.0
        self._held_at: float | None = None
        self.held_total = 0.0
        self._write()

    @property
    def offset(self) -> float:
        """Seconds the server's clock is ahead of real time (negative: behind)."""
        return self._offset

    @property
    def app_offset(self) -> float:
        """Where an application clock that started with the database's and is moved by none of
        its jumps stands, in seconds from real time: the base, less the time held."""
        return self._base - self.held_total

    def jump(self, seconds: float) -> None:
        self._offset += seconds
        self._write()

    def hold(self) -> None:
        """A step ended: the real time from now until :meth:`release` will not count."""
        if self._held_at is None:
            self._held_at = time.monotonic()

    def release(self) -> None:
        """A step is about to touch the database: the clock goes on from where it was held.
        A hold shorter than :data:`HOLD_GRAIN` is not taken back (a write of the file at every
        step would cost more than the steps): the clock ran on through it, and stays ahead by
        it. Only the hold just ended is ever taken back, never one before it: a step since then
        may have seen the clock ahead by that one, and the clock would go back past it."""
        if self._held_at is not None:
            gap = time.monotonic() - self._held_at
            self._held_at = None
            if gap >= HOLD_GRAIN:
                self.held_total += gap
                self._offset -= gap
                self._write()

    def reset(self, to: float = 0.0) -> None:
        """Back to ``to`` seconds from real time (the harness starts every example a week back)."""
        self._base, self._held_at, self.held_total = to, None, 0.0
        if self._offset != to:
            self._offset = to
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self._offset:+.6f}\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)


def _ready_in_pidfile(data: Path, pid: int) -> bool:
    """Whether the postmaster ``pid`` says, in its ``postmaster.pid``, that it accepts
    connections (its status line, the eighth, reads ``ready``; ``pg_ctl`` waits on the same).
    A file left by a postmaster before it (a crash) names another pid."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"


def _wait_ready(
    dsn: str,
    proc: subprocess.Popen | None,
    log: Path | None,
    deadline_s: float = 30.0,
    data: Path | None = None,
) -> None:
    """Poll, with a deadline, until the server answers ``select 1``. With ``data`` (the
    harness's own server), first until its ``postmaster.pid`` says it is ready: a read of a
    file instead of a refused connection (a backend forked and ended) every few milliseconds."""
    deadline = time.monotonic() + deadline_s
    last: Exception | None = None
    while data is not None and proc is not None and time.monotonic() < deadline:
        if proc.poll() is not None or _ready_in_pidfile(data, proc.pid):
            break
        time.sleep(0.002)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-800:] if log and log.exists() else ""
            code = proc.returncode
            how = (
                f"was killed by {signal.Signals(-code).name} while starting: was it killed "
                "from outside?"
                if code < 0
                else f"exited with code {code} while starting."
            )
            raise ClusterError(f"PostgreSQL (postgres) {how} Server log tail: {tail!r}")
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
        leftovers.sweep()  # what runs killed with SIGKILL left behind
        self._dir = leftovers.make("knownstate-pg-")
        try:
            self._user = self._run_as()
            if self._user:
                pw = pwd.getpwnam(self._user)
                os.chown(self._dir, pw.pw_uid, pw.pw_gid)
            self.data = self._dir / "data"
            out = subprocess.run(
                [
                    initdb,
                    "-D",
                    str(self.data),
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "--no-sync",
                    "-E",
                    "UTF8",
                    "--locale=C",
                ],
                capture_output=True,
                text=True,
                user=self._user,
                cwd=self._dir,
            )
            if out.returncode != 0:
                raise ClusterError(f"initdb failed: {out.stderr.strip()[-500:]}")
            if ld:
                self.clock = DbClock(self._dir / "faketime")
                if self._user:
                    os.chown(self.clock.path, pw.pw_uid, pw.pw_gid)
            self._ld = ld
            self.port = free_port()
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
            raise ClusterError(
                "running as root, and there is no `postgres` user to run the server "
                "as: create it (useradd postgres) or run as a normal user"
            ) from None
        return "postgres"

    def _launch(self) -> None:
        assert self._dir is not None and self.port is not None
        conf = {
            "listen_addresses": self.host,
            "port": str(self.port),
            "unix_socket_directories": str(self._dir),
            "fsync": "off",
            "full_page_writes": "off",
            "synchronous_commit": "on",
            "max_connections": "200",
            "shared_buffers": "128MB",
            "autovacuum": "off",
            # Checkpoint often: crash recovery replays the WAL since the last one, and a check
            # crashes the server hundreds of times (a restart stays a tenth of a second).
            "checkpoint_timeout": "30s",
            "max_wal_size": "64MB",
            "min_wal_size": "32MB",
            # its dynamic shared memory in the data directory, removed with it: in /dev/shm
            # (posix), what a server killed with SIGKILL made there stayed (1 MB a server)
            "dynamic_shared_memory_type": "mmap",
            "log_min_messages": "fatal",
            "logging_collector": "off",
        }
        conf.update(self.settings)
        args = [self._postgres, "-D", str(self.data)]
        for k, v in conf.items():
            args += ["-c", f"{k}={v}"]
        env = dict(os.environ)
        if self._ld:
            env.update(
                LD_PRELOAD=self._ld,
                FAKETIME_TIMESTAMP_FILE=str(self.clock.path),
                FAKETIME_NO_CACHE="1",
                FAKETIME_DONT_FAKE_MONOTONIC="1",
            )
        if self._ld:
            leftovers.sweep_faketime()  # what server processes killed before this one left
        self._log = self._dir / "postgres.log"
        with open(self._log, "ab") as log:
            if self._user:
                os.chown(self._log, pwd.getpwnam(self._user).pw_uid, -1)
            self._proc = tools.spawn(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self._dir, user=self._user
            )
        _wait_ready(self.dsn(), self._proc, self._log, data=self.data)

    def crash(self) -> None:
        """SIGKILL the postmaster and every backend at once: what a machine crash leaves is what
        recovery sees. Backends call setsid(), so they are found by parentage, not process group."""
        if self._proc is None:
            return
        if not self.running:
            raise ClusterError(
                "the postmaster had died before the injected crash (was it killed "
                f"from outside?); server log tail: {self.log_tail(300)!r}"
            )
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGSTOP)  # no new backend between listing and killing
        # every backend is a child of the stopped postmaster (they fork nothing of their own)
        victims = [self._proc.pid, *_children(self._proc.pid), *_living_in(self.data)]
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
        return process_alive(self._proc)

    def log_tail(self, chars: int = 600) -> str:
        try:
            return self._log.read_text(errors="replace")[-chars:]
        except (AttributeError, OSError):
            return ""

    def stop(self) -> None:
        """Stop the server (a fast shutdown, then SIGKILL of whatever is left of it: also the
        backends of a postmaster killed from outside) and remove its directory."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # fast shutdown
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            victims = [proc.pid, *_descendants(proc.pid), *_living_in(self.data)]
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            _wait_gone(victims)
        if self._dir is not None:
            leftovers.release_shared_memory(self._dir / "data")  # a killed server's
            leftovers.remove(self._dir)
            self._dir = None

    def __enter__(self) -> "PostgresCluster":
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- addresses -----------------------------------------------------------
    def dsn(
        self, dbname: str = "postgres", host: str | None = None, port: int | None = None
    ) -> str:
        """A DSN of this cluster, immune to libpq's environment variables (:func:`.dsn.pinned`):
        ``PGOPTIONS``, ``PGSSLMODE``, ... are meant for servers a user names, never for this."""
        return dsns.pinned(
            host=host or self.host, port=port or self.port, user="postgres", dbname=dbname
        )

    def describe(self) -> str:
        clock = "libfaketime clock" if self.clock else "real clock"
        return f"throwaway PostgreSQL on {self.host}:{self.port} ({clock})"


class ExternalDatabase:
    """A server someone else runs, used as it is: only the database the DSN names, only schemas
    the harness creates. Crash and clock faults are unavailable."""

    owns_server = False
    clock = None

    def __init__(self, dsn: str):
        self._dsn = dsn
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        # what libpq will use: the DSN's, else its environment variable's, else its default
        self.host = info.get("host") or os.environ.get("PGHOST") or "localhost"
        self.port = int(str(info.get("port") or os.environ.get("PGPORT") or 5432).split(",")[0])
        self._info = info
        self.user = info.get("user") or os.environ.get("PGUSER") or getpass.getuser()
        self.dbname = info.get("dbname") or os.environ.get("PGDATABASE") or self.user

    def start(self) -> "ExternalDatabase":
        self.preflight()
        return self

    def preflight(self, deadline_s: float = 10.0) -> None:
        """Find, before anything runs, what the DSN's user may not do here: connect to the
        database, create schemas in it, see and end its own sessions. Raises :class:`Refused`
        naming the grant needed. Waits up to ``deadline_s`` for a server that is starting."""
        conn = self.connect(deadline_s)
        with conn:
            self.user, self.dbname, may_create = conn.execute(
                "select current_user, current_database(), "
                "has_database_privilege(current_database(), 'CREATE')"
            ).fetchone()
            if not may_create:
                raise Refused(
                    f"user {self.user} may not create schemas in database "
                    f"{self.dbname} on {self.host}:{self.port}: grant it with GRANT "
                    f"CREATE ON DATABASE {dsns.ident(self.dbname)} TO {dsns.ident(self.user)}"
                )
            self._may_end_own_sessions(conn)

    def connect(self, deadline_s: float, application_name: str = "knownstate-preflight"):
        """An autocommit connection to the DSN's database, or :class:`Refused` with one line:
        what refused it (the server, the name service, a PG* variable) and what to do. A server
        that does not answer is tried again until ``deadline_s``."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                return psycopg.connect(
                    self._dsn, autocommit=True, connect_timeout=5, application_name=application_name
                )
            except psycopg.OperationalError as e:
                text = str(e)
                refused = dsns.refusal(
                    text, f"{self.host}:{self.port}", self.user, self.dbname, self._dsn
                )
                if refused:
                    raise Refused(refused) from None
                if time.monotonic() > deadline:
                    raise Refused(
                        f"PostgreSQL at {self.host}:{self.port} is not answering "
                        f"({dsns.reason(text)}): is it running, and is the DSN right?"
                        + dsns.environment_note(self._dsn)
                    ) from None
                time.sleep(0.1)

    def _may_end_own_sessions(self, conn: psycopg.Connection) -> None:
        """The harness ends its own abandoned sessions (pg_terminate_backend) and watches its
        own lock waits (pg_blocking_pids): try both on a session of its own."""
        app = f"knownstate-preflight-{secrets.token_hex(4)}"
        with psycopg.connect(
            self._dsn, autocommit=True, connect_timeout=5, application_name=app
        ) as probe:
            pid = probe.info.backend_pid
            for function in ("pg_blocking_pids", "pg_terminate_backend"):
                try:
                    ended = conn.execute(f"select {function}(%s)", (pid,)).fetchone()[0]
                except psycopg.errors.InsufficientPrivilege:
                    (signature,) = conn.execute(
                        "select min(oid::regprocedure::text) from pg_proc where proname = %s",
                        (function,),
                    ).fetchone()
                    raise Refused(
                        f"user {self.user} may not call {function}() in database "
                        f"{self.dbname} on {self.host}:{self.port} (the harness ends "
                        "and watches its own sessions): grant it with GRANT EXECUTE "
                        f"ON FUNCTION {signature} TO {dsns.ident(self.user)}"
                    ) from None
            if ended is not True:
                raise Refused(
                    f"user {self.user} may not end its own sessions in database "
                    f"{self.dbname} on {self.host}:{self.port}: grant it with "
                    f"GRANT pg_signal_backend TO {dsns.ident(self.user)}"
                )

    def stop(self) -> None:
        pass

    def crash(self) -> None:
        raise Unavailable(
            "database crash is unavailable on an external DSN (the harness does not own the server)"
        )

    restart = crash

    @property
    def running(self) -> bool:
        return True

    def dsn(
        self, dbname: str | None = None, host: str | None = None, port: int | None = None
    ) -> str:
        info = dict(self._info)
        if dbname:
            info["dbname"] = dbname
        if host:
            info["host"] = host
        if port:
            info["port"] = str(port)
        return psycopg.conninfo.make_conninfo(**info)

    def describe(self) -> str:
        return (
            f"external PostgreSQL at {self.host}:{self.port}, database {self.dbname} "
            "(clock and crash faults unavailable)"
        )

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def docker_available() -> str | None:
    """None when a Docker engine answers, else the reason it does not."""
    if not shutil.which("docker"):
        return "no docker command on this machine"
    out = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return "no Docker engine reachable (`docker info` failed: " + last + ")"
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

        self._container = PostgresContainer(
            self.image, username="postgres", password="postgres", dbname="postgres"
        )
        self._container.start()
        host = self._container.get_container_host_ip()
        port = self._container.get_exposed_port(5432)
        super().__init__(f"host={host} port={port} user=postgres password=postgres dbname=postgres")
        return super().start()

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None


resolve_dsn = dsns.resolve  # where it lived first (tests and callers import it from here)


def open_database(
    dsn: str | None = None, *, faketime: bool = True, settings: dict[str, str] | None = None
):
    """The database a check runs on: the given DSN, else a throwaway cluster (``faketime`` and
    server ``settings`` apply to it). An environment variable is read only when ``dsn`` names
    it (``env:NAME``, :func:`.dsn.resolve`)."""
    if dsn:
        return ExternalDatabase(resolve_dsn(dsn))
    return PostgresCluster(faketime=faketime, settings=settings)
