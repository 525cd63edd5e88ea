"""The document protocol's vocabulary: what crosses the network, and the facts both sides share.

Requests (:class:`SaveRequest`, :class:`ReadRequest`, :class:`CopyRequest`) and answers
(``Won(Snapshot | Saved | Created)``, :class:`VersionConflict`, :class:`SeqTaken`,
``Rejected(reason)``, :class:`NoAnswer`) are what the session sends and receives, what the
model's server answers, and what the real transport maps an HTTP exchange to. The fingerprints,
the created-document id and the draft slot key are each defined once, here, and imported by the
implementation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

from .contract import LostRace, Rejected, Won
from .document_kinds import Content

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
        return {
            "writerId": self.writer_id,
            "seq": self.seq,
            "baseVersion": self.base_version,
            "content": dict(self.content),
            "generation": self.generation,
        }

    @classmethod
    def from_json(cls, doc_id: str, user: str, d: Mapping) -> "SaveRequest":
        return cls(
            doc_id,
            user,
            d["writerId"],
            int(d["seq"]),
            int(d["baseVersion"]),
            dict(d["content"]),
            int(d["generation"]),
        )


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
    """The save's base version is not the stored one: the stored version and content come
    with it."""

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
    """The request or its answer was lost (or the server failed): it may or may not have been
    applied."""

    reason: str = ""


@dataclass(frozen=True)
class Dropped:
    """A read that arrived stale (out of order, or raced a local edit or save) and was not
    applied."""

    reason: str


Answer = Won | VersionConflict | SeqTaken | Rejected | NoAnswer

NOT_FOUND = Rejected("not_found")
FORBIDDEN = Rejected("forbidden")
PRECONDITION_REQUIRED = Rejected("precondition_required")
NOT_OWNER = Rejected("not_owner")
OWNER_ACCESS = Rejected("owner_access")
