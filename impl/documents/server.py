"""The document server: compare-and-swap saves over PostgreSQL, behind a small HTTP API.

HTTP contract (the OpenAPI document is served at ``/openapi.json``):

``GET /api/desk/files/{id}``
    ``200 {"id", "kind", "schema", "version", "content"}`` with ``ETag: "<version>"``.
``PUT /api/desk/files/{id}``
    Body ``{"expectedVersion", "content", "writerId", "saveSeq"}``; the base version may come as
    ``If-Match: "<version>"`` instead. One conditional UPDATE. ``200 {"id", "version",
    "replayed"}``; a stale base ``409 {"error": "version_conflict", "version", "content"}`` with
    the stored version and content; no base ``428``; a retry of an applied save (same writer,
    seq and request) gets the original success with ``"replayed": true``.
``POST /api/desk/files``
    Body ``{"content", "writerId", "saveSeq"}`` plus ``"copyOf"`` (keep a local copy as a new
    document) or ``"kind"`` and ``"schema"``. ``201 {"id", "version", "replayed"}``; the id derives
    from (user, writer, seq), so a retried create makes no duplicate.

Every request names its user in ``X-User`` (``401`` without). Authorization comes before any
version check: a user without an ACL row gets ``404`` and learns nothing, not even the version;
a reader's write is ``403``. Bad input is a ``4xx`` whose ``message`` names the problem and
changes nothing: ``413`` for a body over 64 KiB, ``422`` for wrong shapes, unknown ids, and
negative or non-integer versions. A database that cannot be reached is ``503``.

The store (:class:`DocumentStore`) speaks the model's outcome vocabulary
(:mod:`knownstate.model.document`), so a check compares it with the model directly; the HTTP
layer only maps outcomes to status codes.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Annotated, Literal, Mapping, Union

import psycopg
import uvicorn
from fastapi import FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from psycopg.types.json import Jsonb
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from knownstate.chaos import tools
from knownstate.impl import queries
from knownstate.impl.errors import KnownstateError, boundary
from knownstate.model.contract import Rejected, Won
from knownstate.model.document import (
    FORBIDDEN,
    ID_PATTERN,
    MAX_BODY_BYTES,
    MAX_KEYS,
    MAX_VERSION,
    NOT_FOUND,
    PRECONDITION_REQUIRED,
    USER_PATTERN,
    WRITER_PATTERN,
    CopyRequest,
    Created,
    DocView,
    HistoryEntry,
    KindError,
    Saved,
    SaveRequest,
    Snapshot,
    VersionConflict,
    create_fingerprint,
    created_id,
    kind_of,
    save_fingerprint,
)

Q = queries.load("documents.sql")


def schema_sql() -> str:
    return queries.schema("documents_schema.sql")


# ---------------------------------------------------------------------------------------
# The store: SQL on psycopg 3, one connection per call (the DSN may be a Toxiproxy link).
# ---------------------------------------------------------------------------------------


class DocumentStore:
    """``queries`` replaces the named SQL (the mutant catalogue swaps single queries)."""

    def __init__(self, dsn: str, *, connect_timeout: float = 3.0, queries: Mapping[str, str] | None = None):
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.q = dict(queries) if queries is not None else Q

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, round(self.connect_timeout)))

    def install(self) -> None:
        with boundary("install documents schema"), self._connect() as conn:
            conn.execute(schema_sql())

    # -- administration -------------------------------------------------------------------------
    def seed(self, doc_id: str, kind: str, schema: Mapping, content: Mapping, owner: str,
             share: Mapping[str, bool] | None = None) -> None:
        k = kind_of(kind)
        schema = k.validate_schema(schema)
        k.validate_content(schema, content)
        with boundary("seed document"), self._connect() as conn, conn.transaction():
            conn.execute(self.q["seed"], {"id": doc_id, "kind": kind, "schema": Jsonb(schema),
                                     "content": Jsonb(dict(content)), "owner": owner})
            for user, can_write in {owner: True, **dict(share or {})}.items():
                conn.execute(self.q["grant"], {"id": doc_id, "user": user, "can_write": can_write})

    def grant(self, doc_id: str, user: str, can_write: bool) -> None:
        with boundary("grant"), self._connect() as conn:
            conn.execute(self.q["grant"], {"id": doc_id, "user": user, "can_write": can_write})

    def revoke(self, doc_id: str, user: str) -> None:
        with boundary("revoke"), self._connect() as conn:
            conn.execute(self.q["revoke"], {"id": doc_id, "user": user})

    def server_write(self, doc_id: str, patch: Mapping) -> Won | Rejected:
        """The server-side writer (the seed's "AI write"): patch a document at any time; ``None``
        clears an id. One statement; the version goes up like for any write."""
        with boundary("server write"), self._connect() as conn:
            row = conn.execute(self.q["kind_schema"], {"id": doc_id}).fetchone()
            if row is None:
                return NOT_FOUND
            try:
                kind_of(row[0]).validate_patch(row[1], patch)
            except KindError as e:
                return Rejected(f"invalid: {e}")
            out = conn.execute(self.q["server_write"], {"id": doc_id, "patch": Jsonb(dict(patch))}).fetchone()
        return Won(Saved(out[0])) if out else NOT_FOUND

    def documents(self, conn: psycopg.Connection | None = None) -> dict[str, DocView]:
        """Every document with its history, in the model's view shape (for projections). A check
        passes its own (unfaulted, kept-open) connection as ``conn``."""
        with boundary("read documents"), (contextlib.nullcontext(conn) if conn is not None else self._connect()) as c:
            docs = c.execute(self.q["all_documents"]).fetchall()
            hist = c.execute(self.q["all_history"]).fetchall()
        by_doc: dict[str, list[HistoryEntry]] = {}
        for doc_id, version, base, author, writer, seq in hist:
            by_doc.setdefault(doc_id, []).append(HistoryEntry(version, base, author, writer, seq))
        return {i: DocView(i, kind, version, content, tuple(by_doc.get(i, ()))) for i, kind, version, content in docs}

    def applied(self, request: SaveRequest | CopyRequest) -> int | None:
        """The version a session's save (or copy) produced, or None if it never landed: what a
        check reads to resolve a request whose answer was lost."""
        if isinstance(request, SaveRequest):
            doc_id = request.doc_id
        else:
            doc_id = created_id(request.user, request.writer_id, request.seq)
        with boundary("read history"), self._connect() as conn:
            row = conn.execute(self.q["applied"], {"id": doc_id, "writer": request.writer_id,
                                              "seq": request.seq}).fetchone()
        return row[0] if row else None

    def reset(self) -> None:
        with boundary("reset documents"), self._connect() as conn:
            conn.execute(self.q["reset"])

    # -- the operations the HTTP API serves --------------------------------------------------------
    def get(self, user: str, doc_id: str) -> Won | Rejected:
        with boundary("read document"), self._connect() as conn:
            row = conn.execute(self.q["access"], {"id": doc_id, "user": user}).fetchone()
        if row is None:
            return NOT_FOUND
        kind, schema, content, version, _ = row
        return Won(Snapshot(doc_id, kind, schema, version, content))

    def put(self, user: str, doc_id: str, expected: int | None, content: Mapping, writer_id: str,
            seq: int) -> Won | VersionConflict | Rejected:
        args = {"id": doc_id, "user": user}
        with boundary("save document"), self._connect() as conn:
            row = conn.execute(self.q["access"], args).fetchone()
            if row is None:
                return NOT_FOUND
            kind, schema, _, _, can_write = row
            if not can_write:
                return FORBIDDEN
            if expected is None:
                return PRECONDITION_REQUIRED
            try:
                kind_of(kind).validate_content(schema, content)
            except KindError as e:
                return Rejected(f"invalid: {e}")
            fp = save_fingerprint(user, expected, content)
            saved = conn.execute(self.q["save"], {**args, "expected": expected, "content": Jsonb(dict(content)),
                                             "writer": writer_id, "seq": seq, "fingerprint": fp}).fetchone()
            if saved is not None:
                return Won(Saved(saved[0]))
            # The CAS missed. Tell apart: access lost meanwhile, a retry of a save already applied
            # (answered from its receipt), and a stale base (409 with the stored copy).
            row = conn.execute(self.q["access"], args).fetchone()
            if row is None:
                return NOT_FOUND
            if not row[4]:
                return FORBIDDEN
            receipt = conn.execute(self.q["receipt"], {"id": doc_id, "writer": writer_id}).fetchone()
            if receipt is not None and receipt[0] == seq and receipt[1] == fp:
                return Won(Saved(receipt[2], replayed=True))
            version, stored = conn.execute(self.q["current"], {"id": doc_id}).fetchone()
        return VersionConflict("version_conflict", version, stored)

    def create(self, user: str, writer_id: str, seq: int, content: Mapping, *, copy_of: str | None = None,
               kind: str | None = None, schema: Mapping | None = None) -> Won | Rejected:
        with boundary("create document"), self._connect() as conn:
            if copy_of is not None:
                row = conn.execute(self.q["access"], {"id": copy_of, "user": user}).fetchone()
                if row is None:
                    return NOT_FOUND
                kind, schema = row[0], row[1]
            try:
                k = kind_of(kind or "")
                schema = k.validate_schema(schema)
                k.validate_content(schema, content)
            except KindError as e:
                return Rejected(f"invalid: {e}")
            new_id = created_id(user, writer_id, seq)
            fp = create_fingerprint(user, kind, schema, content)
            row = conn.execute(self.q["create"], {"id": new_id, "kind": kind, "schema": Jsonb(schema),
                                             "content": Jsonb(dict(content)), "user": user, "fingerprint": fp,
                                             "writer": writer_id, "seq": seq}).fetchone()
            if row is not None:
                return Won(Created(new_id, 1))
            existing = conn.execute(self.q["created"], {"id": new_id}).fetchone()
        if existing is not None and existing[0] == fp:
            return Won(Created(new_id, 1, replayed=True))
        return Rejected("create_conflict")


# ---------------------------------------------------------------------------------------
# HTTP bodies (pydantic at the boundary).
# ---------------------------------------------------------------------------------------

Version = Annotated[int, Field(strict=True, ge=1, le=MAX_VERSION)]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Scalar = Union[StrictBool, StrictInt, FiniteFloat, StrictStr]
ContentBody = Annotated[dict[str, Scalar], Field(max_length=MAX_KEYS)]


class SaveBody(BaseModel):
    """A save: the full content, the version it was based on, and the save's identity."""

    model_config = ConfigDict(extra="forbid")
    expectedVersion: Version | None = None
    content: ContentBody
    writerId: Annotated[str, Field(pattern=WRITER_PATTERN)]
    saveSeq: Version


class CreateBody(BaseModel):
    """A new document: a copy of one the user may read (``copyOf``), or a given kind and schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    content: ContentBody
    writerId: Annotated[str, Field(pattern=WRITER_PATTERN)]
    saveSeq: Version
    copyOf: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    kind: Literal["record", "sheet"] | None = None
    schema_: dict | None = Field(default=None, alias="schema")


class DocumentOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    id: str
    kind: str
    schema_: dict = Field(alias="schema")
    version: int
    content: dict


class SavedOut(BaseModel):
    id: str
    version: int
    replayed: bool


class ErrorOut(BaseModel):
    error: str
    message: str


class ConflictOut(ErrorOut):
    version: int
    content: dict


UserHeader = Annotated[str | None, Header(alias="X-User", description="The user making the request.")]
IdPath = Annotated[str, Path(pattern=ID_PATTERN)]

_IF_MATCH = re.compile(r'\s*"([0-9]{1,19})"\s*')

_MESSAGES = {
    "not_found": (404, "no such document"),
    "forbidden": (403, "you may read this document but not write it"),
    "precondition_required": (428, 'a save must carry its base version: "expectedVersion" in the body or '
                                   'If-Match: "<version>"'),
    "create_conflict": (409, "this (writerId, saveSeq) already created a different document"),
}


def _error(status: int, error: str, message: str, headers: dict | None = None, **extra) -> JSONResponse:
    return JSONResponse({"error": error, "message": message, **extra}, status_code=status, headers=headers)


def _rejected(r: Rejected) -> JSONResponse:
    if r.reason.startswith("invalid: "):
        return _error(422, "invalid_content", r.reason.removeprefix("invalid: "))
    status, message = _MESSAGES.get(r.reason, (400, r.reason))
    return _error(status, r.reason, message)


def _user(x_user: str | None) -> str | None:
    if x_user is None or not re.fullmatch(USER_PATTERN, x_user):
        return None
    return x_user


def _unauthenticated() -> JSONResponse:
    return _error(401, "unauthenticated", "name the user in the X-User header ([A-Za-z0-9_.@-]{1,64})")


def _describe(errors) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(ascii(p) if not isinstance(p, str) or not p.isidentifier() else p
                       for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {ascii(e.get('msg', 'invalid'))[1:-1]}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, before anything reads it whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body"):
                break
        whole, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = _error(413, "body_too_large", f"the request body is over {self.limit} bytes")
        await response(scope, receive, send)


def create_app(dsn: str, *, max_body_bytes: int = MAX_BODY_BYTES, connect_timeout: float = 3.0) -> FastAPI:
    """The ASGI app serving the document API over the database at ``dsn`` (which may be a
    Toxiproxy link). The schema must be installed (:meth:`DocumentStore.install`). The routes
    use ``app.state.store`` per request, so a check may swap in another store between requests."""
    store = DocumentStore(dsn, connect_timeout=connect_timeout)
    app = FastAPI(title="knownstate documents", version="1",
                  description="Versioned documents: compare-and-swap saves, explicit conflicts.")
    app.state.store = store
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        return _error(422, "invalid_request", _describe(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}
        return _error(exc.status_code, codes.get(exc.status_code, "http_error"), ascii(str(exc.detail))[1:-1],
                      headers=getattr(exc, "headers", None))

    @app.exception_handler(KnownstateError)
    async def unavailable(_request: Request, exc: KnownstateError):
        return _error(503, "unavailable", "the document store is unreachable; retry the same request")

    common = {401: {"model": ErrorOut}, 404: {"model": ErrorOut}, 422: {"model": ErrorOut},
              503: {"model": ErrorOut}}

    @app.get("/api/desk/files/{id}", responses={200: {"model": DocumentOut}, **common},
             response_model=None, summary="Read a document")
    def read_document(id: IdPath, x_user: UserHeader = None):
        user = _user(x_user)
        if user is None:
            return _unauthenticated()
        out = app.state.store.get(user, id)
        if isinstance(out, Rejected):
            return _rejected(out)
        snap: Snapshot = out.value
        return JSONResponse({"id": snap.id, "kind": snap.kind, "schema": snap.schema, "version": snap.version,
                             "content": snap.content}, headers={"ETag": f'"{snap.version}"'})

    @app.put("/api/desk/files/{id}",
             responses={200: {"model": SavedOut}, 403: {"model": ErrorOut}, 409: {"model": ConflictOut},
                        413: {"model": ErrorOut}, 428: {"model": ErrorOut}, **common},
             response_model=None, summary="Save a document against its base version")
    def save_document(id: IdPath, body: SaveBody, x_user: UserHeader = None,
                      if_match: Annotated[str | None, Header(alias="If-Match")] = None):
        user = _user(x_user)
        if user is None:
            return _unauthenticated()
        expected = body.expectedVersion
        if if_match is not None:
            m = _IF_MATCH.fullmatch(if_match)
            if m is None or not 1 <= int(m.group(1)) <= MAX_VERSION:
                return _error(422, "invalid_request", 'If-Match must be one quoted version, like "3"')
            if expected is not None and expected != int(m.group(1)):
                return _error(422, "invalid_request", "If-Match and expectedVersion name different versions")
            expected = int(m.group(1))
        out = app.state.store.put(user, id, expected, body.content, body.writerId, body.saveSeq)
        if isinstance(out, VersionConflict):
            return _error(409, "version_conflict", "the document changed since your base version",
                          version=out.version, content=out.content)
        if isinstance(out, Rejected):
            return _rejected(out)
        saved: Saved = out.value
        return JSONResponse({"id": id, "version": saved.version, "replayed": saved.replayed},
                            headers={"ETag": f'"{saved.version}"'})

    @app.post("/api/desk/files", status_code=201,
              responses={201: {"model": SavedOut}, 409: {"model": ErrorOut}, 413: {"model": ErrorOut}, **common},
              response_model=None, summary="Create a document (or keep a local copy as a new one)")
    def create_document(body: CreateBody, x_user: UserHeader = None):
        user = _user(x_user)
        if user is None:
            return _unauthenticated()
        if body.copyOf is None and body.kind is None:
            return _error(422, "invalid_request", 'name "copyOf", or "kind" and "schema"')
        if body.copyOf is not None and (body.kind is not None or body.schema_ is not None):
            return _error(422, "invalid_request", '"copyOf" takes the kind and schema of the original: '
                                                  'do not send "kind" or "schema" with it')
        out = app.state.store.create(user, body.writerId, body.saveSeq, body.content, copy_of=body.copyOf,
                           kind=body.kind, schema=body.schema_)
        if isinstance(out, Rejected):
            return _rejected(out)
        c: Created = out.value
        return JSONResponse({"id": c.id, "version": c.version, "replayed": c.replayed},
                            status_code=200 if c.replayed else 201,
                            headers={"Location": f"/api/desk/files/{c.id}", "ETag": f'"{c.version}"'})

    return app


# ---------------------------------------------------------------------------------------
# Running it: uvicorn on a free loopback port, in a background thread.
# ---------------------------------------------------------------------------------------


class DocumentServer:
    """The document API served by uvicorn in a background thread. ``start()``/``stop()`` or
    ``with DocumentServer(dsn) as server: ... server.url``."""

    def __init__(self, dsn: str, *, host: str = "127.0.0.1", port: int | None = None, **app_options):
        self.dsn, self.host, self.port = dsn, host, port
        self.app = create_app(dsn, **app_options)
        self.store: DocumentStore = self.app.state.store
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "DocumentServer":
        self.port = self.port or tools.free_port()
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"documents:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the document server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)

    def __enter__(self) -> "DocumentServer":
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
