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
nothing (how a request is read: :mod:`.reading`). A database that cannot be reached is ``503``,
and so is a request not answered within its deadline (``Limits.request_seconds``): a write that
had not committed by then never will (:func:`.store.deadline`). ``HEAD`` is served on every
``GET`` route. The HTTP layer's own refusals (bad HTTP, oversized heads, slow clients, Host) are
in the same format (:mod:`.http`). The bodies are declared in :mod:`.bodies`; how a route runs
(deadline, body limit) is in :mod:`.routes`.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from knownstate.impl.errors import KnownstateError
from knownstate.model.contract import Rejected, Won
from knownstate.model.document import (
    MAX_BODY_BYTES,
    Created,
    Saved,
    SeqTaken,
    Snapshot,
    VersionConflict,
)

from . import store as store_impl
from .bodies import (
    AccessOut,
    ConflictOut,
    CreateBody,
    DocumentOut,
    ErrorOut,
    IdPath,
    IfMatchHeader,
    RevokedOut,
    SavedOut,
    SaveBody,
    SharedOut,
    ShareBody,
    UserHeader,
    UserPath,
)
from .http import Limits, protocol
from .reading import BadRequest, RequestReader, error
from .routes import BodyLimit, LeanRoute, describe_errors, late_answer
from .store import DocumentStore, schema_sql

__all__ = ["DocumentServer", "Limits", "ListenError", "create_app", "schema_sql"]

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


# ---------------------------------------------------------------------------------------
# The app.
# ---------------------------------------------------------------------------------------


def create_app(
    store: DocumentStore,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    reader: RequestReader | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The ASGI app serving the document API from ``store`` (whose schema must be installed).
    The routes use ``app.state.store`` and ``app.state.reader`` per request, so a check may
    swap either between requests (:meth:`DocumentServer.use`)."""
    app = FastAPI(
        title="knownstate documents",
        version="1",
        description="Versioned documents: compare-and-swap saves, explicit conflicts.",
    )
    app.router.route_class = LeanRoute
    app.state.store = store
    app.state.reader = reader or RequestReader()
    app.state.limits = limits or Limits()
    app.router.redirect_slashes = app.state.reader.redirect_slashes
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError):
        return error(422, "invalid_request", describe_errors(exc.errors()))

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
        cause = getattr(exc.__cause__, "sqlstate", None)
        if isinstance(exc, store_impl.DeadlinePassed) or cause in (
            store_impl.DEADLINE_PASSED,
            "57014",  # statement_timeout
        ):
            return late_answer(app.state.limits.request_seconds)
        return error(
            503, "unavailable", "the document store is unreachable; retry the same request"
        )

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception):
        return error(
            500,
            "internal_error",
            f"the server failed ({type(exc).__name__}): a bug in knownstate; nothing is known "
            "about this request's effect: read the document before retrying",
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


class ListenError(RuntimeError):
    """The server cannot listen where it was told to: the message says why and what to do."""


def listen(host: str, port: int | None) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 or None: a free one), or ListenError
    naming the cause: a host name that does not resolve, an address not of this machine, a
    port in use or privileged."""
    try:
        infos = socket.getaddrinfo(
            host, port or 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise ListenError(
            f"cannot listen on host {host!r}: it does not resolve ({e.strerror}): give an "
            "address of this machine, e.g. --host 127.0.0.1"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        why = {
            errno.EADDRINUSE: f"port {port} is taken: choose another with --port (0: any free one)",
            errno.EADDRNOTAVAIL: f"{host} is not an address of this machine: give one that is",
            errno.EACCES: f"port {port} needs privileges: choose one above 1023",
        }.get(e.errno, f"{e.strerror}")
        raise ListenError(f"cannot listen on {host}:{port or 0}: {why}") from None
    return sock


class DocumentServer:
    """The document API served by uvicorn in a background thread. ``start()``/``stop()`` or
    ``with DocumentServer(dsn) as server: ... server.url``. The server owns its store and
    closes it when it stops. ``limits`` (:class:`~.http.Limits`): deadlines and sizes; the
    store's statements time out at the request deadline."""

    def __init__(
        self,
        dsn: str,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        connect_timeout: float = 3.0,
        pool_size: int | None = 8,
        limits: Limits | None = None,
        **app_options,
    ):
        self.dsn, self.host, self.port = dsn, host, port
        self.limits = limits or Limits()
        store = DocumentStore(
            dsn,
            connect_timeout=connect_timeout,
            pool_size=pool_size,
            statement_timeout=self.limits.request_seconds,
        )
        self.app = create_app(store, limits=self.limits, **app_options)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def store(self) -> DocumentStore:
        return self.app.state.store

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

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
        """Listen (ListenError naming the cause when it cannot) and serve in a thread."""
        sock = listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            http=protocol(self.limits),
            timeout_keep_alive=max(1, round(self.limits.idle_seconds)),
            h11_max_incomplete_event_size=self.limits.header_bytes,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"documents:{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                sock.close()
                raise ListenError(f"the document server did not start on {self.url}")
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
