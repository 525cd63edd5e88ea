"""What the document-session check sends besides what sessions send: a hostile client.

Sessions only ever send well-formed requests. A server is also read by clients that are not
sessions, and the contract says what it does with each: refuse it, in one format, and change
nothing. :data:`HOSTILE` is that part of the contract as data — each entry a request that a
lenient server would *apply* (it carries the current base version and a fresh save identity),
with the status and error the contract names for it. The check sends one, then judges with
:data:`REQUEST_INVARIANTS`: the answer (status and format) and the stored documents (equal to
what they were before).

Two more server rules need state, so they run through the check's run-then-replay engine and
the model's server: another user's client saving under a writer id it does not own, and a
writer reusing a ``(writerId, saveSeq)`` for other content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import httpx

from knownstate.model.contract import Violation

REQUEST_INVARIANTS = {
    "refused-request-changes-nothing": (
        "A request the HTTP contract refuses (ambiguous, malformed or not the user's to make) "
        "changes nothing stored."
    ),
    "refusal-answered-clearly": (
        'A refused request gets the 4xx the contract names, as {"error", "message"} with a '
        "message that says what is wrong."
    ),
}

FILES = "/api/desk/files"
Built = tuple[str, str, list[tuple[str, str]], bytes]  # method, path, headers, body


@dataclass(frozen=True)
class Hostile:
    name: str
    status: int
    error: str
    build: Callable[[str, int, str], Built]  # (document, its version, fresh writer) -> request

    def request(self, doc: str, version: int, writer: str) -> Built:
        return self.build(doc, version, writer)


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


def _put(doc: str, headers: list[tuple[str, str]], body: bytes) -> Built:
    return "PUT", f"{FILES}/{doc}", headers, body


ALICE_JSON = [("X-User", "alice"), ("Content-Type", "application/json")]


def _save(version: int | None, writer: str, title: str) -> dict:
    body = {"content": {"title": title}, "writerId": writer, "saveSeq": 1}
    return body if version is None else {"expectedVersion": version, **body}


HOSTILE: tuple[Hostile, ...] = (
    Hostile(
        "a record schema with an attribute id ending in a newline",
        422,
        "invalid_content",
        lambda doc, v, w: (
            "POST",
            FILES,
            ALICE_JSON,
            _json(
                {
                    "kind": "record",
                    "schema": {"attributes": {"title\n": "text"}},
                    "content": {"title\n": "x"},
                    "writerId": w,
                    "saveSeq": 1,
                }
            ),
        ),
    ),
    Hostile(
        "a sheet with a cell id ending in a newline",
        422,
        "invalid_content",
        lambda doc, v, w: (
            "POST",
            FILES,
            ALICE_JSON,
            _json(
                {
                    "kind": "sheet",
                    "schema": {"rows": 2, "cols": 2},
                    "content": {"A1\n": 1},
                    "writerId": w,
                    "saveSeq": 1,
                }
            ),
        ),
    ),
    Hostile(
        "a save whose content has a key twice",
        400,
        "bad_request",
        lambda doc, v, w: _put(
            doc,
            ALICE_JSON,
            _json(_save(v, w, "once")).replace(
                b'"title": "once"', b'"title": "once", "title": "twice"'
            ),
        ),
    ),
    Hostile(
        "a save in UTF-16",
        400,
        "bad_request",
        lambda doc, v, w: _put(doc, ALICE_JSON, json.dumps(_save(v, w, "utf16")).encode("utf-16")),
    ),
    Hostile(
        "a save based on If-Match with the version in leading zeros",
        412,
        "precondition_failed",
        lambda doc, v, w: _put(
            doc, [*ALICE_JSON, ("If-Match", f'"{v:04d}"')], _json(_save(None, w, "zeros"))
        ),
    ),
    Hostile(
        "a save with two X-User headers, the second a stranger",
        400,
        "bad_request",
        lambda doc, v, w: _put(
            doc, [*ALICE_JSON, ("X-User", "mallory")], _json(_save(v, w, "two users"))
        ),
    ),
    Hostile(
        "a save with two If-Match headers",
        400,
        "bad_request",
        lambda doc, v, w: _put(
            doc,
            [*ALICE_JSON, ("If-Match", f'"{v}"'), ("If-Match", '"1"')],
            _json(_save(None, w, "two tags")),
        ),
    ),
    Hostile(
        "a JSON save labelled text/plain",
        415,
        "unsupported_media_type",
        lambda doc, v, w: _put(
            doc, [("X-User", "alice"), ("Content-Type", "text/plain")], _json(_save(v, w, "plain"))
        ),
    ),
    Hostile(
        "a save whose JSON is cut short",
        400,
        "bad_request",
        lambda doc, v, w: _put(doc, ALICE_JSON, _json(_save(v, w, "cut"))[:-2]),
    ),
    Hostile(
        "a create posted to a trailing slash",
        404,
        "not_found",
        lambda doc, v, w: (
            "POST",
            f"{FILES}/",
            ALICE_JSON,
            _json({"copyOf": doc, "content": {"title": "slash"}, "writerId": w, "saveSeq": 1}),
        ),
    ),
)
HOSTILE_EVENTS = tuple(f"hostile request refused: {h.name}" for h in HOSTILE)
"""The Python check's requirements: each request the contract refuses was sent and refused
(drawn among the cases, one of them could be missing from a run that saw many refusals)."""


def judge(case: Hostile, response: httpx.Response, before, after) -> list[Violation]:
    """The contract's verdict on one refused request: its answer, and what is stored."""
    out = []
    try:
        body = response.json()
    except ValueError:
        body = None
    clear = (
        isinstance(body, dict)
        and body.get("error") == case.error
        and isinstance(body.get("message"), str)
        and body["message"].strip()
    )
    if response.status_code != case.status or not clear:
        got = f"{response.status_code} {response.text[:160]!r}"
        out.append(
            Violation(
                "refusal-answered-clearly",
                f"{case.name}: answered {got}, the contract says {case.status} "
                f'{{"error": "{case.error}", "message": ...}}',
            )
        )
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        out.append(
            Violation(
                "refused-request-changes-nothing",
                f"{case.name}: answered {response.status_code}, and stored "
                f"document(s) {', '.join(changed)} changed",
            )
        )
    return out
