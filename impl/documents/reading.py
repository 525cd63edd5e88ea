"""How the document server reads a request, strictly, before any document is touched.

One place decides what a client sent, so every refusal has one format (``{"error",
"message"}``, the message says what is wrong and what to do) and nothing ambiguous is ever
guessed at:

- **one header, once**: two ``X-User`` or two ``If-Match`` headers are refused (400), never
  "the first one wins";
- **the body is JSON in UTF-8, said so**: ``Content-Type: application/json`` (an optional
  ``charset=utf-8``) or 415; bytes that are not UTF-8 (a UTF-16 body, say) are refused, not
  sniffed; a key twice in one object, ``NaN``/``Infinity``, or nesting too deep to read is 400,
  never "the last key wins"; an empty body is 400. The shape is pydantic's (422) afterwards;
- **ETags as RFC 9110 compares them**: ``If-Match`` holds one strong entity tag. The server's
  ETags are ``"<version>"`` with the version in decimal, so ``"0004"`` or ``W/"4"`` is a tag
  that matches no version (412 once authorised), never version 4; ``*`` names no base version
  (428); anything that is not an entity tag is 400.

:class:`RequestReader` is the seam: the mutant catalogue replaces one of its steps at a time
(a lenient JSON reader, the first header wins, ...) and the check shows the damage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from email.message import Message

from fastapi.responses import JSONResponse

from knownstate.model.document import MAX_VERSION, USER_PATTERN

_ENTITY_TAG = re.compile(r'(W/)?"([\x21\x23-\x7e\x80-\xff]*)"')
_VERSION_TAG = re.compile(r"[1-9][0-9]{0,18}")


def error(
    status: int, error: str, message: str, headers: dict | None = None, **extra
) -> JSONResponse:
    """The one error format of every 4xx (and 5xx): ``{"error", "message", ...}``."""
    return JSONResponse(
        {"error": error, "message": message, **extra}, status_code=status, headers=headers
    )


class BadRequest(Exception):
    """The request cannot be read as the contract says; ``response()`` is its answer."""

    def __init__(self, status: int, error: str, message: str):
        super().__init__(message)
        self.status, self.error, self.message = status, error, message

    def response(self) -> JSONResponse:
        return error(self.status, self.error, self.message)


@dataclass(frozen=True)
class IfMatch:
    """A parsed ``If-Match``: the version its tag names, or None when the tag matches none."""

    tag: str
    version: int | None


class _DuplicateKey(ValueError):
    pass


class _NotJsonNumber(ValueError):
    pass


def _no_constant(name: str):
    raise _NotJsonNumber(name)


class RequestReader:
    """Reads headers and bodies strictly; each step raises :class:`BadRequest`."""

    redirect_slashes = False
    """``/api/desk/files/`` is not ``/api/desk/files``: a 404, never a 307 redirect."""

    def header(self, headers, name: str) -> str | None:
        values = headers.getlist(name)
        if len(values) > 1:
            raise BadRequest(400, "bad_request", f"{len(values)} {name} headers: send exactly one")
        return values[0] if values else None

    def user(self, headers) -> str | None:
        """The ``X-User`` identity, or None when it is missing or not a user name (401)."""
        value = self.header(headers, "X-User")
        if value is None or not re.fullmatch(USER_PATTERN, value):
            return None
        return value

    def content_type(self, headers) -> None:
        value = self.header(headers, "Content-Type")
        if value is not None:
            m = Message()
            m["content-type"] = value
            params = {k.lower(): v.lower() for k, v in m.get_params()[1:]}
            if (
                m.get_content_type() == "application/json"
                and params.get("charset", "utf-8") == "utf-8"
            ):
                return
        raise BadRequest(
            415,
            "unsupported_media_type",
            f"Content-Type {value!r} is not JSON: send the body as JSON in UTF-8 "
            "with Content-Type: application/json",
        )

    def decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(
                400,
                "bad_request",
                f"the body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                f"{e.start}): send JSON encoded as UTF-8",
            ) from None

    def object_from_pairs(self, pairs: list[tuple[str, object]]) -> dict:
        """One JSON object. A key twice is refused: which of the two was meant is a guess."""
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise _DuplicateKey(key)
            out[key] = value
        return out

    def not_json(self, what: str) -> BadRequest:
        """The refusal of a body that is not JSON this server reads."""
        return BadRequest(400, "bad_request", f"the body is not JSON: {what}")

    def parse(self, text: str) -> object:
        try:
            return json.loads(
                text, object_pairs_hook=self.object_from_pairs, parse_constant=_no_constant
            )
        except _DuplicateKey as e:
            raise BadRequest(
                400,
                "bad_request",
                f"the JSON body has the key {ascii(e.args[0])} twice in one object: "
                "send each key once",
            ) from None
        except _NotJsonNumber as e:
            raise self.not_json(f"{e.args[0]} is not a JSON number") from None
        except json.JSONDecodeError as e:
            raise self.not_json(f"{e.msg} at line {e.lineno} column {e.colno}") from None
        except (RecursionError, ValueError) as e:
            raise self.not_json(
                f"{type(e).__name__}, nested too deep or a number too long for this server to read"
            ) from None

    def body(self, headers, raw: bytes) -> object:
        """The JSON value of a request body, read strictly."""
        self.content_type(headers)
        if not raw:
            raise BadRequest(400, "bad_request", "the body is empty: send a JSON object")
        return self.parse(self.decode(raw))

    def if_match(self, headers) -> IfMatch | None:
        value = self.header(headers, "If-Match")
        if value is None:
            return None
        value = value.strip(" \t")
        if value == "*":
            raise BadRequest(
                428,
                "precondition_required",
                'If-Match: * names no version: send If-Match: "<version>" or '
                '"expectedVersion" in the body',
            )
        m = _ENTITY_TAG.fullmatch(value)
        if m is None:
            raise BadRequest(
                400,
                "bad_request",
                'If-Match must be one entity tag, like "3" (the ETag of the '
                "version the save is based on)",
            )
        weak, opaque = m.groups()
        return IfMatch(value, self.tag_version(opaque, weak=bool(weak)))

    def tag_version(self, opaque: str, *, weak: bool) -> int | None:
        """The version whose ETag is this tag, by strong comparison: the server writes a
        version's ETag as its decimal digits, so only that spelling names it."""
        if weak or not _VERSION_TAG.fullmatch(opaque) or int(opaque) > MAX_VERSION:
            return None
        return int(opaque)
