"""Temp folders a run owns, and the sweep of those whose run died without removing them.

A run removes its folders when it ends, also after Ctrl-C or an error; ``kill -KILL`` leaves
them (a throwaway cluster's is some 40 MB). So every folder is made by :func:`make`, with a
lock file, ``.knownstate-owner``, that the making process holds locked (``flock``) for as long
as the folder is its: the kernel lets go of the lock when that process dies, however it dies.
:func:`sweep`, run whenever a run starts a cluster, removes every ``knownstate-*`` folder in the
temp directory whose lock it can take — its owner is gone — after killing what still lives in
it (a PostgreSQL server that outlived its runner: its processes' working directory is in the
folder). A folder whose owner lives is never touched, and neither is one without the lock file
(being made this instant, or made by a knownstate before this one): the lock file appears,
already locked, in one rename.

:func:`sweep_faketime` removes what libfaketime leaves of a server killed with SIGKILL (every
injected crash), which would stop a later server from starting; :func:`release_shared_memory`
the System V segment such a server leaves, when its folder goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

PREFIX = "knownstate-"
OWNER = ".knownstate-owner"
_held: dict[Path, int] = {}


def make(prefix: str) -> Path:
    """A new folder in the temp directory, owned by this process until :func:`remove`."""
    assert prefix.startswith(PREFIX)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    staging = folder / f"{OWNER}.{os.getpid()}"
    fd = os.open(staging, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(staging, folder / OWNER)
    _held[folder] = fd
    return folder


def remove(folder: Path) -> None:
    """Remove a folder :func:`make` made, and let go of it."""
    shutil.rmtree(folder, ignore_errors=True)
    fd = _held.pop(Path(folder), None)
    if fd is not None:
        os.close(fd)


def sweep(where: str | None = None) -> list[Path]:
    """Remove the folders of runs that died; the folders removed."""
    base = Path(where or tempfile.gettempdir())
    removed = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return removed
    for folder in entries:
        if not folder.name.startswith(PREFIX) or folder in _held:
            continue
        try:
            fd = os.open(folder / OWNER, os.O_RDONLY)
        except OSError:
            continue  # no lock file: being made right now, or not made by make()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner is alive
            _kill_living_in(folder)
            release_shared_memory(folder / "data")
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
        finally:
            os.close(fd)
    return removed


SHM = Path("/dev/shm")
_FAKETIME = re.compile(r"(?:sem\.)?faketime_(?:shm|sem)_(\d+)")


def sweep_faketime(where: Path | None = None) -> list[str]:
    """Remove the POSIX shared memory objects and semaphores libfaketime made for processes
    that are gone; the names removed. libfaketime (0.9.10) makes them in a process of the
    server, named by its pid (``faketime_shm_<pid>``, ``sem.faketime_sem_<pid>``, with O_EXCL),
    and removes them when that process exits. One killed with SIGKILL (an injected crash)
    leaves them, and a later server process that gets the same pid (pids wrap at
    ``/proc/sys/kernel/pid_max``: 32,768 on many machines) exits at once: "libfaketime: In
    ft_shm_create(), shm_open failed: File exists" (in CI, a restarted server's startup process,
    so the server did not start). Run before a server starts, so no leftover waits for a pid. A
    process that lives (or is a zombie) keeps its pid and its objects; those of another user
    are left where they may not be removed (upstream's README: delete them "occasionally").
    ``where``: the folder (default :data:`SHM`)."""
    removed, where = [], where or SHM
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return removed
    for name in names:
        found = _FAKETIME.fullmatch(name)
        if found and not os.path.exists(f"/proc/{found.group(1)}"):
            with contextlib.suppress(OSError):
                (where / name).unlink()
                removed.append(name)
    return removed


IPC_RMID, IPC_STAT = 0, 2


def release_shared_memory(data: Path) -> bool:
    """Remove the System V shared memory segment a PostgreSQL server killed before it could shut
    down left: its interlock, named in ``postmaster.pid`` in its data directory ``data``. A
    server started again on the same data removes it; one whose folder is removed never is, and
    the kernel's limit on segments (``kernel.shmmni``, 4,096 by default) is then reached one
    killed server at a time. Only the segment whose key is still the one the file names goes.
    Call once no process of the server lives. True when one was removed."""
    try:
        key, shmid = map(int, (data / "postmaster.pid").read_text().splitlines()[6].split())
    except (OSError, IndexError, ValueError):
        return False  # shut down cleanly (no file), or not a server's data directory
    libc = ctypes.CDLL(None, use_errno=True)
    stat = ctypes.create_string_buffer(256)  # struct shmid_ds: its key (a key_t) comes first
    if libc.shmctl(shmid, IPC_STAT, stat) != 0 or ctypes.c_int.from_buffer(stat).value != key:
        return False  # gone, or the id is another segment's now
    return libc.shmctl(shmid, IPC_RMID, None) == 0


def _kill_living_in(folder: Path, deadline_s: float = 10.0) -> None:
    """SIGKILL every process whose working directory is in ``folder``, and wait until gone."""
    inside = str(folder)
    victims = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                cwd = os.readlink(f"/proc/{entry}/cwd")
                if cwd == inside or cwd.startswith(inside + "/"):
                    victims.append(int(entry))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and any(alive(p) for p in victims):
        time.sleep(0.01)


def alive(pid: int) -> bool:
    """Whether process ``pid`` lives (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
