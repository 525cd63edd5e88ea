"""The versioned document session, as a pure model.

Theory of operation
-------------------

A user edits a document in a tab while the server, another tab or a server-side writer (the
"AI write") can change the same document. Saves fail on flaky networks; a tab can close
mid-save. The aim: no edit is ever lost silently, and no overwrite is ever silent either.

server
    Authoritative. A document has a kind, a schema, a content map and a version. Every save
    carries the version it was based on and is one compare-and-swap: it lands only when that
    base is still the stored version (a stale base is a :class:`VersionConflict` carrying the
    stored version and content; a missing base is refused). Authorization comes first: a user
    without access learns nothing, not even the version. Each save carries ``(writerId,
    saveSeq)``; the server keeps the last applied one per document and writer, so a retry whose
    first answer was lost gets the original success, not a conflict against itself.
content
    Both kinds are flat maps ``id -> value``. A ``record``'s ids are the attribute ids of its
    schema and it merges by attribute id; a ``sheet``'s ids are cell references inside its
    size and it does not merge (a formula has no merge semantics).
session
    One per (tab, document), owned by the document, not by a view. A small state machine
    (:data:`TABLE`, the single table the implementation imports). Edits debounce into one
    latest snapshot; saves are serialised; an edit made while a save is in flight stays
    pending — a success never clears it. A conflict is an explicit state the user leaves by
    rebase (kinds that merge), keep-a-copy, discard, or discard-and-reload; never
    automatically. A lost answer leaves the request *unconfirmed*; it is retried unchanged
    (same writer, same seq, same snapshot) so the server can answer it from its receipt.
drafts
    A durable per-writer store (the browser's localStorage). Every unsaved snapshot is
    written to the writer's own slot before the save request; a slot is deleted only after a
    save of that exact snapshot succeeded or the user discarded it. On load a writer's own
    draft is restored; other writers' drafts of the same user and document (siblings) are
    offered to adopt or discard, never applied. A failing store is a visible status, retried
    on the next write.
stale reads
    Every read carries a read sequence, the local edit generation and the base version it
    started from. A read older than one already applied, or one that raced a local edit or a
    save, is dropped and counted.

This module is pure: no I/O. The check drives it with the same operations as the real
session (begin/finish pairs for everything that crosses the network, so a test decides when
an answer arrives, whether it is lost, and in which order reads complete), and evaluates the
invariants (:data:`INVARIANTS`) over a :class:`World` — the model's own, or a projection of
the real server rows, draft files and session objects.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

from .contract import CREATED, IllegalTransition, LostRace, Rejected, TransitionTable, Violation, Won

# ---------------------------------------------------------------------------------------
# Limits (the HTTP layer enforces the same ones: imported from here).
# ---------------------------------------------------------------------------------------

MAX_BODY_BYTES = 64 * 1024
MAX_KEYS = 500
MAX_TEXT = 2000
MAX_VERSION = 2**62
MAX_NUMBER = 2**53
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
USER_PATTERN = r"^[A-Za-z0-9_.@-]{1,64}$"
WRITER_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""Identifier patterns. Always matched in full (``re.fullmatch``): with ``re.match`` a ``$`` also
matches before a trailing newline, so ``"A1\\n"`` would pass as ``A1``."""
SERVER_AUTHOR = "server"

Value = str | int | float | bool
Content = dict[str, Value]


class KindError(ValueError):
    """A content, patch or schema does not fit the document's kind. The message names the problem."""


# ---------------------------------------------------------------------------------------
# Document kinds: what an id may be, what a value may be, how (and whether) three copies merge.
# ---------------------------------------------------------------------------------------


def _check_text(what: str, s: str) -> None:
    if "\x00" in s:
        raise KindError(f"{what} contains a NUL character")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise KindError(f"{what} is not valid Unicode (lone surrogate)") from None


def _check_number(what: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise KindError(f"{what} must be a number, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        raise KindError(f"{what} must be a finite number")
    if abs(v) > MAX_NUMBER:
        raise KindError(f"{what} is out of range (|x| <= 2**53)")


def _check_string(what: str, v) -> None:
    if not isinstance(v, str):
        raise KindError(f"{what} must be a string, got {type(v).__name__}")
    if len(v) > MAX_TEXT:
        raise KindError(f"{what} is longer than {MAX_TEXT} characters")
    _check_text(what, v)


def same(a, b) -> bool:
    """Value equality that does not confuse ``True`` with ``1`` or ``1`` with ``1.0``."""
    return type(a) is type(b) and a == b


def same_content(a: Mapping, b: Mapping) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


Resolve = Callable[[str, object, object, object], object]
"""A clash resolver: ``resolve(id, base, local, stored) -> value`` (``None``: the id is absent)."""


def prefer_local(_id, _base, local, _stored):
    return local


def prefer_stored(_id, _base, _local, stored):
    return stored


class Kind:
    name: str = ""
    can_merge: bool = False

    @staticmethod
    def matches(pattern: re.Pattern, text: str) -> re.Match | None:
        """An identifier against its pattern, in full: no trailing newline slips through."""
        return pattern.fullmatch(text)

    def validate_schema(self, schema) -> dict:
        raise NotImplementedError

    def validate_value(self, schema: Mapping, key: str, value) -> None:
        raise NotImplementedError

    def validate_content(self, schema: Mapping, content) -> None:
        if not isinstance(content, Mapping):
            raise KindError(f"{self.name} content must be an object of id -> value")
        if len(content) > MAX_KEYS:
            raise KindError(f"{self.name} content has more than {MAX_KEYS} ids")
        for key, value in content.items():
            if value is None:
                raise KindError(f"content[{key!r}] is null: omit the id to clear it")
            self.validate_value(schema, key, value)

    def validate_patch(self, schema: Mapping, patch) -> None:
        """A patch maps ids to new values; ``None`` clears an id."""
        if not isinstance(patch, Mapping) or not patch:
            raise KindError("an edit is a non-empty map of id -> value (None clears)")
        for key, value in patch.items():
            if value is None:
                self.validate_value(schema, key, None)
            else:
                self.validate_value(schema, key, value)

    @staticmethod
    def apply(content: Mapping, patch: Mapping) -> Content:
        out = dict(content)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    def merge(self, base: Mapping, local: Mapping, stored: Mapping, resolve: Resolve) -> Content:
        raise MergeUnsupported(self.name)


class RecordKind(Kind):
    """Dynamic attributes keyed by attribute id; the schema names each attribute's type."""

    name = "record"
    can_merge = True
    TYPES = ("text", "number", "bool")
    ATTR = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

    def validate_schema(self, schema) -> dict:
        if not isinstance(schema, Mapping) or set(schema) != {"attributes"}:
            raise KindError('a record schema is {"attributes": {attribute id: "text" | "number" | "bool"}}')
        attrs = schema["attributes"]
        if not isinstance(attrs, Mapping) or not attrs or len(attrs) > MAX_KEYS:
            raise KindError(f"a record schema needs 1..{MAX_KEYS} attributes")
        for a, t in attrs.items():
            if not isinstance(a, str) or not self.matches(self.ATTR, a):
                raise KindError(f"attribute id {a!r} must match {self.ATTR.pattern}")
            if t not in self.TYPES:
                raise KindError(f"attribute {a!r} has type {t!r}; expected one of {', '.join(self.TYPES)}")
        return {"attributes": dict(attrs)}

    def validate_value(self, schema, key, value) -> None:
        if not isinstance(key, str):
            raise KindError(f"attribute id {key!r} must be a string")
        t = schema["attributes"].get(key)
        if t is None:
            _check_text("attribute id", key)
            raise KindError(f"unknown attribute id {key!r}")
        if value is None:
            return
        what = f"attribute {key!r}"
        if t == "text":
            _check_string(what, value)
        elif t == "number":
            _check_number(what, value)
        elif not isinstance(value, bool):
            raise KindError(f"{what} must be a boolean, got {type(value).__name__}")

    def merge(self, base, local, stored, resolve: Resolve) -> Content:
        """Three-way merge by attribute id: a side that left an attribute as in the base takes
        the other side's value; only an attribute both sides changed differently is a clash,
        decided by ``resolve``."""
        out: Content = {}
        for key in sorted(set(base) | set(local) | set(stored)):
            b, l, s = base.get(key), local.get(key), stored.get(key)
            if same(l, s):
                v = l
            elif same(l, b):
                v = s
            elif same(s, b):
                v = l
            else:
                v = resolve(key, b, l, s)
            if v is not None:
                out[key] = v
        return out


class SheetKind(Kind):
    """Cells keyed by reference (``A1`` .. ``ZZ99999``) inside the sheet's size. No merge: a
    formula cell has no merge semantics, and an explicit conflict is more honest."""

    name = "sheet"
    can_merge = False
    CELL = re.compile(r"^([A-Z]{1,2})([1-9][0-9]{0,4})$")

    def validate_schema(self, schema) -> dict:
        if not isinstance(schema, Mapping) or set(schema) != {"rows", "cols"}:
            raise KindError('a sheet schema is {"rows": 1..10000, "cols": 1..702}')
        rows, cols = schema["rows"], schema["cols"]
        for what, v, hi in (("rows", rows, 10000), ("cols", cols, 702)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise KindError(f"sheet {what} must be an integer in 1..{hi}")
        return {"rows": rows, "cols": cols}

    @staticmethod
    def column_number(letters: str) -> int:
        n = 0
        for ch in letters:
            n = n * 26 + (ord(ch) - 64)
        return n

    def validate_value(self, schema, key, value) -> None:
        if not isinstance(key, str):
            raise KindError(f"cell id {key!r} must be a string")
        m = self.matches(self.CELL, key)
        if not m:
            _check_text("cell id", key)
            raise KindError(f"unknown cell id {key!r}: a cell is a column letter and a row number, like B7")
        if self.column_number(m.group(1)) > schema["cols"] or int(m.group(2)) > schema["rows"]:
            raise KindError(f"unknown cell id {key!r}: outside the sheet's {schema['cols']} columns x {schema['rows']} rows")
        if value is None:
            return
        what = f"cell {key!r}"
        if isinstance(value, str):
            _check_string(what, value)
        else:
            _check_number(what, value)


class MergeUnsupported(KindError):
    """This document kind does not merge; resolve the conflict by keeping a copy, discarding, or reloading."""

    def __init__(self, kind: str):
        super().__init__(f"{kind} documents do not merge: keep the local copy as a new document, "
                         "discard it, or discard and reload")


RECORD, SHEET = RecordKind(), SheetKind()
KINDS: dict[str, Kind] = {"record": RECORD, "sheet": SHEET}


def kind_of(name: str, kinds: Mapping[str, Kind] = KINDS) -> Kind:
    try:
        return kinds[name]
    except KeyError:
        raise KindError(f"unknown document kind {name!r}; expected record or sheet") from None


# ---------------------------------------------------------------------------------------
# Facts shared with the implementation (each defined once, here).
# ---------------------------------------------------------------------------------------


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def save_fingerprint(user: str, base_version: int, content: Mapping) -> str:
    """What makes two save requests 'the same request' for an idempotent replay."""
    return hashlib.sha256(canonical(["save", user, base_version, content]).encode()).hexdigest()


def create_fingerprint(user: str, kind: str, schema: Mapping, content: Mapping) -> str:
    return hashlib.sha256(canonical(["create", user, kind, schema, content]).encode()).hexdigest()


def created_id(user: str, writer_id: str, seq: int) -> str:
    """A created document's id is derived from the create request's (user, writer, seq): a
    retried create lands on the same id, so a lost answer never makes a duplicate."""
    return "d" + hashlib.sha256(f"{user}\x00{writer_id}\x00{seq}".encode()).hexdigest()[:24]


def draft_key(kind: str, user: str, file_id: str, writer_id: str) -> str:
    """The draft slot of one writer: one writer never erases another's draft."""
    return f"knownstate:{kind}-draft:{user}:{file_id}:{writer_id}"


def draft_prefix(kind: str, user: str, file_id: str) -> str:
    return f"knownstate:{kind}-draft:{user}:{file_id}:"


# ---------------------------------------------------------------------------------------
# The session's state machine: ONE table, imported by the implementation.
# ---------------------------------------------------------------------------------------


class State(str, enum.Enum):
    LOADING = "loading"    # created; the first read has not answered yet
    CLEAN = "clean"        # local copy == confirmed base; nothing to save
    DIRTY = "dirty"        # local edits not yet sent (debouncing, or due)
    SAVING = "saving"      # one save request in flight (edits may continue: they stay pending)
    OFFLINE = "offline"    # the last request got no answer; edits kept, the save retried unchanged
    CONFLICT = "conflict"  # the server refused a stale base; the user resolves
    COPYING = "copying"    # keeping the local copy as a new document
    CLOSED = "closed"      # the session ended: flushed, or its work parked in its durable draft


L, C, D, S, O, X, P, Z = (s.value for s in State)

TABLE = TransitionTable("document-session", [
    (CREATED, "open", L),
    (L, "loaded", C),
    (L, "restored", D),
    (L, "load_failed", L),
    (L, "close", Z),
    (C, "edit", D),
    (C, "adopt", D),
    (C, "reloaded", C),
    (C, "discard_reloaded", C),
    (C, "close", Z),
    (D, "edit", D),
    (D, "save", S),
    (D, "discard", C),
    (D, "discard_reloaded", C),
    (S, "edit", S),
    (S, "saved", C),
    (S, "saved_pending", D),
    (S, "save_failed", O),
    (S, "seq_taken", D),
    (S, "version_conflict", X),
    (O, "edit", O),
    (O, "save", S),
    (O, "discard", C),
    (O, "discard_reloaded", C),
    (O, "close", Z),
    (X, "edit", X),
    (X, "rebase", D),
    (X, "copy", P),
    (X, "discard", C),
    (X, "discard_reloaded", C),
    (X, "close", Z),
    (P, "copied", C),
    (P, "copy_failed", X),
])

USER_EVENTS = frozenset({"open", "edit", "adopt", "rebase", "copy", "discard", "discard_reloaded", "close"})
"""Events only a user action causes. Every way out of ``conflict`` is one of them."""


# ---------------------------------------------------------------------------------------
# Requests and outcomes: the vocabulary both the model and the real transport speak.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveRequest:
    doc_id: str
    user: str
    writer_id: str
    seq: int
    base_version: int
    content: Content
    generation: int  # the local edit generation this snapshot reflects (client-side only)

    def __hash__(self):
        return hash((self.doc_id, self.writer_id, self.seq))

    def to_json(self) -> dict:
        return {"writerId": self.writer_id, "seq": self.seq, "baseVersion": self.base_version,
                "content": dict(self.content), "generation": self.generation}

    @classmethod
    def from_json(cls, doc_id: str, user: str, d: Mapping) -> "SaveRequest":
        return cls(doc_id, user, d["writerId"], int(d["seq"]), int(d["baseVersion"]), dict(d["content"]),
                   int(d["generation"]))


@dataclass(frozen=True)
class ReadRequest:
    doc_id: str
    user: str
    read_seq: int
    generation: int
    base_version: int | None
    purpose: str  # "load" | "refresh" | "replace"

    def __hash__(self):
        return hash((self.doc_id, self.user, self.read_seq))


@dataclass(frozen=True)
class CopyRequest:
    copy_of: str
    user: str
    writer_id: str
    seq: int
    content: Content
    generation: int

    def __hash__(self):
        return hash((self.copy_of, self.writer_id, self.seq))


Request = SaveRequest | ReadRequest | CopyRequest


@dataclass(frozen=True)
class Snapshot:
    id: str
    kind: str
    schema: dict
    version: int
    content: Content

    def __hash__(self):
        return hash((self.id, self.version))


@dataclass(frozen=True)
class Saved:
    version: int
    replayed: bool = False


@dataclass(frozen=True)
class Created:
    id: str
    version: int = 1
    replayed: bool = False


@dataclass(frozen=True)
class VersionConflict(LostRace):
    """The save's base version is not the stored one: the stored version and content come with it."""

    version: int = 0
    content: Content = field(default_factory=dict)

    def __hash__(self):
        return hash(("conflict", self.version))


@dataclass(frozen=True)
class SeqTaken(LostRace):
    """The save's ``(writerId, saveSeq)`` already saved other content on this document (as
    ``version``): a save identity names one save. ``last_seq`` is the writer's highest saveSeq
    there, so the client can go on with a fresh one."""

    writer_id: str = ""
    seq: int = 0
    version: int = 0
    last_seq: int = 0


@dataclass(frozen=True)
class NoAnswer:
    """The request or its answer was lost (or the server failed): it may or may not have been applied."""

    reason: str = ""


@dataclass(frozen=True)
class Dropped:
    """A read that arrived stale (out of order, or raced a local edit or save) and was not applied."""

    reason: str


Answer = Won | VersionConflict | SeqTaken | Rejected | NoAnswer

NOT_FOUND = Rejected("not_found")
FORBIDDEN = Rejected("forbidden")
PRECONDITION_REQUIRED = Rejected("precondition_required")
NOT_OWNER = Rejected("not_owner")
OWNER_ACCESS = Rejected("owner_access")


# ---------------------------------------------------------------------------------------
# The server.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HistoryEntry:
    """One accepted write: the version it produced and the base version it carried."""

    version: int
    base_version: int
    author: str
    writer_id: str | None = None
    save_seq: int | None = None


@dataclass(frozen=True)
class SaveReceipt:
    """What one save (or create) of ``(user, writerId, saveSeq)`` was, and the version it made."""

    fingerprint: str
    version: int


ReceiptKey = tuple[str, str, int]  # (user, writer_id, save_seq)


@dataclass
class ServerDoc:
    id: str
    kind: str
    schema: dict
    content: Content
    version: int
    acl: dict[str, bool]  # user -> may write
    history: list[HistoryEntry]
    receipts: dict[ReceiptKey, SaveReceipt] = field(default_factory=dict)  # every applied save
    created_by: str = "seed"


class ServerModel:
    def __init__(self):
        self.docs: dict[str, ServerDoc] = {}

    # -- administration (not over HTTP) -----------------------------------------------------
    def seed(self, doc_id: str, kind: str, schema: Mapping, content: Mapping, owner: str,
             share: Mapping[str, bool] | None = None) -> ServerDoc:
        k = kind_of(kind)
        schema = k.validate_schema(schema)
        k.validate_content(schema, content)
        doc = ServerDoc(doc_id, kind, schema, dict(content), 1, {owner: True, **dict(share or {})},
                        [HistoryEntry(1, 0, owner)], created_by=owner)
        self.docs[doc_id] = doc
        return doc

    def grant(self, doc_id: str, user: str, can_write: bool) -> None:
        self.docs[doc_id].acl[user] = can_write

    def revoke(self, doc_id: str, user: str) -> None:
        self.docs[doc_id].acl.pop(user, None)

    # -- sharing (over HTTP): only the owner changes who may read or write ---------------------
    def _owned(self, owner: str, doc_id: str, user: str) -> ServerDoc | Rejected:
        doc = self._visible(owner, doc_id)
        if doc is None:
            return NOT_FOUND
        if doc.created_by != owner:
            return NOT_OWNER
        return OWNER_ACCESS if user == owner else doc

    def share(self, owner: str, doc_id: str, user: str, can_write: bool) -> Won | Rejected:
        doc = self._owned(owner, doc_id, user)
        if isinstance(doc, Rejected):
            return doc
        doc.acl[user] = can_write
        return Won(can_write)

    def unshare(self, owner: str, doc_id: str, user: str) -> Won | Rejected:
        doc = self._owned(owner, doc_id, user)
        if isinstance(doc, Rejected):
            return doc
        return Won(doc.acl.pop(user, None) is not None)

    def access_list(self, owner: str, doc_id: str) -> Won | Rejected:
        doc = self._owned(owner, doc_id, "")
        return doc if isinstance(doc, Rejected) else Won(dict(doc.acl))

    def server_write(self, doc_id: str, patch: Mapping) -> Won | Rejected:
        """The server-side writer (the seed's AI write): an atomic patch that bumps the version."""
        doc = self.docs.get(doc_id)
        if doc is None:
            return NOT_FOUND
        k = kind_of(doc.kind)
        try:
            k.validate_patch(doc.schema, patch)
        except KindError as e:
            return Rejected(f"invalid: {e}")
        doc.content = k.apply(doc.content, patch)
        doc.version += 1
        doc.history.append(HistoryEntry(doc.version, doc.version - 1, SERVER_AUTHOR))
        return Won(Saved(doc.version))

    # -- the HTTP operations -----------------------------------------------------------------
    def _visible(self, user: str, doc_id: str) -> ServerDoc | None:
        doc = self.docs.get(doc_id)
        return doc if doc is not None and user in doc.acl else None

    def get(self, user: str, doc_id: str) -> Won | Rejected:
        doc = self._visible(user, doc_id)
        if doc is None:
            return NOT_FOUND
        return Won(Snapshot(doc.id, doc.kind, dict(doc.schema), doc.version, dict(doc.content)))

    def put(self, user: str, doc_id: str, expected: int | None, content: Mapping, writer_id: str,
            seq: int) -> Won | VersionConflict | SeqTaken | Rejected:
        doc = self._visible(user, doc_id)
        if doc is None:
            return NOT_FOUND                      # authorization first: nothing revealed
        if not doc.acl[user]:
            return FORBIDDEN
        if expected is None:
            return PRECONDITION_REQUIRED
        try:
            kind_of(doc.kind).validate_content(doc.schema, content)
        except KindError as e:
            return Rejected(f"invalid: {e}")
        fp = save_fingerprint(user, expected, content)
        r = doc.receipts.get((user, writer_id, seq))
        if r is not None:
            if r.fingerprint == fp:               # a retry: the original success, from the receipt
                return Won(Saved(r.version, replayed=True))
            last = max(s for (u, w, s) in doc.receipts if (u, w) == (user, writer_id))
            return SeqTaken("save_seq_taken", writer_id, seq, r.version, last)
        if doc.version == expected:               # the one conditional UPDATE
            doc.content = dict(content)
            doc.version += 1
            doc.history.append(HistoryEntry(doc.version, expected, user, writer_id, seq))
            doc.receipts[(user, writer_id, seq)] = SaveReceipt(fp, doc.version)
            return Won(Saved(doc.version))
        return VersionConflict("version_conflict", doc.version, dict(doc.content))

    def create(self, user: str, writer_id: str, seq: int, content: Mapping, *, copy_of: str | None = None,
               kind: str | None = None, schema: Mapping | None = None) -> Won | Rejected:
        if copy_of is not None:
            src = self._visible(user, copy_of)
            if src is None:
                return NOT_FOUND
            kind, schema = src.kind, src.schema
        try:
            k = kind_of(kind or "")
            schema = k.validate_schema(schema)
            k.validate_content(schema, content)
        except KindError as e:
            return Rejected(f"invalid: {e}")
        new_id = created_id(user, writer_id, seq)
        fp = create_fingerprint(user, kind, schema, content)
        existing = self.docs.get(new_id)
        if existing is not None:
            if existing.receipts[(user, writer_id, seq)].fingerprint == fp:
                return Won(Created(new_id, 1, replayed=True))
            return Rejected("create_conflict")
        self.docs[new_id] = ServerDoc(new_id, kind, dict(schema), dict(content), 1, {user: True},
                                      [HistoryEntry(1, 0, user, writer_id, seq)], created_by=user,
                                      receipts={(user, writer_id, seq): SaveReceipt(fp, 1)})
        return Won(Created(new_id, 1))

    def handle(self, request: Request) -> Answer:
        """What the server answers to a session's request (the model of one HTTP exchange)."""
        if isinstance(request, SaveRequest):
            return self.put(request.user, request.doc_id, request.base_version, request.content,
                            request.writer_id, request.seq)
        if isinstance(request, ReadRequest):
            return self.get(request.user, request.doc_id)
        return self.create(request.user, request.writer_id, request.seq, request.content, copy_of=request.copy_of)


# ---------------------------------------------------------------------------------------
# The draft store (localStorage): one slot per writer.
# ---------------------------------------------------------------------------------------


def draft_record(kind: str, user: str, file_id: str, writer_id: str, *, content: Mapping, base_version: int,
                 base_content: Mapping, generation: int, next_seq: int,
                 inflight: SaveRequest | None) -> dict:
    """The JSON a draft slot holds (the implementation writes exactly this shape)."""
    return {"kind": kind, "user": user, "fileId": file_id, "writerId": writer_id,
            "content": dict(content), "baseVersion": base_version, "baseContent": dict(base_content),
            "generation": generation, "nextSeq": next_seq,
            "inflight": inflight.to_json() if inflight is not None else None}


class DraftsModel:
    def __init__(self):
        self.slots: dict[str, dict] = {}
        self.failing = False

    def write(self, key: str, record: dict) -> bool:
        if self.failing:
            return False
        self.slots[key] = copy.deepcopy(record)
        return True

    def delete(self, key: str) -> bool:
        if self.failing:
            return False
        self.slots.pop(key, None)
        return True

    def read(self, key: str) -> dict | None:
        r = self.slots.get(key)
        return copy.deepcopy(r) if r is not None else None

    def siblings(self, kind: str, user: str, file_id: str, writer_id: str) -> list[dict]:
        prefix = draft_prefix(kind, user, file_id)
        return [copy.deepcopy(r) for k, r in sorted(self.slots.items())
                if k.startswith(prefix) and r.get("writerId") != writer_id]


# ---------------------------------------------------------------------------------------
# One client session (a tab) as a model.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CloseResult:
    flushed: bool
    parked_in_draft: bool = False


class UnsavedWork(Exception):
    """Closing now would drop an edit: the save did not go through and the draft store is failing."""


class TabModel:
    """The model of one session. Fields mirror :class:`knownstate.impl.documents.session.Session`."""

    def __init__(self, tab: str, user: str, doc_id: str, kind: str, writer_id: str, drafts: DraftsModel,
                 *, debounce: float = 1.0, retry_delay: float = 0.0):
        self.tab, self.user, self.doc_id, self.kind, self.writer_id = tab, user, doc_id, kind, writer_id
        self.k = kind_of(kind)
        self.drafts = drafts
        self.debounce, self.retry_delay = debounce, retry_delay
        self.schema: dict = {}
        self.state: State | None = None
        self.local: Content = {}
        self.base_version: int = 0
        self.base_content: Content = {}
        self.generation = 0
        self.saved_generation = 0
        self.due_at: float | None = None
        self.inflight: SaveRequest | None = None
        self.unconfirmed: SaveRequest | None = None
        self.copy_inflight: CopyRequest | None = None
        self.unconfirmed_copy: CopyRequest | None = None
        self.conflict: Snapshot | None = None
        self.next_seq = 1
        self.read_seq = 0
        self.applied_read_seq = 0
        self.draft_status = "ok"
        self.draft_generation: int | None = None  # generation the durable slot holds
        self.pending_deletes: set[str] = set()
        self.siblings: list[dict] = []
        self.now = 0.0
        self.counters: dict[str, int] = {}
        self.transitions: list[tuple[str, str, str]] = []
        self._go("open")

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return draft_key(self.kind, self.user, self.doc_id, self.writer_id)

    def _count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    def _check(self, event: str) -> str:
        return TABLE.next(self.state.value, event)

    def _go(self, event: str) -> None:
        src = self.state.value if self.state is not None else CREATED
        target = TABLE.next(src, event)
        self.transitions.append((src, event, target))
        self.state = State(target)

    def _record(self, inflight: SaveRequest | None) -> dict:
        return draft_record(self.kind, self.user, self.doc_id, self.writer_id, content=self.local,
                            base_version=self.base_version, base_content=self.base_content,
                            generation=self.generation, next_seq=self.next_seq, inflight=inflight)

    def _store_ok(self) -> None:
        if self.draft_status != "ok":
            self.draft_status = "ok"
            self._count("draft_recoveries")

    def _store_failed(self) -> None:
        if self.draft_status == "ok":
            self._count("draft_failures")
        self.draft_status = "failing"

    def _store_succeeded(self) -> None:
        """A store operation other than writing our own slot went through. The status says "ok"
        only once our own slot holds our work: if it is behind, this is the retry."""
        behind = self.draft_generation != self.generation and self.state in (
            State.DIRTY, State.SAVING, State.OFFLINE, State.CONFLICT, State.COPYING)
        if self.draft_status != "ok" and behind:
            self._write_draft()
        else:
            self._store_ok()

    def _flush_deletes(self) -> None:
        for key in sorted(self.pending_deletes):
            if self.drafts.delete(key):
                self.pending_deletes.discard(key)

    def _write_draft(self) -> bool:
        self.pending_deletes.discard(self.key)
        if self.drafts.write(self.key, self._record(self.inflight or self.unconfirmed)):
            self.draft_generation = self.generation
            self._store_ok()
            self._flush_deletes()
            return True
        self._store_failed()
        return False

    def _delete_draft(self, key: str | None = None) -> None:
        key = key or self.key
        if key == self.key:
            self.draft_generation = None
        if self.drafts.delete(key):
            self.pending_deletes.discard(key)
            if key == self.key:
                self._store_ok()
            else:
                self._store_succeeded()
            self._flush_deletes()
        else:
            self.pending_deletes.add(key)
            self._store_failed()

    # -- reads ---------------------------------------------------------------------------------
    def begin_read(self, purpose: str = "refresh") -> ReadRequest:
        if purpose == "load":
            if self.state is not State.LOADING:
                raise IllegalTransition(TABLE.kind, self.state.value, "loaded")
        else:
            self._check("reloaded" if purpose == "refresh" else "discard_reloaded")
        self.read_seq += 1
        return ReadRequest(self.doc_id, self.user, self.read_seq, self.generation,
                           self.base_version if self.state is not State.LOADING else None, purpose)

    def finish_read(self, req: ReadRequest, answer: Answer) -> Won | Dropped | Rejected | NoAnswer:
        if not (isinstance(answer, Won) and isinstance(answer.value, Snapshot)):
            if req.purpose == "load" and self.state is State.LOADING:
                self._go("load_failed")
            self._count("read_failures")
            return answer if isinstance(answer, (Rejected, NoAnswer)) else NoAnswer(str(answer))
        snap: Snapshot = answer.value
        if req.purpose == "load":
            if self.state is not State.LOADING or req.read_seq <= self.applied_read_seq:
                self._count("stale_reads_dropped")
                return Dropped("out_of_order")
            self.applied_read_seq = req.read_seq
            self._load(snap)
            return Won(self.state.value)
        reason = None
        if req.read_seq <= self.applied_read_seq:
            reason = "out_of_order"
        elif req.generation != self.generation:
            reason = "raced_local_edit"
        elif self.inflight is not None or req.base_version != self.base_version:
            reason = "raced_save"
        elif snap.version < self.base_version:
            reason = "older_than_base"
        else:
            event = "reloaded" if req.purpose == "refresh" else "discard_reloaded"
            try:
                TABLE.next(self.state.value, event)
            except IllegalTransition:
                reason = f"state_changed_to_{self.state.value}"
        if reason is not None:
            self._count("stale_reads_dropped")
            return Dropped(reason)
        self.applied_read_seq = req.read_seq
        self.local, self.base_content, self.base_version = dict(snap.content), dict(snap.content), snap.version
        if req.purpose == "replace":
            self.unconfirmed = None
            self.conflict = None
            self.due_at = None
            self._delete_draft()
            self._count("discarded")
            self._go("discard_reloaded")
        else:
            self._go("reloaded")
        return Won(self.state.value)

    def _load(self, snap: Snapshot) -> None:
        self.schema = dict(snap.schema)
        own = self.drafts.read(self.key)
        self.siblings = self.drafts.siblings(self.kind, self.user, self.doc_id, self.writer_id)
        self.base_version, self.base_content, self.local = snap.version, dict(snap.content), dict(snap.content)
        if own is not None and own.get("inflight") is None and same_content(own["content"], snap.content):
            self._delete_draft()  # its work is already the stored content
            own = None
        if own is None:
            self._go("loaded")
            return
        self.local, self.base_content = dict(own["content"]), dict(own["baseContent"])
        self.base_version, self.generation = int(own["baseVersion"]), int(own["generation"])
        self.next_seq = int(own["nextSeq"])
        self.unconfirmed = SaveRequest.from_json(self.doc_id, self.user, own["inflight"]) if own["inflight"] else None
        self.draft_generation = self.generation
        self.due_at = self.now
        self._count("drafts_restored")
        self._go("restored")

    # -- edits -----------------------------------------------------------------------------------
    def edit(self, patch: Mapping, now: float | None = None) -> Won:
        self._check("edit")
        self.k.validate_patch(self.schema, patch)
        if now is not None:
            self.now = now
        self.local = self.k.apply(self.local, patch)
        self.generation += 1
        self.due_at = self.now + self.debounce
        self._go("edit")
        self._write_draft()
        return Won(self.generation)

    # -- saves -------------------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return (self.state in (State.DIRTY, State.OFFLINE) and self.inflight is None
                and self.due_at is not None and now >= self.due_at)

    def begin_save(self, now: float | None = None) -> SaveRequest:
        self._check("save")
        if now is not None:
            self.now = now
        if self.unconfirmed is not None:
            req = self.unconfirmed        # retried unchanged: the server answers it from its receipt
        else:
            req = SaveRequest(self.doc_id, self.user, self.writer_id, self.next_seq, self.base_version,
                              dict(self.local), self.generation)
            self.next_seq += 1
        self.inflight = req
        self._write_draft()               # the draft is written before the request goes out
        self._count("saves")
        self._go("save")
        return req

    def finish_save(self, req: SaveRequest, answer: Answer) -> Answer:
        if req != self.inflight:
            raise ValueError("finish_save: not the save in flight")
        self.inflight = None
        if isinstance(answer, Won):
            saved: Saved = answer.value
            self.unconfirmed = None
            self.base_version, self.base_content = saved.version, dict(req.content)
            self.saved_generation = max(self.saved_generation, req.generation)
            if saved.replayed:
                self._count("idempotent_replays")
            if self.generation == req.generation:
                self.due_at = None
                self._delete_draft()
                self._go("saved")
            else:
                self._go("saved_pending")
                self._write_draft()
        elif isinstance(answer, SeqTaken):
            # an earlier life of this writer used the seq for other content: this snapshot did
            # not land; it is sent again, at once, under a fresh seq
            self.unconfirmed = None
            self.next_seq = max(self.next_seq, answer.last_seq + 1)
            self.due_at = self.now
            self._count("seqs_taken")
            self._go("seq_taken")
            self._write_draft()
        elif isinstance(answer, VersionConflict):
            self.unconfirmed = None
            self.conflict = Snapshot(self.doc_id, self.kind, self.schema, answer.version, dict(answer.content))
            self._count("conflicts")
            self._go("version_conflict")
            self._write_draft()
        else:
            self.unconfirmed = req
            self.due_at = self.now + self.retry_delay
            self._count("save_failures")
            self._go("save_failed")
        return answer

    # -- conflict resolution -------------------------------------------------------------------------
    def rebase(self, resolve: Resolve) -> Won:
        if not self.k.can_merge:
            raise MergeUnsupported(self.kind)
        self._check("rebase")
        assert self.conflict is not None
        merged = self.k.merge(self.base_content, self.local, self.conflict.content, resolve)
        self.k.validate_content(self.schema, merged)
        self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
        self.local = merged
        self.conflict = None
        self.generation += 1
        self.due_at = self.now
        self._count("rebases")
        self._go("rebase")
        self._write_draft()
        return Won(self.generation)

    def begin_copy(self) -> CopyRequest:
        self._check("copy")
        c = self.unconfirmed_copy
        if c is not None and c.generation == self.generation:
            req = c
        else:
            req = CopyRequest(self.doc_id, self.user, self.writer_id, self.next_seq, dict(self.local), self.generation)
            self.next_seq += 1
        self.copy_inflight = req
        self._go("copy")
        return req

    def finish_copy(self, req: CopyRequest, answer: Answer) -> Answer:
        if req != self.copy_inflight:
            raise ValueError("finish_copy: not the copy in flight")
        self.copy_inflight = None
        if isinstance(answer, Won):
            assert self.conflict is not None
            self.unconfirmed_copy = None
            self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
            self.local = dict(self.conflict.content)
            self.conflict = None
            self.saved_generation = max(self.saved_generation, req.generation)
            self.due_at = None
            self._delete_draft()
            self._count("copies")
            self._go("copied")
        else:
            if isinstance(answer, NoAnswer):
                self.unconfirmed_copy = req
            self._count("copy_failures")
            self._go("copy_failed")
        return answer

    def discard(self) -> Won:
        self._check("discard")
        if self.conflict is not None:
            self.base_version, self.base_content = self.conflict.version, dict(self.conflict.content)
        self.local = dict(self.base_content)
        self.conflict = None
        self.unconfirmed = None
        self.due_at = None
        self._delete_draft()
        self._count("discarded")
        self._go("discard")
        return Won(self.state.value)

    # -- sibling drafts ----------------------------------------------------------------------------
    def _sibling(self, writer_id: str) -> dict:
        for d in self.siblings:
            if d["writerId"] == writer_id:
                return d
        raise KeyError(f"no sibling draft of writer {writer_id!r}")

    def adopt(self, writer_id: str) -> Won | Rejected:
        self._check("adopt")
        offered = self._sibling(writer_id)
        d = self.drafts.read(draft_key(self.kind, self.user, self.doc_id, writer_id))  # as it is now, not as offered
        if d is None:
            self.siblings.remove(offered)
            return Rejected("sibling_gone")
        saved = (self.local, self.base_version, self.base_content, self.generation, self.unconfirmed, self.due_at)
        self.local, self.base_content = dict(d["content"]), dict(d["baseContent"])
        self.base_version = int(d["baseVersion"])
        self.generation += 1
        self.unconfirmed = None
        if d["inflight"]:
            req = SaveRequest.from_json(self.doc_id, self.user, d["inflight"])
            # the sibling's unanswered save is retried under its own (writer, seq); it stands for
            # the adopted content only if nothing was typed after it
            gen = self.generation if same_content(req.content, d["content"]) else self.generation - 1
            self.unconfirmed = replace(req, generation=gen)
        self.due_at = self.now
        if not self._write_draft():   # the work moves only once its new slot is durable
            (self.local, self.base_version, self.base_content, self.generation, self.unconfirmed,
             self.due_at) = saved
            self.draft_generation = None
            return Rejected("draft_store_failing")
        self._delete_draft(draft_key(self.kind, self.user, self.doc_id, writer_id))
        self.siblings.remove(offered)
        self._count("siblings_adopted")
        self._go("adopt")
        return Won(writer_id)

    def discard_sibling(self, writer_id: str) -> Won | Rejected:
        if self.state is State.CLOSED:
            raise IllegalTransition(TABLE.kind, self.state.value, "discard_sibling")
        d = self._sibling(writer_id)
        if not self.drafts.delete(draft_key(self.kind, self.user, self.doc_id, writer_id)):
            self._store_failed()
            return Rejected("draft_store_failing")
        self._store_succeeded()
        self.siblings.remove(d)
        self._count("siblings_discarded")
        return Won(writer_id)

    # -- closing -------------------------------------------------------------------------------------
    def close(self, deliver: Callable[[Request], Answer], max_failures: int = 2) -> CloseResult:
        """Flush (saves ignore the debounce), then close. ``deliver`` is the network: it returns
        the server's answer or :class:`NoAnswer`. Work that could not be saved is parked in the
        durable draft; if even that fails, :class:`UnsavedWork` and nothing changes."""
        if self.state is State.CLOSED:
            return CloseResult(flushed=True)
        if self.state in (State.SAVING, State.COPYING):
            raise IllegalTransition(TABLE.kind, self.state.value, "close")
        failures = 0
        while self.state in (State.DIRTY, State.OFFLINE) and failures < max_failures:
            req = self.begin_save()
            answer = self.finish_save(req, deliver(req))
            if not isinstance(answer, Won):
                failures += 1
        if self.state in (State.CLEAN, State.LOADING):
            self._go("close")
            return CloseResult(flushed=True)
        if self.draft_generation != self.generation or self.draft_status != "ok":
            if not self._write_draft():
                raise UnsavedWork()
        self._go("close")
        return CloseResult(flushed=False, parked_in_draft=True)


# ---------------------------------------------------------------------------------------
# The whole world: server, draft store, tabs, and the ledger of unsaved edits.
# ---------------------------------------------------------------------------------------


WriterKey = tuple[str, str, str]  # (user, doc_id, writer_id)


class DocumentModel:
    """Server + draft store + tabs. Every operation the check applies to the real parts has a
    method here with the same name; it returns the outcome the real part must return."""

    def __init__(self, *, debounce: float = 1.0, retry_delay: float = 0.0):
        self.server = ServerModel()
        self.drafts = DraftsModel()
        self.tabs: dict[str, TabModel] = {}
        self.debounce, self.retry_delay = debounce, retry_delay
        # unsaved[(user, doc, writer)] = {id: value}: the latest local edit of each id that no
        # accepted save, user discard or user resolution has covered yet.
        self.unsaved: dict[WriterKey, dict[str, object]] = {}
        self.lost_visibly: dict[WriterKey, dict[str, object]] = {}
        self._edit_gen: dict[tuple[WriterKey, str], int] = {}

    # -- server side ---------------------------------------------------------------------------
    def seed(self, doc_id, kind, schema, content, owner, share=None) -> ServerDoc:
        return self.server.seed(doc_id, kind, schema, content, owner, share)

    def server_write(self, doc_id: str, patch: Mapping):
        return self.server.server_write(doc_id, patch)

    def deliver(self, request: Request) -> Answer:
        """The request reached the server: apply it and return the server's answer."""
        return self.server.handle(request)

    def set_drafts_failing(self, failing: bool) -> None:
        self.drafts.failing = failing

    # -- tabs ----------------------------------------------------------------------------------------
    def open_tab(self, tab: str, user: str, doc_id: str, kind: str, writer_id: str) -> TabModel:
        if tab in self.tabs and self.tabs[tab].state is not State.CLOSED:
            raise ValueError(f"tab {tab!r} is open")
        t = self.tabs[tab] = TabModel(tab, user, doc_id, kind, writer_id, self.drafts,
                                      debounce=self.debounce, retry_delay=self.retry_delay)
        return t

    def _wk(self, t: TabModel) -> WriterKey:
        return (t.user, t.doc_id, t.writer_id)

    # begin_* change nothing the ledger tracks; finish_* must go through this class (it keeps
    # the ledger of unsaved edits the invariants read).
    def begin_read(self, tab: str, purpose: str = "refresh") -> ReadRequest:
        return self.tabs[tab].begin_read(purpose)

    def begin_save(self, tab: str, now: float | None = None) -> SaveRequest:
        return self.tabs[tab].begin_save(now)

    def begin_copy(self, tab: str) -> CopyRequest:
        return self.tabs[tab].begin_copy()

    def tick(self, tab: str, now: float, deliver: Callable[[Request], Answer] | None = None):
        """Like the session's ``tick``: when the save is due, one request through ``deliver``."""
        t = self.tabs[tab]
        t.now = now
        if not t.due(now):
            return None
        req = t.begin_save()
        return self.finish_save(tab, req, (deliver or self.deliver)(req))

    def finish_read(self, tab: str, req: ReadRequest, answer: Answer):
        t = self.tabs[tab]
        before = t.state
        out = t.finish_read(req, answer)
        if isinstance(out, Won):
            if req.purpose == "replace":
                self.unsaved.pop(self._wk(t), None)
            elif req.purpose == "load" and before is State.LOADING and t.state is State.CLEAN:
                # the writer's own draft held nothing the server lacks: its edits are stored
                led = self.unsaved.get(self._wk(t), {})
                for k, v in list(led.items()):
                    if same(t.local.get(k), v):
                        del led[k]
        return out

    def edit(self, tab: str, patch: Mapping, now: float | None = None):
        t = self.tabs[tab]
        out = t.edit(patch, now)
        led = self.unsaved.setdefault(self._wk(t), {})
        for k, v in patch.items():
            led[k] = v
            self._edit_gen[(self._wk(t), k)] = t.generation
        return out

    def _secure(self, t: TabModel, writer: WriterKey, up_to_generation: int) -> None:
        led = self.unsaved.get(writer, {})
        for k in list(led):
            if self._edit_gen.get((writer, k), 0) <= up_to_generation:
                del led[k]
        if not led:
            self.unsaved.pop(writer, None)

    def finish_save(self, tab: str, req: SaveRequest, answer: Answer):
        t = self.tabs[tab]
        out = t.finish_save(req, answer)
        if isinstance(out, Won):
            self._secure(t, (t.user, t.doc_id, req.writer_id), req.generation)
            if req.writer_id != t.writer_id:
                self._secure(t, self._wk(t), req.generation)
        return out

    def rebase(self, tab: str, resolve: Resolve):
        t = self.tabs[tab]
        out = t.rebase(resolve)
        led = self.unsaved.get(self._wk(t), {})
        for k, v in list(led.items()):
            if not same(t.local.get(k), v):
                del led[k]                       # the user's resolution chose another value
            else:
                self._edit_gen[(self._wk(t), k)] = t.generation
        return out

    def finish_copy(self, tab: str, req: CopyRequest, answer: Answer):
        t = self.tabs[tab]
        out = t.finish_copy(req, answer)
        if isinstance(out, Won):
            self.unsaved.pop(self._wk(t), None)  # the work is saved, in the copy
        return out

    def discard(self, tab: str):
        t = self.tabs[tab]
        out = t.discard()
        self.unsaved.pop(self._wk(t), None)
        return out

    def adopt(self, tab: str, writer_id: str):
        t = self.tabs[tab]
        out = t.adopt(writer_id)
        if isinstance(out, Won):
            src = (t.user, t.doc_id, writer_id)
            left = self.unsaved.pop(src, {})
            # what the adopted draft held moves to this writer; what it did not hold (typed
            # while the store was failing) stays with the writer whose tab has it in memory
            moved = {k: v for k, v in left.items() if same(t.local.get(k), v)}
            if len(moved) < len(left):
                self.unsaved[src] = {k: v for k, v in left.items() if k not in moved}
            if moved:
                self.unsaved.setdefault(self._wk(t), {}).update(moved)
                for k in moved:
                    self._edit_gen[(self._wk(t), k)] = t.generation
        return out

    def discard_sibling(self, tab: str, writer_id: str):
        t = self.tabs[tab]
        out = t.discard_sibling(writer_id)
        if isinstance(out, Won):
            self.unsaved.pop((t.user, t.doc_id, writer_id), None)
        return out

    def close(self, tab: str, deliver: Callable[[Request], Answer] | None = None, max_failures: int = 2):
        """Close with a network: ``deliver`` defaults to a healthy one (the server answers)."""
        t = self.tabs[tab]
        net = deliver or self.deliver

        def through(req):
            answer = net(req)
            if isinstance(answer, Won) and isinstance(req, SaveRequest):
                self._secure(t, (t.user, t.doc_id, req.writer_id), req.generation)
                if req.writer_id != t.writer_id:
                    self._secure(t, self._wk(t), req.generation)
            return answer

        return t.close(through, max_failures)

    def crash_tab(self, tab: str) -> None:
        """The tab dies (closed mid-save, killed): memory is gone, the draft store stays.
        Unsaved edits its draft does not hold were in memory only, behind a visible failure status."""
        t = self.tabs.pop(tab)
        wk = self._wk(t)
        led = self.unsaved.get(wk, {})
        slot = self.drafts.read(t.key)
        for k, v in list(led.items()):
            if slot is None or not same(slot["content"].get(k), v):
                self.lost_visibly.setdefault(wk, {})[k] = v
                del led[k]
        if not led:
            self.unsaved.pop(wk, None)

    # -- the world, as the invariants read it ------------------------------------------------------
    def world(self) -> "World":
        docs = {d.id: DocView(d.id, d.kind, d.version, dict(d.content), tuple(d.history))
                for d in self.server.docs.values()}
        drafts = {k: DraftView.from_record(k, r) for k, r in self.drafts.slots.items()}
        tabs = {t.tab: TabView(t.tab, t.user, t.doc_id, t.writer_id, t.kind, t.state.value, dict(t.local),
                               t.base_version, t.generation, t.draft_status, tuple(t.transitions))
                for t in self.tabs.values()}
        return World(docs, drafts, tabs)

    def ledger(self) -> "Ledger":
        return Ledger({k: dict(v) for k, v in self.unsaved.items() if v},
                      {k: dict(v) for k, v in self.lost_visibly.items() if v})


# ---------------------------------------------------------------------------------------
# Views (what a projection of the real state must produce) and the invariants.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocView:
    id: str
    kind: str
    version: int
    content: Content
    history: tuple[HistoryEntry, ...] = ()


@dataclass(frozen=True)
class DraftView:
    key: str
    kind: str
    user: str
    doc_id: str
    writer_id: str
    content: Content
    base_version: int
    generation: int
    inflight_seq: int | None

    @classmethod
    def from_record(cls, key: str, r: Mapping) -> "DraftView":
        inflight = r.get("inflight")
        return cls(key, r["kind"], r["user"], r["fileId"], r["writerId"], dict(r["content"]),
                   int(r["baseVersion"]), int(r["generation"]), int(inflight["seq"]) if inflight else None)


@dataclass(frozen=True)
class TabView:
    tab: str
    user: str
    doc_id: str
    writer_id: str
    kind: str
    state: str
    local: Content
    base_version: int
    generation: int
    draft_status: str
    transitions: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class World:
    docs: Mapping[str, DocView]
    drafts: Mapping[str, DraftView]
    tabs: Mapping[str, TabView]  # live and closed sessions (a crashed tab is gone)


@dataclass(frozen=True)
class Ledger:
    """The edits the check made that nothing has covered yet (from the model)."""

    unsaved: Mapping[WriterKey, Mapping[str, object]]
    lost_visibly: Mapping[WriterKey, Mapping[str, object]] = field(default_factory=dict)


INVARIANTS: dict[str, str] = {
    "save-carries-base-version": "Every save carries its base version, and the server rejects a stale one.",
    "unsaved-work-in-one-place": "Unsaved work exists in exactly one place per writer, and nothing deletes it "
                                 "until a save of that work succeeded or the user discarded it.",
    "conflict-resolved-by-user": "A conflict is a state the user resolves; it is never resolved by last-write-wins.",
    "close-flushes-never-drops": "The session's lifetime is the document's, not a component's. Closing flushes, "
                                 "never drops.",
    "no-edit-lost-silently": "Each edit is in the stored content, in a draft, or was explicitly discarded.",
    "no-stale-save-accepted": "No save based on a stale version is ever accepted.",
    "no-last-write-wins": "A conflict is never resolved by last-write-wins.",
    "one-version-per-save":
        "A save's identity (user, writerId, saveSeq) produces at most one version: a reused one "
        "with other content is refused, never applied.",
}


def _writer_tabs(world: World) -> dict[WriterKey, TabView]:
    out: dict[WriterKey, TabView] = {}
    for t in world.tabs.values():
        wk = (t.user, t.doc_id, t.writer_id)
        if wk not in out or out[wk].state == Z:
            out[wk] = t
    return out


def save_carries_base_version(world: World, sent: Iterable[SaveRequest] = ()) -> list[Violation]:
    out = []
    for r in sent:
        if not isinstance(r.base_version, int) or isinstance(r.base_version, bool) or r.base_version < 1:
            out.append(Violation("save-carries-base-version",
                                 f"writer {r.writer_id} sent save #{r.seq} without a base version ({r.base_version!r})"))
    for d in world.docs.values():
        for h in d.history:
            if h.base_version is None:
                out.append(Violation("save-carries-base-version",
                                     f"document {d.id} v{h.version} was accepted without a base version"))
    return out


def no_stale_save_accepted(world: World) -> list[Violation]:
    out = []
    for d in world.docs.values():
        versions = [h.version for h in d.history]
        for h in d.history:
            if h.base_version is not None and h.version != h.base_version + 1:
                out.append(Violation("no-stale-save-accepted",
                                     f"document {d.id}: v{h.version} by {h.author} was based on v{h.base_version}"))
        if versions != list(range(1, len(versions) + 1)) or (versions and versions[-1] != d.version):
            out.append(Violation("no-stale-save-accepted",
                                 f"document {d.id}: history versions {versions} do not lead to v{d.version}"))
    return out


def one_version_per_save(world: World) -> list[Violation]:
    out = []
    for d in world.docs.values():
        seen: dict[tuple, int] = {}
        for h in d.history:
            if h.writer_id is None:
                continue
            key = (h.author, h.writer_id, h.save_seq)
            if key in seen:
                out.append(Violation("one-version-per-save",
                                     f"document {d.id}: save {h.writer_id}#{h.save_seq} of "
                                     f"{h.author} produced v{seen[key]} and v{h.version}"))
            seen[key] = h.version
    return out


def unsaved_work_in_one_place(world: World, ledger: Ledger) -> list[Violation]:
    out = []
    seen: dict[WriterKey, str] = {}
    for key, d in world.drafts.items():
        expected = draft_key(d.kind, d.user, d.doc_id, d.writer_id)
        if key != expected:
            out.append(Violation("unsaved-work-in-one-place",
                                 f"draft of writer {d.writer_id} is in slot {key!r}, not its own {expected!r}"))
        wk = (d.user, d.doc_id, d.writer_id)
        if wk in seen:
            out.append(Violation("unsaved-work-in-one-place",
                                 f"writer {d.writer_id} has drafts in two slots: {seen[wk]!r} and {key!r}"))
        seen[wk] = key
    tabs = _writer_tabs(world)
    for wk, edits in ledger.unsaved.items():
        t = tabs.get(wk)
        if t is not None and t.state not in (Z, L) and t.draft_status == "failing":
            continue
        if edits and wk not in seen:
            out.append(Violation("unsaved-work-in-one-place",
                                 f"writer {wk[2]} of {wk[0]} on {wk[1]} has unsaved edits {sorted(edits)} "
                                 "and no draft, with no failure reported"))
    return out


def no_edit_lost_silently(world: World, ledger: Ledger) -> list[Violation]:
    out = []
    tabs = _writer_tabs(world)
    slots = {(d.user, d.doc_id, d.writer_id): d for d in world.drafts.values()
             if d.key == draft_key(d.kind, d.user, d.doc_id, d.writer_id)}
    for wk, edits in ledger.unsaved.items():
        t = tabs.get(wk)
        alive = t is not None and t.state not in (Z, L)  # a tab still loading holds nothing yet
        slot = slots.get(wk)
        doc = world.docs.get(wk[1])
        for k, v in sorted(edits.items()):
            if doc is not None and same(doc.content.get(k), v) and not (alive and not same(t.local.get(k), v)):
                continue  # in the stored content
            in_draft = slot is not None and same(slot.content.get(k), v)
            if alive:
                if not same(t.local.get(k), v):
                    out.append(Violation("no-edit-lost-silently",
                                         f"tab {t.tab}: edit {k}={v!r} is gone from the local copy "
                                         "though no save, discard or resolution covered it"))
                elif not in_draft and t.draft_status != "failing":
                    out.append(Violation("no-edit-lost-silently",
                                         f"tab {t.tab}: unsaved edit {k}={v!r} is in no draft, and the "
                                         "draft store reports no failure"))
            elif not in_draft:
                out.append(Violation("no-edit-lost-silently",
                                     f"writer {wk[2]}: unsaved edit {k}={v!r} survives nowhere after its tab ended"))
    return out


def close_flushes_never_drops(world: World, ledger: Ledger) -> list[Violation]:
    out = []
    slots = {(d.user, d.doc_id, d.writer_id): d for d in world.drafts.values()}
    current = _writer_tabs(world)
    for t in world.tabs.values():
        if t.state != Z:
            continue
        if t.transitions and t.transitions[-1][1] != "close":
            out.append(Violation("close-flushes-never-drops", f"tab {t.tab} is closed without a close event"))
        wk = (t.user, t.doc_id, t.writer_id)
        if current.get(wk) is not t:
            continue  # the writer reopened the document: its live tab holds the work now
        edits = ledger.unsaved.get(wk, {})
        slot = slots.get(wk)
        doc = world.docs.get(t.doc_id)
        for k, v in sorted(edits.items()):
            if doc is not None and same(doc.content.get(k), v):
                continue
            if slot is None or not same(slot.content.get(k), v):
                out.append(Violation("close-flushes-never-drops",
                                     f"tab {t.tab} closed with edit {k}={v!r} neither saved nor parked in its draft"))
    return out


def conflict_resolved_by_user(world: World) -> list[Violation]:
    out = []
    for t in world.tabs.values():
        for src, event, dst in t.transitions:
            if src == X and dst != X and event not in USER_EVENTS:
                out.append(Violation("conflict-resolved-by-user",
                                     f"tab {t.tab} left conflict by {event!r}, which no user caused"))
            if src == X and not TABLE.allows(src, dst):
                out.append(Violation("conflict-resolved-by-user",
                                     f"tab {t.tab} moved {src} -> {dst}, which the session table does not allow"))
    return out


def no_last_write_wins(world: World, expected: World) -> list[Violation]:
    """Where the model holds a tab in conflict (or closed it straight from conflict, its work
    parked in its draft), the real tab is in conflict too (or closed) and no save of its writer has
    landed since: nothing overwrote the stored copy behind the user's back."""
    out = []
    for tab, m in expected.tabs.items():
        parked = m.state == Z and bool(m.transitions) and m.transitions[-1][0] == X
        if m.state != X and not parked:
            continue
        real = world.tabs.get(tab)
        if real is None or real.state != (Z if parked else X):
            out.append(Violation("no-last-write-wins",
                                 f"tab {tab} should be in conflict, is {real.state if real else 'gone'}"))
        md, rd = expected.docs.get(m.doc_id), world.docs.get(m.doc_id)
        if md is not None and rd is not None:
            extra = [h for h in rd.history if h.version > md.version and h.writer_id == m.writer_id]
            if extra or (rd.version == md.version and not same_content(rd.content, md.content)):
                out.append(Violation("no-last-write-wins",
                                     f"document {m.doc_id}: writer {m.writer_id}'s copy was stored while its tab "
                                     "was in conflict"))
    return out


def check_invariants(world: World, ledger: Ledger, *, expected: World | None = None,
                     sent: Iterable[SaveRequest] = ()) -> list[Violation]:
    """All eight invariants over one world (the model's own, or a projection of the real one).
    ``expected`` is the model's world, for the comparisons only it can judge."""
    out = save_carries_base_version(world, sent)
    out += no_stale_save_accepted(world)
    out += one_version_per_save(world)
    out += unsaved_work_in_one_place(world, ledger)
    out += no_edit_lost_silently(world, ledger)
    out += close_flushes_never_drops(world, ledger)
    out += conflict_resolved_by_user(world)
    if expected is not None:
        out += no_last_write_wins(world, expected)
    return out
