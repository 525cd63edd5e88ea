"""Hostile input against the real document server: each request is refused with the status the
contract names, in the one error format (``{"error", "message"}``, a message that says what is
wrong), never a 5xx, and nothing stored changes (every document, version and history row is
compared with what was there before the suite ran).

The cases are data, grouped by what they attack: identifiers (in the path, the writer id, the
content), the identity header, the content type, the bytes of the body, the shape of the body,
the content against its kind, conditional headers, routes, and authorization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from knownstate.impl.documents import DocumentServer, DocumentStore

REC_SCHEMA = {"attributes": {"title": "text", "qty": "number", "done": "bool"}}
SHEET_SCHEMA = {"rows": 20, "cols": 4}
FILES = "/api/desk/files"
_ABSENT = object()


@dataclass(frozen=True)
class Bad:
    name: str
    method: str
    path: str
    status: int
    error: str
    words: str = ""
    body: object = _ABSENT  # a JSON value, or bytes sent as they are
    users: tuple[str, ...] = ("alice",)
    content_type: str | None = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    def send(self, http: httpx.Client) -> httpx.Response:
        headers = [("X-User", u) for u in self.users] + list(self.headers)
        content = None
        if self.body is not _ABSENT:
            if self.content_type is not None:
                headers.append(("Content-Type", self.content_type))
            content = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        return http.request(self.method, self.path, headers=headers, content=content)


def save(content=None, version=1, writer="w", seq=1, **extra) -> dict:
    body = {
        "expectedVersion": version,
        "content": {"title": "x"} if content is None else content,
        "writerId": writer,
        "saveSeq": seq,
        **extra,
    }
    return {k: v for k, v in body.items() if v is not _ABSENT}


def create(content=None, writer="w", seq=1, **extra) -> dict:
    body = {
        "copyOf": "rec1",
        "content": {"title": "x"} if content is None else content,
        "writerId": writer,
        "saveSeq": seq,
        **extra,
    }
    return {k: v for k, v in body.items() if v is not _ABSENT}


REC = f"{FILES}/rec1"
SAVE = json.dumps(save()).encode()
CASES: list[Bad] = []
add = CASES.append

# -- identifiers in the path: matched in full ---------------------------------------------------
for label, raw in [
    ("trailing newline", "rec1%0A"),
    ("trailing CR", "rec1%0D"),
    ("trailing space", "rec1%20"),
    ("leading space", "%20rec1"),
    ("NUL", "rec%00"),
    ("too long", "r" * 65),
    ("non-ASCII", "r%C3%A9c"),
    ("dot", "rec1.json"),
    ("tab", "rec1%09"),
    ("plus", "rec+1"),
]:
    add(Bad(f"path id, {label}: GET", "GET", f"{FILES}/{raw}", 422, "invalid_request", "id"))
    add(
        Bad(
            f"path id, {label}: PUT",
            "PUT",
            f"{FILES}/{raw}",
            422,
            "invalid_request",
            "id",
            body=save(),
        )
    )

# -- writer ids: matched in full ---------------------------------------------------------------
for label, writer in [
    ("trailing newline", "w\n"),
    ("empty", ""),
    ("space", "a b"),
    ("too long", "w" * 65),
    ("non-ASCII", "wé"),
    ("slash", "w/1"),
    ("dot", "w.1"),
    ("number", 7),
    ("null", None),
    ("list", ["w"]),
    ("object", {"w": 1}),
    ("bool", True),
]:
    add(
        Bad(
            f"writerId {label}: PUT",
            "PUT",
            REC,
            422,
            "invalid_request",
            "writerId",
            body=save(writer=writer),
        )
    )
    add(
        Bad(
            f"writerId {label}: POST",
            "POST",
            FILES,
            422,
            "invalid_request",
            "writerId",
            body=create(writer=writer),
        )
    )

# -- save sequence numbers ---------------------------------------------------------------------
for label, seq in [
    ("zero", 0),
    ("negative", -1),
    ("fraction", 1.5),
    ("string", "1"),
    ("bool", True),
    ("too big", 2**63),
    ("null", None),
]:
    add(
        Bad(
            f"saveSeq {label}: PUT",
            "PUT",
            REC,
            422,
            "invalid_request",
            "saveSeq",
            body=save(seq=seq),
        )
    )
    add(
        Bad(
            f"saveSeq {label}: POST",
            "POST",
            FILES,
            422,
            "invalid_request",
            "saveSeq",
            body=create(seq=seq),
        )
    )

# -- the identity header ---------------------------------------------------------------------------
for label, users in [
    ("missing", ()),
    ("empty", ("",)),
    ("space", ("a b",)),
    ("comma list", ("alice,bob",)),
    ("too long", ("a" * 65,)),
    ("slash", ("al/ice",)),
    ("colon", ("alice:pw",)),
]:
    add(Bad(f"X-User {label}: GET", "GET", REC, 401, "unauthenticated", "X-User", users=users))
    add(
        Bad(
            f"X-User {label}: PUT",
            "PUT",
            REC,
            401,
            "unauthenticated",
            "X-User",
            users=users,
            body=save(),
        )
    )
for label, users in [
    ("twice, the same", ("alice", "alice")),
    ("twice, two users", ("alice", "bob")),
    ("twice, a stranger second", ("alice", "dave")),
]:
    add(
        Bad(f"X-User {label}: GET", "GET", REC, 400, "bad_request", "2 X-User headers", users=users)
    )
    add(
        Bad(
            f"X-User {label}: PUT",
            "PUT",
            REC,
            400,
            "bad_request",
            "2 X-User headers",
            users=users,
            body=save(),
        )
    )
    add(
        Bad(
            f"X-User {label}: POST",
            "POST",
            FILES,
            400,
            "bad_request",
            "2 X-User headers",
            users=users,
            body=create(),
        )
    )

# -- the content type: JSON in UTF-8, said so ------------------------------------------------------
for label, ctype in [
    ("missing", None),
    ("text/plain", "text/plain"),
    ("form", "application/x-www-form-urlencoded"),
    ("multipart", "multipart/form-data; boundary=x"),
    ("JSON in UTF-16", "application/json; charset=utf-16"),
    ("JSON in latin-1", "application/json; charset=latin-1"),
    ("jsonx", "application/jsonx"),
    ("merge patch", "application/merge-patch+json"),
    ("text/json", "text/json"),
]:
    add(
        Bad(
            f"Content-Type {label}: PUT",
            "PUT",
            REC,
            415,
            "unsupported_media_type",
            "application/json",
            body=save(),
            content_type=ctype,
        )
    )
    add(
        Bad(
            f"Content-Type {label}: POST",
            "POST",
            FILES,
            415,
            "unsupported_media_type",
            "application/json",
            body=create(),
            content_type=ctype,
        )
    )
add(
    Bad(
        "Content-Type twice: PUT",
        "PUT",
        REC,
        400,
        "bad_request",
        "2 Content-Type headers",
        body=save(),
        headers=(("Content-Type", "application/json"),),
    )
)

# -- the bytes of the body: UTF-8 JSON, read strictly ----------------------------------------------
TEXT = json.dumps(save())
BODIES = [
    ("empty", b"", "empty"),
    ("truncated", TEXT[:-1].encode(), "not JSON"),
    ("not JSON", b"nul", "not JSON"),
    ("trailing garbage", (TEXT + " x").encode(), "not JSON"),
    ("two objects", (TEXT + TEXT).encode(), "not JSON"),
    ("UTF-16 LE with BOM", TEXT.encode("utf-16"), "not UTF-8"),
    ("UTF-16 BE with BOM", b"\xfe\xff" + TEXT.encode("utf-16-be"), "not UTF-8"),
    ("UTF-16 LE without BOM", TEXT.encode("utf-16-le"), "not JSON"),
    ("UTF-32", TEXT.encode("utf-32"), "not UTF-8"),
    ("latin-1", TEXT.replace('"x"', '"\u00e9"').encode("latin-1"), "not UTF-8"),
    ("UTF-8 BOM", b"\xef\xbb\xbf" + TEXT.encode(), "not JSON"),
    ("NaN", TEXT.replace('"x"', "NaN").replace('"title"', '"qty"').encode(), "NaN"),
    ("Infinity", TEXT.replace('"x"', "Infinity").replace('"title"', '"qty"').encode(), "Infinity"),
    (
        "-Infinity",
        TEXT.replace('"x"', "-Infinity").replace('"title"', '"qty"').encode(),
        "Infinity",
    ),
    (
        "a key twice at the top",
        TEXT.replace(
            '{"expectedVersion": 1', '{"expectedVersion": 1, "expectedVersion": 1'
        ).encode(),
        "twice",
    ),
    (
        "a key twice in the content",
        TEXT.replace('"title": "x"', '"title": "x", "title": "y"').encode(),
        "twice",
    ),
    ("nested too deep", b"[" * 20000 + b"]" * 20000, "nested too deep"),
    ("a number too long", ('{"expectedVersion": ' + "9" * 5000 + "}").encode(), "too long"),
    ("a NUL byte", b"\x00" + TEXT.encode(), "not JSON"),
    ("a single quote", TEXT.replace('"', "'").encode(), "not JSON"),
]
for label, raw, words in BODIES:
    add(Bad(f"body {label}: PUT", "PUT", REC, 400, "bad_request", words, body=raw))
    post_raw = raw.replace(b'"expectedVersion": 1', b'"copyOf": "rec1"')
    add(Bad(f"body {label}: POST", "POST", FILES, 400, "bad_request", words, body=post_raw))

# -- the shape of the body -------------------------------------------------------------------------
for label, body, words in [
    ("a JSON array", [save()], "body"),
    ("a JSON string", "save", "body"),
    ("null", None, "body"),
    ("an unknown field", save(force=True), "force"),
    ("content missing", save(content=_ABSENT), "content"),
    ("content a list", save(content=["title"]), "content"),
    ("a nested value", save(content={"title": {"a": 1}}), "content"),
    ("a null value", save(content={"title": None}), "content"),
    ("too many ids", save(content={f"a{i}": 1 for i in range(600)}), "content"),
    ("version zero", save(version=0), "expectedVersion"),
    ("version a string", save(version="1"), "expectedVersion"),
]:
    add(Bad(f"shape: {label}", "PUT", REC, 422, "invalid_request", words, body=body))

# -- content against its kind: ids matched in full, values typed -----------------------------------
for label, content, words in [
    ("attribute id with a trailing newline", {"title\n": "x"}, "unknown attribute id"),
    ("attribute id capitalised", {"Title": "x"}, "unknown attribute id"),
    ("attribute id with a space", {"title ": "x"}, "unknown attribute id"),
    ("a number as text", {"qty": "1"}, "must be a number"),
    ("a bool as a number", {"qty": True}, "must be a number"),
    ("a number as a bool", {"done": 1}, "must be a boolean"),
    ("a NUL in text", {"title": "a\x00b"}, "NUL"),
    ("text too long", {"title": "x" * 2001}, "longer than"),
    ("a number out of range", {"qty": 2**60}, "out of range"),
]:
    add(
        Bad(
            f"record content: {label}",
            "PUT",
            REC,
            422,
            "invalid_content",
            words,
            body=save(content),
        )
    )
for label, cell, words in [
    ("trailing newline", "A1\n", "unknown cell id"),
    ("lower case", "a1", "unknown cell id"),
    ("leading space", " A1", "unknown cell id"),
    ("trailing space", "A1 ", "unknown cell id"),
    ("row zero", "A0", "unknown cell id"),
    ("leading zero", "A01", "unknown cell id"),
    ("three letters", "AAA1", "unknown cell id"),
    ("column outside", "E1", "outside the sheet"),
    ("row outside", "A21", "outside the sheet"),
]:
    add(
        Bad(
            f"sheet cell: {label}",
            "PUT",
            f"{FILES}/sheet1",
            422,
            "invalid_content",
            words,
            body=save({cell: 1}),
        )
    )
add(
    Bad(
        "sheet cell: a bool",
        "PUT",
        f"{FILES}/sheet1",
        422,
        "invalid_content",
        "must be a number",
        body=save({"A1": False}),
    )
)
add(
    Bad(
        "record content: a lone surrogate",
        "PUT",
        REC,
        422,
        "invalid_content",
        "surrogate",
        body=TEXT.replace('"x"', '"\\ud800"').encode(),
    )
)

# -- creates ---------------------------------------------------------------------------------------
NEW = {"kind": "record", "content": {}, "writerId": "w", "saveSeq": 1}
for label, body, status, error, words in [
    (
        "attribute id with a trailing newline",
        {**NEW, "schema": {"attributes": {"title\n": "text"}}},
        422,
        "invalid_content",
        "attribute id",
    ),
    (
        "attribute id capitalised",
        {**NEW, "schema": {"attributes": {"Title": "text"}}},
        422,
        "invalid_content",
        "attribute id",
    ),
    (
        "attribute id starting with a digit",
        {**NEW, "schema": {"attributes": {"1a": "text"}}},
        422,
        "invalid_content",
        "attribute id",
    ),
    (
        "attribute of an unknown type",
        {**NEW, "schema": {"attributes": {"a": "date"}}},
        422,
        "invalid_content",
        "type",
    ),
    ("no attributes", {**NEW, "schema": {"attributes": {}}}, 422, "invalid_content", "attributes"),
    (
        "sheet with no rows",
        {**NEW, "kind": "sheet", "schema": {"rows": 0, "cols": 1}},
        422,
        "invalid_content",
        "rows",
    ),
    (
        "sheet too wide",
        {**NEW, "kind": "sheet", "schema": {"rows": 1, "cols": 703}},
        422,
        "invalid_content",
        "cols",
    ),
    (
        "sheet with a cell id with a trailing newline",
        {**NEW, "kind": "sheet", "schema": {"rows": 2, "cols": 2}, "content": {"A1\n": 1}},
        422,
        "invalid_content",
        "unknown cell id",
    ),
    ("an unknown kind", {**NEW, "kind": "poem"}, 422, "invalid_request", "kind"),
    (
        "neither copyOf nor kind",
        {k: v for k, v in NEW.items() if k != "kind"},
        422,
        "invalid_request",
        "copyOf",
    ),
    ("copyOf with a kind", create(kind="sheet"), 422, "invalid_request", "copyOf"),
    (
        "a copy that does not fit the kind",
        create({"zz": 1}),
        422,
        "invalid_content",
        "unknown attribute id",
    ),
    (
        "a copy of a document that does not exist",
        {**create(), "copyOf": "nosuchdoc"},
        404,
        "not_found",
        "no such document",
    ),
    (
        "copyOf with a trailing newline",
        {**create(), "copyOf": "rec1\n"},
        422,
        "invalid_request",
        "copyOf",
    ),
]:
    add(Bad(f"create: {label}", "POST", FILES, status, error, words, body=body))

# -- conditional headers ---------------------------------------------------------------------------
for label, tag, status, error in [
    ("leading zeros", '"0001"', 412, "precondition_failed"),
    ("weak", 'W/"1"', 412, "precondition_failed"),
    ("star", "*", 428, "precondition_required"),
    ("unquoted", "1", 400, "bad_request"),
    ("a list", '"1", "2"', 400, "bad_request"),
]:
    add(
        Bad(
            f"If-Match {label}",
            "PUT",
            REC,
            status,
            error,
            "If-Match",
            body=save(version=_ABSENT),
            headers=(("If-Match", tag),),
        )
    )
add(
    Bad(
        "If-Match twice",
        "PUT",
        REC,
        400,
        "bad_request",
        "2 If-Match headers",
        body=save(version=_ABSENT),
        headers=(("If-Match", '"1"'), ("If-Match", '"1"')),
    )
)
add(
    Bad(
        "no base version at all",
        "PUT",
        REC,
        428,
        "precondition_required",
        "expectedVersion",
        body=save(version=_ABSENT),
    )
)

# -- routes: no redirects, one error format --------------------------------------------------------
for label, method, path, status, error, body in [
    ("create with a trailing slash", "POST", f"{FILES}/", 404, "not_found", create()),
    ("save with a trailing slash", "PUT", f"{REC}/", 404, "not_found", save()),
    ("read with a trailing slash", "GET", f"{REC}/", 404, "not_found", _ABSENT),
    ("list the files", "GET", FILES, 405, "method_not_allowed", _ABSENT),
    ("delete a file", "DELETE", REC, 405, "method_not_allowed", _ABSENT),
    ("patch a file", "PATCH", REC, 405, "method_not_allowed", save()),
    ("an unknown route", "GET", "/api/desk", 404, "not_found", _ABSENT),
]:
    add(Bad(f"route: {label}", method, path, status, error, body=body))

# -- authorization before anything about the document ----------------------------------------------
for label, method, path, body in [
    ("read", "GET", REC, _ABSENT),
    ("save on the right base", "PUT", REC, save()),
    ("save on a stale base", "PUT", REC, save(version=7)),
    ("save without a base", "PUT", REC, save(version=_ABSENT)),
    ("save of bad content", "PUT", REC, save({"zz": 1})),
    ("save of a document that does not exist", "PUT", f"{FILES}/nosuchdoc", save()),
    ("copy", "POST", FILES, create()),
]:
    add(
        Bad(
            f"a stranger's {label}",
            method,
            path,
            404,
            "not_found",
            "no such document",
            body=body,
            users=("dave",),
        )
    )
for version in (1, 7, _ABSENT):
    add(
        Bad(
            f"a reader's save (base {version if version is not _ABSENT else 'none'})",
            "PUT",
            REC,
            403,
            "forbidden",
            "not write",
            body=save(version=version),
            users=("carol",),
        )
    )


@pytest.fixture(scope="module")
def hostile(knownstate_cluster):
    import psycopg

    name = "documents_bad_input"
    with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
        admin.execute(f"drop database if exists {name} with (force)")
        admin.execute(f"create database {name}")
    dsn = knownstate_cluster.dsn(name)
    with DocumentStore(dsn, pool_size=None) as store:
        store.install()
        store.seed(
            "rec1",
            "record",
            REC_SCHEMA,
            {"title": "a", "qty": 1},
            "alice",
            {"bob": True, "carol": False},
        )
        store.seed("sheet1", "sheet", SHEET_SCHEMA, {"A1": 1}, "alice")
    with DocumentServer(dsn) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield server, http, server.store.documents()
    if knownstate_cluster.running:
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
            admin.execute(f"drop database if exists {name} with (force)")


def test_the_suite_is_large_and_names_are_unique():
    assert len(CASES) >= 150
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_clearly_and_nothing_stored_changes(hostile, case):
    server, http, before = hostile
    r = case.send(http)
    assert r.status_code < 500, r.text
    assert r.status_code == case.status, f"{r.status_code} {r.text[:300]}"
    body = r.json()
    assert isinstance(body, dict) and set(body) >= {"error", "message"}, body
    assert body["error"] == case.error, body
    assert isinstance(body["message"], str) and body["message"].strip(), body
    assert case.words.lower() in body["message"].lower(), body["message"]
    assert server.store.documents() == before
