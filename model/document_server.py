"""The document server, as a pure model: what it answers, and what it stores.

Authoritative. A document has a kind, a schema, a content map, a version, an access list and a
history. Every save carries the version it was based on and is one compare-and-swap: it lands
only when that base is still the stored version (a stale base is a :class:`VersionConflict`
carrying the stored version and content; a missing base is refused). Authorization comes
first: a user without access learns nothing, not even the version. A save's identity is
``(user, writerId, saveSeq)`` and its receipt is kept with it: a retry whose first answer was
lost gets the original success, not a conflict against itself, and the same identity with other
content is refused (:class:`SeqTaken`). Only a document's owner changes who may read and write
it. :class:`knownstate.impl.documents.store.DocumentStore` has the same operations on
PostgreSQL and must answer as this does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .contract import Rejected, Won
from .document_kinds import SERVER_AUTHOR, Content, KindError, kind_of, new_document
from .document_protocol import (
    FORBIDDEN,
    NOT_FOUND,
    NOT_OWNER,
    OWNER_ACCESS,
    PRECONDITION_REQUIRED,
    Answer,
    Created,
    ReadRequest,
    Request,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    VersionConflict,
    create_fingerprint,
    created_id,
    save_fingerprint,
)


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
    def seed(
        self,
        doc_id: str,
        kind: str,
        schema: Mapping,
        content: Mapping,
        owner: str,
        share: Mapping[str, bool] | None = None,
    ) -> ServerDoc:
        schema = new_document(kind, schema, content)
        doc = ServerDoc(
            doc_id,
            kind,
            schema,
            dict(content),
            1,
            {owner: True, **dict(share or {})},
            [HistoryEntry(1, 0, owner)],
            created_by=owner,
        )
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

    def put(
        self,
        user: str,
        doc_id: str,
        expected: int | None,
        content: Mapping,
        writer_id: str,
        seq: int,
    ) -> Won | VersionConflict | SeqTaken | Rejected:
        doc = self._visible(user, doc_id)
        if doc is None:
            return NOT_FOUND  # authorization first: nothing revealed
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
            if r.fingerprint == fp:  # a retry: the original success, from the receipt
                return Won(Saved(r.version, replayed=True))
            last = max(s for (u, w, s) in doc.receipts if (u, w) == (user, writer_id))
            return SeqTaken("save_seq_taken", writer_id, seq, r.version, last)
        if doc.version == expected:  # the one conditional UPDATE
            doc.content = dict(content)
            doc.version += 1
            doc.history.append(HistoryEntry(doc.version, expected, user, writer_id, seq))
            doc.receipts[(user, writer_id, seq)] = SaveReceipt(fp, doc.version)
            return Won(Saved(doc.version))
        return VersionConflict("version_conflict", doc.version, dict(doc.content))

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
        if copy_of is not None:
            src = self._visible(user, copy_of)
            if src is None:
                return NOT_FOUND
            kind, schema = src.kind, src.schema
        try:
            schema = new_document(kind, schema, content)
        except KindError as e:
            return Rejected(f"invalid: {e}")
        new_id = created_id(user, writer_id, seq)
        fp = create_fingerprint(user, kind, schema, content)
        existing = self.docs.get(new_id)
        if existing is not None:
            if existing.receipts[(user, writer_id, seq)].fingerprint == fp:
                return Won(Created(new_id, 1, replayed=True))
            return Rejected("create_conflict")
        self.docs[new_id] = ServerDoc(
            new_id,
            kind,
            dict(schema),
            dict(content),
            1,
            {user: True},
            [HistoryEntry(1, 0, user, writer_id, seq)],
            created_by=user,
            receipts={(user, writer_id, seq): SaveReceipt(fp, 1)},
        )
        return Won(Created(new_id, 1))

    def handle(self, request: Request) -> Answer:
        """What the server answers to a session's request (the model of one HTTP exchange)."""
        if isinstance(request, SaveRequest):
            return self.put(
                request.user,
                request.doc_id,
                request.base_version,
                request.content,
                request.writer_id,
                request.seq,
            )
        if isinstance(request, ReadRequest):
            return self.get(request.user, request.doc_id)
        return self.create(
            request.user, request.writer_id, request.seq, request.content, copy_of=request.copy_of
        )
