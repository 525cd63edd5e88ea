"""The document store: compare-and-swap saves on PostgreSQL, in the model's outcome vocabulary.

Every operation the HTTP API serves is a method here returning what
:class:`knownstate.model.document.ServerModel` returns for it (``Won(...)``,
``VersionConflict``, ``SeqTaken``, ``Rejected(reason)``), so a check compares the two directly
and the HTTP layer (:mod:`.server`) only maps outcomes to status codes. The SQL is in
``impl/sql/documents.sql`` (named queries) and ``impl/sql/documents_schema.sql``; driver errors
become domain errors in :func:`knownstate.impl.errors.boundary`, nowhere else.

Connections come from a pool (``psycopg_pool``), each in autocommit (every operation is one
statement, or a few reads and one statement) and preparing its statements on first use: a
save is two round trips on an open connection — the access read and the compare-and-swap —
and a third only when the swap misses. ``pool_size=None`` connects per call instead (through
``NullConnectionPool``, in the calling thread): the check runs its server that way, so a fault
on the database link meets every request the same way on a replay, whatever a pool's
background threads were doing. After a connection error the pool checks its idle connections,
so a database restart costs one failed request (503, which a session retries), not one per
pooled connection.

Deadlines. The server runs each request under :func:`deadline`: waiting for a pooled connection
ends at it, and every write the request makes commits by it or not at all. The write is sent
in one pipeline after ``SET LOCAL knownstate.write_deadline`` (the database clock's instant
matching the deadline), and deferred triggers of the schema refuse its COMMIT after that instant
(SQLSTATE ``KS408``): a write held up by a slow or stopped database never lands after its
client was answered 503. The database's clock is related to this process's monotonic clock once
per connection: ``clock_timestamp()`` read at some instant between sending the query and reading
its answer, so the instant derived is never later than the true one. ``statement_timeout``
(the server's request deadline) frees a connection stuck on a lock.

Seams (the mutant catalogue replaces one at a time; the reference never changes):
``queries`` (the named SQL), ``kinds`` (what an id or a value of each document kind may be) and
:meth:`DocumentStore._swap` (how a save's compare-and-swap is made); and where the connections
come from (``connections``: a concurrent block of a check hands each operation its own
intercepted connection, as the pool would hand it one).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import time
import weakref
from typing import Callable, ContextManager, Iterator, Mapping

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, NullConnectionPool, PoolTimeout

from knownstate.impl import queries as named_queries
from knownstate.impl.errors import KnownstateError, boundary, is_connection_error
from knownstate.model.contract import Rejected, Won
from knownstate.model.document import (
    FORBIDDEN,
    KINDS,
    NOT_FOUND,
    NOT_OWNER,
    OWNER_ACCESS,
    PRECONDITION_REQUIRED,
    CopyRequest,
    Created,
    DocView,
    HistoryEntry,
    Kind,
    KindError,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    VersionConflict,
    create_fingerprint,
    created_id,
    kind_of,
    new_document,
    save_fingerprint,
)

Q = named_queries.load("documents.sql")


def schema_sql() -> str:
    return named_queries.schema("documents_schema.sql")


DEADLINE_PASSED = "KS408"
"""The SQLSTATE of a write refused at COMMIT because its request's deadline had passed."""

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "knownstate_documents_deadline", default=None
)


class DeadlinePassed(KnownstateError):
    """The request's deadline passed before the document store answered: nothing of it was
    saved."""


@contextlib.contextmanager
def deadline(commit_by: float):
    """Run the store's operations in the block under a deadline: ``commit_by`` is a
    ``time.monotonic()`` instant; a pooled connection is waited for until then, and a write
    commits by then or not at all (see the module's docstring)."""
    token = _DEADLINE.set(commit_by)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _remaining() -> float | None:
    at = _DEADLINE.get()
    if at is None:
        return None
    left = at - time.monotonic()
    if left <= 0:
        raise DeadlinePassed("before the database was reached")
    return left


class DocumentStore:
    """The documents at ``dsn`` (which may be a Toxiproxy link), over a pool of ``pool_size``
    connections (``None``: a connection per call). ``connections``: instead of a pool, where each
    operation takes its connection (a context manager per operation, called on the operation's
    own thread; a check hands each request its own scheduled connection). ``close()`` when
    done."""

    kinds: Mapping[str, Kind] = KINDS

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int | None = 8,
        connect_timeout: float = 3.0,
        queries: Mapping[str, str] | None = None,
        statement_timeout: float | None = None,
        connections: Callable[[], ContextManager[psycopg.Connection]] | None = None,
    ):
        self.dsn = dsn
        self._connections = connections
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout
        self.q = dict(queries) if queries is not None else Q
        self._clock_offsets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        kwargs = {
            "autocommit": True,
            "connect_timeout": max(1, round(connect_timeout)),
            "application_name": "knownstate-documents",
        }
        configure = self._configure if statement_timeout else None
        if connections is not None:
            self.pool: ConnectionPool | None = None
        elif pool_size is None:
            self.pool = NullConnectionPool(
                dsn, kwargs=kwargs, open=True, timeout=connect_timeout, configure=configure
            )
        else:
            self.pool = ConnectionPool(
                dsn,
                kwargs={**kwargs, "prepare_threshold": 0},
                min_size=min(2, pool_size),
                max_size=pool_size,
                timeout=connect_timeout,
                open=True,
                name=f"documents-{id(self):x}",
                configure=configure,
            )

    def _configure(self, conn: psycopg.Connection) -> None:
        ms = max(1, round(self.statement_timeout * 1000))
        conn.execute(f"SET statement_timeout = {ms}")

    @contextlib.contextmanager
    def _connect(self) -> Iterator[psycopg.Connection]:
        if self._connections is not None:
            with self._connections() as conn:
                yield conn
            return
        try:
            with self.pool.connection(timeout=_remaining()) as conn:
                yield conn
        except PoolTimeout:
            if _DEADLINE.get() is None:
                raise
            raise DeadlinePassed("no database connection came free in time") from None
        except psycopg.Error as e:
            if is_connection_error(e) and not isinstance(self.pool, NullConnectionPool):
                with contextlib.suppress(Exception):
                    self.pool.check()  # drop the idle connections a restart left dead
            raise

    def _write(self, conn: psycopg.Connection, sql: str, params: Mapping) -> psycopg.Cursor:
        """Execute a write statement that commits by the request's deadline or not at all
        (autocommit: the statement is its transaction). Without a deadline, just execute it."""
        at = _DEADLINE.get()
        if at is None:
            return conn.execute(sql, params)
        offset = self._clock_offset(conn)
        _remaining()  # passed already: send nothing
        by = dt.datetime.fromtimestamp(at + offset, tz=dt.timezone.utc)
        with conn.pipeline():
            conn.execute(
                "SELECT set_config('knownstate.write_deadline', %s, true)", (by.isoformat(),)
            )
            cur = conn.execute(sql, params)
        return cur

    def _clock_offset(self, conn: psycopg.Connection) -> float:
        """Seconds from this process's monotonic clock to the database's ``clock_timestamp()``
        (as an epoch), never more than the true offset: the database read its clock before the
        answer came back. Measured once per connection."""
        offset = self._clock_offsets.get(conn)
        if offset is None:
            (now,) = conn.execute("SELECT clock_timestamp()").fetchone()
            offset = self._clock_offsets[conn] = now.timestamp() - time.monotonic()
        return offset

    def close(self) -> None:
        """Close the pool (its connections and its worker threads); connections from a
        ``connections`` source are their owner's to close."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "DocumentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def kind(self, name: str) -> Kind:
        return kind_of(name, self.kinds)

    def install(self) -> None:
        with boundary("install documents schema"), self._connect() as conn:
            conn.execute(schema_sql(), prepare=False)

    READS = (
        "access",
        "access_kind",
        "missed",
        "owner",
        "all_documents",
        "all_history",
        "applied",
        "created",
        "kind_schema",
    )

    def probe(self) -> None:
        """Run every read query of the store once (nothing matches): raises
        TransactionAborted naming what is missing when the tables found are not the ones the
        queries need (tables of the same names that someone else made)."""
        args = {"id": "", "user": "", "writer": "", "seq": 0}
        with boundary("read the document tables"), self._connect() as conn:
            for name in self.READS:
                sql = self.q[name]
                conn.execute(sql, args if "%(" in sql else None).fetchall()

    # -- administration -------------------------------------------------------------------
    def seed(
        self,
        doc_id: str,
        kind: str,
        schema: Mapping,
        content: Mapping,
        owner: str,
        share: Mapping[str, bool] | None = None,
    ) -> None:
        schema = new_document(kind, schema, content, self.kinds)
        with boundary("seed document"), self._connect() as conn, conn.transaction():
            conn.execute(
                self.q["seed"],
                {
                    "id": doc_id,
                    "kind": kind,
                    "schema": Jsonb(schema),
                    "content": Jsonb(dict(content)),
                    "owner": owner,
                },
            )
            for user, can_write in {owner: True, **dict(share or {})}.items():
                conn.execute(self.q["grant"], {"id": doc_id, "user": user, "can_write": can_write})

    def grant(self, doc_id: str, user: str, can_write: bool) -> None:
        with boundary("grant"), self._connect() as conn:
            conn.execute(self.q["grant"], {"id": doc_id, "user": user, "can_write": can_write})

    def revoke(self, doc_id: str, user: str) -> None:
        with boundary("revoke"), self._connect() as conn:
            conn.execute(self.q["revoke"], {"id": doc_id, "user": user})

    # -- sharing: only the owner changes who may read or write ------------------------------------
    def share(self, owner: str, doc_id: str, user: str, can_write: bool) -> Won | Rejected:
        """Let ``user`` read ``doc_id`` (and write it, with ``can_write``); the owner only."""
        args = {"id": doc_id, "owner": owner, "user": user, "can_write": can_write}
        with boundary("share"), self._connect() as conn:
            row = self._write(conn, self.q["share"], args).fetchone()
            return Won(row[0]) if row else self._not_shared(conn, owner, doc_id, user)

    def unshare(self, owner: str, doc_id: str, user: str) -> Won | Rejected:
        """Take ``user``'s access to ``doc_id`` away; ``Won(False)`` if there was none."""
        args = {"id": doc_id, "owner": owner, "user": user}
        with boundary("unshare"), self._connect() as conn:
            if self._write(conn, self.q["unshare"], args).fetchone():
                return Won(True)
            refused = self._not_shared(conn, owner, doc_id, user)
        return Won(False) if refused is None else refused

    def access_list(self, owner: str, doc_id: str) -> Won | Rejected:
        """Who may read (False) and write (True) ``doc_id``, for its owner."""
        with boundary("access list"), self._connect() as conn:
            row = conn.execute(self.q["owner"], {"id": doc_id, "user": owner}).fetchone()
        if row is None:
            return NOT_FOUND
        return Won(row[1]) if row[0] == owner else NOT_OWNER

    def _not_shared(self, conn, owner: str, doc_id: str, user: str) -> Rejected | None:
        row = conn.execute(self.q["owner"], {"id": doc_id, "user": owner}).fetchone()
        if row is None:
            return NOT_FOUND
        if row[0] != owner:
            return NOT_OWNER
        return OWNER_ACCESS if user == owner else None

    def server_write(self, doc_id: str, patch: Mapping) -> Won | Rejected:
        """The server-side writer (the seed's "AI write"): patch a document at any time; ``None``
        clears an id. One statement; the version goes up like for any write."""
        with boundary("server write"), self._connect() as conn:
            row = conn.execute(self.q["kind_schema"], {"id": doc_id}).fetchone()
            if row is None:
                return NOT_FOUND
            try:
                self.kind(row[0]).validate_patch(row[1], patch)
            except KindError as e:
                return Rejected(f"invalid: {e}")
            out = conn.execute(
                self.q["server_write"], {"id": doc_id, "patch": Jsonb(dict(patch))}
            ).fetchone()
        return Won(Saved(out[0])) if out else NOT_FOUND

    def documents(self, conn: psycopg.Connection | None = None) -> dict[str, DocView]:
        """Every document with its history, in the model's view shape (for projections). A check
        passes its own (unfaulted, kept-open) connection as ``conn``."""
        own = contextlib.nullcontext(conn) if conn is not None else self._connect()
        with boundary("read documents"), own as c:
            docs = c.execute(self.q["all_documents"]).fetchall()
            hist = c.execute(self.q["all_history"]).fetchall()
        by_doc: dict[str, list[HistoryEntry]] = {}
        for doc_id, version, base, author, writer, seq in hist:
            by_doc.setdefault(doc_id, []).append(HistoryEntry(version, base, author, writer, seq))
        return {
            i: DocView(i, kind, version, content, tuple(by_doc.get(i, ())))
            for i, kind, version, content in docs
        }

    def applied(self, request: SaveRequest | CopyRequest) -> int | None:
        """The version a session's save (or copy) produced, or None if it never landed: what a
        check reads to resolve a request whose answer was lost."""
        if isinstance(request, SaveRequest):
            doc_id = request.doc_id
        else:
            doc_id = created_id(request.user, request.writer_id, request.seq)
        args = {"id": doc_id, "user": request.user, "writer": request.writer_id, "seq": request.seq}
        with boundary("read history"), self._connect() as conn:
            row = conn.execute(self.q["applied"], args).fetchone()
        return row[0] if row else None

    def reset(self) -> None:
        with boundary("reset documents"), self._connect() as conn:
            conn.execute(self.q["reset"])

    # -- the operations the HTTP API serves ----------------------------------------------------
    def get(self, user: str, doc_id: str) -> Won | Rejected:
        with boundary("read document"), self._connect() as conn:
            row = conn.execute(self.q["access"], {"id": doc_id, "user": user}).fetchone()
        if row is None:
            return NOT_FOUND
        kind, schema, content, version, _ = row
        return Won(Snapshot(doc_id, kind, schema, version, content))

    def put(
        self,
        user: str,
        doc_id: str,
        expected: int | None,
        content: Mapping,
        writer_id: str,
        seq: int,
    ) -> Won | VersionConflict | SeqTaken | Rejected:
        args = {"id": doc_id, "user": user}
        with boundary("save document"), self._connect() as conn:
            row = conn.execute(self.q["access_kind"], args).fetchone()
            if row is None:
                return NOT_FOUND  # authorization first: nothing revealed
            kind, schema, can_write = row
            if not can_write:
                return FORBIDDEN
            if expected is None:
                return PRECONDITION_REQUIRED
            try:
                self.kind(kind).validate_content(schema, content)
            except KindError as e:
                return Rejected(f"invalid: {e}")
            fp = save_fingerprint(user, expected, content)
            args.update(writer=writer_id, seq=seq, expected=expected, fingerprint=fp)
            saved = self._swap(conn, {**args, "content": Jsonb(dict(content))})
            if saved is not None:
                return saved
            # The CAS missed: access lost meanwhile, this save identity saved before (a retry,
            # answered from its receipt, or a reuse), or a stale base (409 with the stored copy).
            return self._missed(conn.execute(self.q["missed"], args).fetchone(), args)

    def _swap(self, conn: psycopg.Connection, args: Mapping) -> Won | SeqTaken | None:
        """The compare-and-swap of a save: the one conditional UPDATE (``save``). ``Won(Saved)``
        when it landed, None when it missed (:meth:`_missed` then reads why)."""
        row = self._write(conn, self.q["save"], args).fetchone()
        return Won(Saved(row[0])) if row is not None else None

    @staticmethod
    def _missed(row: tuple | None, args: Mapping) -> Won | VersionConflict | SeqTaken | Rejected:
        """What a save whose compare-and-swap missed is answered, from the ``missed`` row read
        after it: its receipt when its identity saved before, else why it could not land."""
        if row is None:
            return NOT_FOUND
        can_write, receipt_fp, receipt_version, last_seq, version, stored = row
        if not can_write:
            return FORBIDDEN
        if receipt_fp is not None:
            if receipt_fp == args["fingerprint"]:
                return Won(Saved(receipt_version, replayed=True))
            writer, seq = args["writer"], args["seq"]
            return SeqTaken("save_seq_taken", writer, seq, receipt_version, last_seq)
        return VersionConflict("version_conflict", version, stored)

    def create(
        self,
        user: str,
        writer_id: str,
        seq: int,
        content: Mapping,
        *,
        copy_of: str | None = None,
        kind: str | None = None,
        schema: Mapping | None = None,
    ) -> Won | Rejected:
        with boundary("create document"), self._connect() as conn:
            if copy_of is not None:
                row = conn.execute(self.q["access_kind"], {"id": copy_of, "user": user}).fetchone()
                if row is None:
                    return NOT_FOUND
                kind, schema = row[0], row[1]
            try:
                schema = new_document(kind, schema, content, self.kinds)
            except KindError as e:
                return Rejected(f"invalid: {e}")
            new_id = created_id(user, writer_id, seq)
            fp = create_fingerprint(user, kind, schema, content)
            args = {"id": new_id, "user": user, "writer": writer_id, "seq": seq}
            row = self._write(
                conn,
                self.q["create"],
                {
                    **args,
                    "kind": kind,
                    "schema": Jsonb(schema),
                    "content": Jsonb(dict(content)),
                    "fingerprint": fp,
                },
            ).fetchone()
            if row is not None:
                return Won(Created(new_id, 1))
            existing = conn.execute(self.q["created"], args).fetchone()
        if existing is not None and existing[0] == fp:
            return Won(Created(new_id, 1, replayed=True))
        return Rejected("create_conflict")
