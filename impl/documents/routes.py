"""How the document API's routes run: FastAPI declares them (the OpenAPI document); a lean
handler runs them (:class:`LeanRoute`), each request's endpoint in a worker thread under the
request's deadline (:func:`within_deadline`), and a body over the limit is refused before anything
reads it whole (:class:`BodyLimit`)."""

from __future__ import annotations

import functools
import inspect
import re
import time
import typing

import anyio
from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from knownstate.model.document import ID_PATTERN, USER_PATTERN

from . import store as store_impl
from .http import Limits
from .reading import BadRequest, RequestReader, error


class LeanRoute(APIRoute):
    """A route FastAPI declares but does not run. What it does per request is only this: read
    the body strictly (the :class:`RequestReader`), check the path's document id in full,
    validate the body with its pydantic model, and call the endpoint in the threadpool with
    them (headers it reads itself, through the reader). Everything else — which model, which
    arguments — is worked out once, here, when the route is built; FastAPI's per-request
    dependency solving is not on the path of a save."""

    def matches(self, scope):
        """A HEAD request is served as its GET (uvicorn sends no body for it)."""
        if scope.get("type") == "http" and scope.get("method") == "HEAD" and "GET" in self.methods:
            scope = {**scope, "method": "GET"}
        return super().matches(scope)

    async def handle(self, scope, receive, send):
        if scope.get("method") == "HEAD" and "GET" in self.methods:
            scope = {**scope, "method": "GET"}
        await super().handle(scope, receive, send)

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
                return error(422, "invalid_request", describe_errors(e.errors()))
            return await within_deadline(request.app.state.limits, endpoint, kwargs)

        return handle


async def within_deadline(limits: Limits, endpoint, kwargs: dict):
    """Run the endpoint in a worker thread, answered by ``limits.request_seconds`` whatever
    the database does: past it, 503, and the thread is left to finish on its own (a write it
    had in flight cannot commit any more: the store's deadline is set a margin earlier, so a
    write that commits at all commits before this answer)."""
    seconds = limits.request_seconds
    commit_by = time.monotonic() + seconds - min(1.0, seconds / 4)
    call = functools.partial(_call_under_deadline, commit_by, endpoint, kwargs)
    try:
        with anyio.fail_after(seconds):
            return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
    except TimeoutError:
        return late_answer(seconds)


def _call_under_deadline(commit_by: float, endpoint, kwargs: dict):
    with store_impl.deadline(commit_by):
        return endpoint(**kwargs)


def late_answer(seconds: float):
    return error(
        503,
        "unavailable",
        f"the document store did not answer within {seconds:g} s: a save that had not "
        "committed by then never will; retry the same request (one that did land is answered "
        "from its receipt)",
    )


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
                return  # the client went (or was too slow): a partial body is never handed on
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


def describe_errors(errors) -> str:
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
