"""Writing a file a user named (a report, a timeline): whatever is at the path is written to,
never replaced by something else.

- a regular file, or a name where nothing is yet: written whole or not at all (a temporary file
  in the same directory, renamed over it), keeping the permissions of the file it replaces;
- a symbolic link: followed, however many; the file it ends at is written, the link stays;
- a stream the process already holds (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
  ``/proc/self/fd/N``, or a link to one): written to that descriptor, never reopened, so a
  shell's ``> out.txt`` keeps what was printed before the report, and a pipe gets it in order;
- a FIFO or a character device (``/dev/null``, a terminal): opened and written to;
- a directory, a socket or a block device (a disk): refused.

:func:`problem` says before a command starts anything why a path cannot be written (None: it
can), trying what the write will do (creating a file in the directory, opening the file for
writing) rather than trusting permission bits, which say yes to root even in ``/proc``.
:func:`write` raises :class:`OutputError`, one line, when the write itself fails (a full disk,
``/dev/full``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import sys


class OutputError(Exception):
    """A file the user named cannot be written: the message says which, and why."""


_MAX_LINKS = 40


def _fd_path() -> re.Pattern:
    return re.compile(rf"/(?:dev/fd|proc/(?:self|thread-self|{os.getpid()})/fd)/(\d+)")


def resolve(path: str) -> tuple[str, int | None]:
    """Where a write to ``path`` lands: the path with every symbolic link followed, and the file
    descriptor of this process it names, if it names one (``/dev/stdout`` -> 1). Raises
    OutputError for a loop of links."""
    fd_path = _fd_path()
    p = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        m = fd_path.fullmatch(p)
        if m:
            return p, int(m.group(1))
        if os.path.islink(p):
            p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
            continue
        parent = os.path.dirname(p)
        real_parent = os.path.realpath(parent)
        if real_parent == parent:
            return p, None
        p = os.path.join(real_parent, os.path.basename(p))
    raise OutputError(f"{path}: too many levels of symbolic links")


def is_stream(path: str) -> bool:
    """Whether ``path`` is not a file of its own: a descriptor, a FIFO or a device (a name
    derived from it, like ``<report>.timeline.html``, would be meaningless)."""
    try:
        target, fd = resolve(path)
    except OutputError:
        return False
    if fd is not None:
        return True
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _temp_name(target: str) -> str:
    folder, name = os.path.split(target)
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp")


def problem(path: str, what: str) -> str | None:
    """Why the ``what`` cannot be written to ``path`` (None: it can). Nothing is left behind."""
    where = f"cannot write the {what} to {path}"
    try:
        target, fd = resolve(path)
    except OutputError as e:
        return f"{where}: {e}"
    if fd is not None:
        try:
            mode = os.fstat(fd).st_mode
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            return f"{where}: file descriptor {fd} is not open in this process"
        if flags & os.O_ACCMODE == os.O_RDONLY:
            return f"{where}: file descriptor {fd} is open for reading only"
        return _kind_problem(where, mode)
    via = "" if target == os.path.abspath(path) else f" (a link to {target})"
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        shown = os.path.dirname(target) if via else (os.path.dirname(path) or ".")
        return _new_file_problem(where + via, target, shown)
    except OSError as e:
        return f"{where}{via}: {e.strerror}"
    refused = _kind_problem(where + via, st.st_mode)
    if refused:
        return refused
    if stat.S_ISFIFO(st.st_mode):
        return None if os.access(target, os.W_OK) else f"{where}{via}: the FIFO is not writable"
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as e:
        return f"{where}{via}: the file cannot be opened for writing ({e.strerror})"
    return None


def _kind_problem(where: str, mode: int) -> str | None:
    if stat.S_ISDIR(mode):
        return f"{where}: it is a directory; give a file name"
    if stat.S_ISSOCK(mode):
        return f"{where}: it is a socket; give a file name"
    if stat.S_ISBLK(mode):
        return f"{where}: it is a block device (a disk); give a file name"
    return None


def _new_file_problem(where: str, target: str, shown: str) -> str | None:
    folder = os.path.dirname(target)
    if not os.path.exists(folder):
        return f"{where}: directory {shown} does not exist"
    if not os.path.isdir(folder):
        return f"{where}: {shown} is not a directory"
    probe = _temp_name(target)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        return f"{where}: no file can be created in directory {shown} ({e.strerror})"
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def write(path: str, text: str, what: str) -> None:
    """Write ``text`` to ``path`` as the module docstring says; OutputError when it fails."""
    data = text.encode()
    try:
        target, fd = resolve(path)
        if fd is not None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()  # what was printed before comes first
            _write_all(fd, data)
            return
        try:
            mode = os.stat(target).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            refused = _kind_problem(f"cannot write the {what} to {path}", mode)
            if refused:
                raise OutputError(refused)
            out = os.open(target, os.O_WRONLY)
            try:
                _write_all(out, data)
            finally:
                os.close(out)
            return
        _replace(target, data, mode)
    except OSError as e:
        raise OutputError(f"cannot write the {what} to {path}: {e.strerror or e}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _replace(target: str, data: bytes, mode: int | None) -> None:
    """A regular file written whole: a temporary file beside it, renamed over it. When the
    directory takes no new file but the file may be written, the file is written in place."""
    tmp = _temp_name(target)
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        if mode is None or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        out = os.open(target, os.O_WRONLY | os.O_TRUNC)
        try:
            _write_all(out, data)
        finally:
            os.close(out)
        return
    try:
        try:
            _write_all(out, data)
            if mode is not None:
                os.fchmod(out, stat.S_IMODE(mode))
        finally:
            os.close(out)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
