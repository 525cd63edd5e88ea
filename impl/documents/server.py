"""The document server: the HTTP API over :class:`~.store.DocumentStore`.

HTTP contract (the OpenAPI document is served at ``/openapi.json``):

``GET /api/desk/files/{id}``
    ``200 {"id", "kind", "schema", "version", "content"}`` with ``ETag: "<version>"``.
``PUT /api/desk/files/{id}``
    Body ``{"expectedVersion", "content", "writerId", "saveSeq"}``; the base version may come as
    ``If-Match: "<version>"`` instead. One conditional UPDATE. ``200 {"id", "version",
    "replayed"}``; a stale base ``409 {"error": "version_conflict", "version", "content"}`` with
    the stored version and content (``412 precondition_failed``, same body, when the base came
    as ``If-Match``); no base ``428``; a retry of an applied save (same user, writer, seq and
    request) gets the original success with ``"replayed": true``; the same (writer, seq) with
    other content ``409 save_seq_taken`` naming the receipt.
``POST /api/desk/files``
    Body ``{"content", "writerId", "saveSeq"}`` plus ``"copyOf"`` (keep a local copy as a new
    document) or ``"kind"`` and ``"schema"``. ``201 {"id", "version", "replayed"}``; the id derives
    from (user, writer, seq), so a retried create makes no duplicate.

Every request names its user in ``X-User`` (``401`` without): a stand-in for authentication,
see the README. Authorization comes before any version check: a user without an ACL row gets
``404`` and learns nothing, not even the version; a reader's write is ``403``. Bad input is a
``4xx`` in one format, ``{"error", "message"}``, whose message names the problem, and changes
nothing (how a request is read: :mod:`.reading`). A database that cannot be reached is ``503``.
"""

from __future__ import annotations

import inspect
import re
import threading
import time
import typing
from typing import Annotated, Literal, Union

import uvicorn
from fastapi import FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from knownstate.impl.errors import KnownstateError
from knownstate.impl.ports import free_port
from knownstate.model.contract import Rejected, Won
from knownstate.model.document import (
    ID_PATTERN,
    MAX_BODY_BYTES,
    MAX_KEYS,
    MAX_VERSION,
    USER_PATTERN,
    WRITER_PATTERN,
    Created,
    Saved,
    SeqTaken,
    Snapshot,
    VersionConflict,
)

from .reading import BadRequest, RequestReader, error
from .store import DocumentStore, schema_sql

__all__ = ["DocumentServer", "create_app", "schema_sql"]


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
    """A new document: a copy of one the user may read (``copyOf``), or a kind and schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    content: ContentBody
    writerId: Annotated[str, Field(pattern=WRITER_PATTERN)]
    saveSeq: Version
    copyOf: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    kind: Literal["record", "sheet"] | None = None
    schema_: dict | None = Field(default=None, alias="schema")


class ShareBody(BaseModel):
    """What a user may do with a shared document: read it, and write it when ``canWrite``."""

    model_config = ConfigDict(extra="forbid")
    canWrite: StrictBool


class SharedOut(BaseModel):
    id: str
    user: str
    canWrite: bool


class RevokedOut(BaseModel):
    id: str
    user: str
    revoked: bool


class AccessOut(BaseModel):
    id: str
    owner: str
    access: dict[str, bool]


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


UserHeader = Annotated[
    str | None,
    Header(
        alias="X-User",
        description="The user making the request: a stand-in for authentication (see the README).",
    ),
]
IfMatchHeader = Annotated[
    str | None, Header(alias="If-Match", description='The base version as its ETag, "3".')
]
IdPath = Annotated[str, Path(pattern=ID_PATTERN)]
UserPath = Annotated[str, Path(pattern=USER_PATTERN)]

_MESSAGES = {
    "not_found": (404, "no such document"),
    "forbidden": (403, "you may read this document but not write it"),
    "precondition_required": (
        428,
        'a save must carry its base version: "expectedVersion" in '
        'the body or If-Match: "<version>"',
    ),
    "create_conflict": (
        409,
        "this (writerId, saveSeq) already created a different document: send a new saveSeq",
    ),
    "not_owner": (403, "only the document's owner may see or change who has access to it"),
    "owner_access": (422, "the owner's own access cannot change: name another user"),
}
_STATUS_NAMES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


def _won(out: Won | Rejected):
    """The value of a store's success; a refusal becomes its 4xx (raised, answered in the one
    format by the app's handler)."""
    if not isinstance(out, Rejected):
        return out.value
    if out.reason.startswith("invalid: "):
        raise BadRequest(422, "invalid_content", out.reason.removeprefix("invalid: "))
    status, message = _MESSAGES.get(out.reason, (400, out.reason))
    raise BadRequest(status, out.reason, message)


def _seq_taken(t: SeqTaken):
    return error(
        409,
        "save_seq_taken",
        f"writerId {t.writer_id!r} already used saveSeq {t.seq} for other content "
        f"(it saved version {t.version}): a save identity names one save; send the "
        f"same request to retry it, or new content with saveSeq {t.last_seq + 1}",
        receipt={"writerId": t.writer_id, "saveSeq": t.seq, "version": t.version},
        lastSeq=t.last_seq,
    )


def _ok(body: dict, version: int, status: int = 200, **headers) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers={"ETag": f'"{version}"', **headers})


def _describe(errors) -> str:
    parts = []
    for e in errors[:5]:
        loc = (
            ".".join(
                ascii(p) if not isinstance(p, str) or not p.isidentifier() else p
                for p in e.get("loc", ())
                if p != "body"
            )
            or "body"
        )
        parts.append(f"{loc}: {ascii(e.get('msg', 'invalid'))[1:-1]}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


# ---------------------------------------------------------------------------------------
# Routes: FastAPI declares them (the OpenAPI document); a lean handler runs them.
# ---------------------------------------------------------------------------------------


class _LeanRoute(APIRoute):
    """A route FastAPI declares but does not run. What it does per request is only this: read
    the body strictly (the :class:`RequestReader`), check the path's document id in full,
    validate the body with its pydantic model, and call the endpoint in the threadpool with
    them (headers it reads itself, through the reader). Everything else — which model, which
    arguments — is worked out once, here, when the route is built; FastAPI's per-request
    dependency solving is not on the path of a save."""

    def get_route_handler(self):
        endpoint = self.endpoint
        hints = typing.get_type_hints(endpoint)
        params = inspect.signature(endpoint).parameters
        path_names = [n for n in params if "{" + n + "}" in self.path]
        models = [(n, _body_model(hints.get(n))) for n in params]
        body_name, body_model = next(((n, m) for n, m in models if m is not None), (None, None))

        async def handle(request: Request):
            try:
                kwargs: dict = {"request": request}
                for name in path_names:
                    value, (what, pattern) = request.path_params[name], _PATH[name]
                    if not re.fullmatch(pattern, value):
                        raise BadRequest(
                            422,
                            "invalid_request",
                            f"path.{name}: {ascii(value)} is not a {what} ({pattern})",
                        )
                    kwargs[name] = value
                if body_model is not None:
                    reader: RequestReader = request.app.state.reader
                    value = reader.body(request.headers, await request.body())
                    kwargs[body_name] = body_model.model_validate(value)
            except BadRequest as e:
                return e.response()
            except ValidationError as e:
                return error(422, "invalid_request", _describe(e.errors()))
            return await run_in_threadpool(endpoint, **kwargs)

        return handle


_PATH = {"id": ("document id", ID_PATTERN), "user": ("user name", USER_PATTERN)}
"""Every path parameter, and the pattern it must match in full."""


def _body_model(annotation) -> type[BaseModel] | None:
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_model else None


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
        response = error(413, "body_too_large", f"the request body is over {self.limit} bytes")
        await response(scope, receive, send)


# ---------------------------------------------------------------------------------------
# The app.
# ---------------------------------------------------------------------------------------


def create_app(
    store: DocumentStore,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    reader: RequestReader | None = None,
) -> FastAPI:
    """The ASGI app serving the document API from ``store`` (whose schema must be installed).
    The routes use ``app.state.store`` and ``app.state.reader`` per request, so a check may
    swap either between requests (:meth:`DocumentServer.use`)."""
    app = FastAPI(
        title="knownstate documents",
        version="1",
        description="Versioned documents: compare-and-swap saves, explicit conflicts.",
    )
    app.router.route_class = _LeanRoute
    app.state.store = store
    app.state.reader = reader or RequestReader()
    app.router.redirect_slashes = app.state.reader.redirect_slashes
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        return error(422, "invalid_request", _describe(exc.errors()))

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        headers = getattr(exc, "headers", None)
        message = ascii(str(exc.detail))[1:-1]
        if exc.status_code == 404:
            message = (
                f"no route {ascii(request.url.path)[1:-1]}: the API is GET and PUT "
                "/api/desk/files/{id}, POST /api/desk/files (no trailing slash)"
            )
        elif exc.status_code == 405:
            allowed = (headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on this route: use {allowed}"
        return error(
            exc.status_code,
            _STATUS_NAMES.get(exc.status_code, "http_error"),
            message,
            headers=headers,
        )

    @app.exception_handler(KnownstateError)
    async def unavailable(_request: Request, exc: KnownstateError):
        return error(
            503, "unavailable", "the document store is unreachable; retry the same request"
        )

    common = {
        400: {"model": ErrorOut},
        401: {"model": ErrorOut},
        404: {"model": ErrorOut},
        422: {"model": ErrorOut},
        503: {"model": ErrorOut},
    }
    writes = {403: {"model": ErrorOut}, 413: {"model": ErrorOut}, 415: {"model": ErrorOut}}

    def user_of(request: Request) -> str:
        """Who the request acts for (``X-User``, read strictly), or a 401."""
        user = app.state.reader.user(request.headers)
        if user is None:
            raise BadRequest(
                401, "unauthenticated", "name the user in one X-User header ([A-Za-z0-9_.@-]{1,64})"
            )
        return user

    @app.get(
        "/api/desk/files/{id}",
        responses={200: {"model": DocumentOut}, **common},
        response_model=None,
        summary="Read a document",
    )
    def read_document(id: IdPath, request: Request, x_user: UserHeader = None):
        snap: Snapshot = _won(app.state.store.get(user_of(request), id))
        return _ok(
            {
                "id": snap.id,
                "kind": snap.kind,
                "schema": snap.schema,
                "version": snap.version,
                "content": snap.content,
            },
            snap.version,
        )

    @app.put(
        "/api/desk/files/{id}",
        responses={
            200: {"model": SavedOut},
            409: {"model": ConflictOut},
            412: {"model": ConflictOut},
            428: {"model": ErrorOut},
            **writes,
            **common,
        },
        response_model=None,
        summary="Save a document against its base version",
    )
    def save_document(
        id: IdPath,
        body: SaveBody,
        request: Request,
        x_user: UserHeader = None,
        if_match: IfMatchHeader = None,
    ):
        user = user_of(request)
        expected, tag = body.expectedVersion, app.state.reader.if_match(request.headers)
        if tag is not None:
            if expected is not None and expected != tag.version:
                raise BadRequest(
                    400,
                    "bad_request",
                    "If-Match and expectedVersion name different versions: send one of them",
                )
            expected = tag.version if tag.version is not None else 0  # 0: no version's ETag
        out = app.state.store.put(user, id, expected, body.content, body.writerId, body.saveSeq)
        if isinstance(out, VersionConflict):
            if tag is not None:
                return error(
                    412,
                    "precondition_failed",
                    f'If-Match {tag.tag} does not match the current ETag "{out.version}"',
                    version=out.version,
                    content=out.content,
                )
            return error(
                409,
                "version_conflict",
                "the document changed since your base version",
                version=out.version,
                content=out.content,
            )
        if isinstance(out, SeqTaken):
            return _seq_taken(out)
        saved: Saved = _won(out)
        return _ok({"id": id, "version": saved.version, "replayed": saved.replayed}, saved.version)

    @app.post(
        "/api/desk/files",
        status_code=201,
        responses={201: {"model": SavedOut}, 409: {"model": ErrorOut}, **writes, **common},
        response_model=None,
        summary="Create a document (or keep a local copy as a new one)",
    )
    def create_document(body: CreateBody, request: Request, x_user: UserHeader = None):
        user = user_of(request)
        if body.copyOf is None and body.kind is None:
            return error(422, "invalid_request", 'name "copyOf", or "kind" and "schema"')
        if body.copyOf is not None and (body.kind is not None or body.schema_ is not None):
            return error(
                422,
                "invalid_request",
                '"copyOf" takes the kind and schema of the '
                'original: do not send "kind" or "schema" with it',
            )
        c: Created = _won(
            app.state.store.create(
                user,
                body.writerId,
                body.saveSeq,
                body.content,
                copy_of=body.copyOf,
                kind=body.kind,
                schema=body.schema_,
            )
        )
        return _ok(
            {"id": c.id, "version": c.version, "replayed": c.replayed},
            c.version,
            status=200 if c.replayed else 201,
            Location=f"/api/desk/files/{c.id}",
        )

    # -- sharing: the owner decides who may read and who may write -----------------------------
    owner_only = {403: {"model": ErrorOut}, **common}

    @app.put(
        "/api/desk/files/{id}/acl/{user}",
        responses={200: {"model": SharedOut}, **writes, **owner_only},
        response_model=None,
        summary="Share a document: let a user read it, or write it",
    )
    def share_document(
        id: IdPath, user: UserPath, body: ShareBody, request: Request, x_user: UserHeader = None
    ):
        can_write = _won(app.state.store.share(user_of(request), id, user, body.canWrite))
        return JSONResponse({"id": id, "user": user, "canWrite": can_write})

    @app.delete(
        "/api/desk/files/{id}/acl/{user}",
        responses={200: {"model": RevokedOut}, **owner_only},
        response_model=None,
        summary="Stop sharing a document with a user",
    )
    def unshare_document(id: IdPath, user: UserPath, request: Request, x_user: UserHeader = None):
        revoked = _won(app.state.store.unshare(user_of(request), id, user))
        return JSONResponse({"id": id, "user": user, "revoked": revoked})

    @app.get(
        "/api/desk/files/{id}/acl",
        responses={200: {"model": AccessOut}, **owner_only},
        response_model=None,
        summary="Who may read (false) and write (true) a document",
    )
    def access_list(id: IdPath, request: Request, x_user: UserHeader = None):
        owner = user_of(request)
        access = _won(app.state.store.access_list(owner, id))
        return JSONResponse({"id": id, "owner": owner, "access": access})

    return app


# ---------------------------------------------------------------------------------------
# Running it: uvicorn on a free loopback port, in a background thread.
# ---------------------------------------------------------------------------------------


class DocumentServer:
    """The document API served by uvicorn in a background thread. ``start()``/``stop()`` or
    ``with DocumentServer(dsn) as server: ... server.url``. The server owns its store and
    closes it when it stops."""

    def __init__(
        self,
        dsn: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        connect_timeout: float = 3.0,
        pool_size: int | None = 8,
        **app_options,
    ):
        self.dsn, self.host, self.port = dsn, host, port
        store = DocumentStore(dsn, connect_timeout=connect_timeout, pool_size=pool_size)
        self.app = create_app(store, **app_options)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def store(self) -> DocumentStore:
        return self.app.state.store

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def use(self, store: DocumentStore | None = None, reader: RequestReader | None = None) -> None:
        """Serve the next requests from ``store`` and read them with ``reader`` (a check swaps
        in a mutant between examples); the store replaced is closed."""
        if store is not None and store is not self.app.state.store:
            old, self.app.state.store = self.app.state.store, store
            old.close()
        if reader is not None:
            self.app.state.reader = reader
            self.app.router.redirect_slashes = reader.redirect_slashes

    def start(self) -> "DocumentServer":
        self.port = self.port or free_port()
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name=f"documents:{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the document server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C interrupts the wait)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
        self.store.close()

    def __enter__(self) -> "DocumentServer":
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
