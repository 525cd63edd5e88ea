"""The one place where driver errors become domain errors.

Every implementation runs its transactions through :func:`boundary` and commits with
:func:`commit`. A lost race is *not* here: it is an ordinary outcome
(:class:`knownstate.model.contract.LostRace`). What is here is what a worker cannot know.
Each error's docstring is its message.
"""

from __future__ import annotations

from contextlib import contextmanager

import psycopg


class KnownstateError(Exception):
    """knownstate failed."""

    def __init__(self, detail: str = ""):
        self.detail = detail
        msg = " ".join((self.__doc__ or "").strip().split("\n\n")[0].split())  # first paragraph
        super().__init__(f"{msg} ({detail})" if detail else msg)


class ConnectionLost(KnownstateError):
    """The database connection died before COMMIT was sent: nothing of this transaction
    committed."""


class CommitIndeterminate(KnownstateError):
    """The database connection died while COMMIT was in flight: the transaction may or may not have
    committed."""


class TransactionAborted(KnownstateError):
    """The server refused a statement and rolled the transaction back: nothing of it committed."""


class ClientError(KnownstateError):
    """The driver refused the call before the server saw it (a wrong parameter, a closed cursor): a
    bug in the calling code, not a lost connection."""


class ExternalCallFailed(KnownstateError):
    """The external service did not confirm the call: it may or may not have acted on it."""


@contextmanager
def boundary(where: str):
    """Translate driver errors raised inside the block. Use around the statements of one
    transaction; the COMMIT itself goes through :func:`commit`."""
    try:
        yield
    except psycopg.Error as e:
        if is_connection_error(e):
            raise ConnectionLost(f"{where}: {first_line(e)}") from e
        if not e.sqlstate:
            raise ClientError(f"{where}: {type(e).__name__}: {first_line(e)}") from e
        raise TransactionAborted(f"{where}: {e.sqlstate} {first_line(e)}") from e


def commit(conn: psycopg.Connection, where: str) -> None:
    """COMMIT, telling a refused COMMIT apart from one whose answer never came."""
    try:
        conn.commit()
    except (psycopg.OperationalError, psycopg.InterfaceError) as e:
        raise CommitIndeterminate(f"{where}: {first_line(e)}") from e


def rollback_quietly(conn: psycopg.Connection) -> None:
    """Roll back what this transaction did; a connection that is already dead has nothing to
    undo (nothing of the transaction committed)."""
    try:
        conn.rollback()
    except psycopg.Error:
        pass


def is_connection_error(e: psycopg.Error) -> bool:
    """A dead link or server (class 08, a server shutting down, or libpq's own report of a lost
    connection: an OperationalError without SQLSTATE), as opposed to a statement the live server
    refused or a call the driver refused before sending it (a ProgrammingError, no SQLSTATE)."""
    state = e.sqlstate or ""
    if state:
        return state.startswith("08") or state in ("57P01", "57P02", "57P03")
    return isinstance(e, psycopg.OperationalError)


def first_line(e: BaseException) -> str:
    """An error's first line, for a one-line message (its type's name when it says nothing)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
