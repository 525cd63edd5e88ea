"""The document session's ports and what it shows, apart from its state machine
(:mod:`.document_session`, which re-exports every name here):

- the **draft store**, the session's durable port: its protocol (:class:`DraftPort`), the one
  record shape every store writes (:func:`draft_record`), the error of a store that refuses
  (:class:`DraftStoreError`), and the in-memory store the model uses (:class:`DraftsModel`;
  the real one is :class:`knownstate.impl.documents.drafts.DraftStore`);
- the **listener** that hears what the session did with the user's work
  (:class:`SessionListener`: the model's ledger of unsaved edits);
- what a tab **shows** (:class:`TabView`) and how **closing** ends (:class:`CloseResult`, or
  :class:`UnsavedWork`).

None of it changes a session's state: that all lives in :mod:`.document_session`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol

from .document_kinds import Content
from .document_protocol import CopyRequest, SaveRequest, draft_key, draft_prefix

if TYPE_CHECKING:
    from .document_session import SessionCore


class DraftStoreError(Exception):
    """The draft store refused to write: the draft is not durable."""


class DraftPort(Protocol):
    def key(self, kind: str, user: str, file_id: str, writer_id: str) -> str: ...

    def write(self, key: str, record: dict) -> None: ...  # raises DraftStoreError

    def delete(self, key: str) -> None: ...  # raises DraftStoreError

    def read(self, key: str) -> dict | None: ...

    def siblings(self, kind: str, user: str, file_id: str, writer_id: str) -> list[dict]: ...


def draft_record(
    kind: str,
    user: str,
    file_id: str,
    writer_id: str,
    *,
    content: Mapping,
    base_version: int,
    base_content: Mapping,
    generation: int,
    next_seq: int,
    inflight: SaveRequest | None,
) -> dict:
    """The JSON a draft slot holds (every draft store writes exactly this shape)."""
    return {
        "kind": kind,
        "user": user,
        "fileId": file_id,
        "writerId": writer_id,
        "content": dict(content),
        "baseVersion": base_version,
        "baseContent": dict(base_content),
        "generation": generation,
        "nextSeq": next_seq,
        "inflight": inflight.to_json() if inflight is not None else None,
    }


class DraftsModel:
    """The draft store in memory; ``failing`` refuses every write and delete."""

    def __init__(self):
        self.slots: dict[str, dict] = {}
        self.failing = False

    def key(self, kind: str, user: str, file_id: str, writer_id: str) -> str:
        return draft_key(kind, user, file_id, writer_id)

    def _refuse_if_failing(self, what: str, key: str) -> None:
        if self.failing:
            raise DraftStoreError(f"{what} {key!r}: the draft store is failing")

    def write(self, key: str, record: dict) -> None:
        self._refuse_if_failing("write", key)
        self.slots[key] = copy.deepcopy(record)

    def delete(self, key: str) -> None:
        self._refuse_if_failing("delete", key)
        self.slots.pop(key, None)

    def read(self, key: str) -> dict | None:
        r = self.slots.get(key)
        return copy.deepcopy(r) if r is not None else None

    def siblings(self, kind: str, user: str, file_id: str, writer_id: str) -> list[dict]:
        prefix = draft_prefix(kind, user, file_id)
        return [
            copy.deepcopy(r)
            for k, r in sorted(self.slots.items())
            if k.startswith(prefix) and r.get("writerId") != writer_id
        ]


# ---------------------------------------------------------------------------------------
# What a session shows, and how closing ends.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TabView:
    """A tab as its user sees it (nothing the session keeps to itself)."""

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
    siblings: tuple[str, ...] = ()  # the writers whose drafts it offers to adopt or discard
    conflict_version: int | None = None  # in a conflict: the stored version it shows


@dataclass(frozen=True)
class CloseResult:
    flushed: bool
    parked_in_draft: bool = False


class UnsavedWork(Exception):
    """Closing now would drop an edit: the save did not go through and the draft store is
    failing."""


class SessionListener(Protocol):
    """What a session tells about the user's work, once each event has happened."""

    def edited(self, session: "SessionCore", patch: Mapping) -> None: ...

    def saved(self, session: "SessionCore", request: SaveRequest) -> None: ...

    def loaded_clean(self, session: "SessionCore") -> None: ...

    def discarded(self, session: "SessionCore") -> None: ...

    def rebased(self, session: "SessionCore") -> None: ...

    def copied(self, session: "SessionCore", request: CopyRequest) -> None: ...

    def adopted(self, session: "SessionCore", writer_id: str) -> None: ...

    def sibling_discarded(self, session: "SessionCore", writer_id: str) -> None: ...
