"""The durable per-writer draft store: a file-backed stand-in for the browser's localStorage.

One JSON file per key in a directory; a write goes to a temp file, is fsynced, and replaces
the old file atomically, so a crash leaves either the old draft or the new one, never half.
It is the session's draft-store port (:class:`knownstate.model.document_session.DraftPort`).
The key of a writer's slot is :func:`knownstate.model.document.draft_key`
(``knownstate:{kind}-draft:{user}:{file}:{writerId}``): one writer never erases another's draft.

``fail_writes`` is the injectable fault: while set, every write and delete raises
:class:`DraftStoreError` (a full disk, a quota, a private-mode browser). The session reports it
as a visible status and retries on its next write; nothing here latches.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from urllib.parse import quote, unquote

from knownstate.model.document import DraftStoreError, DraftView, draft_key, draft_prefix

__all__ = ["DraftStore", "DraftStoreError"]

_SUFFIX = ".json"


class DraftStore:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fail_writes = False
        self.writes = 0
        self.refused = 0

    # -- keys -----------------------------------------------------------------------------------
    def key(self, kind: str, user: str, file_id: str, writer_id: str) -> str:
        return draft_key(kind, user, file_id, writer_id)

    def prefix(self, kind: str, user: str, file_id: str) -> str:
        return draft_prefix(kind, user, file_id)

    def _path(self, key: str) -> Path:
        return self.directory / (quote(key, safe="") + _SUFFIX)

    # -- the fault ---------------------------------------------------------------------
    @contextlib.contextmanager
    def failing(self):
        """Every write and delete fails inside the block."""
        before, self.fail_writes = self.fail_writes, True
        try:
            yield self
        finally:
            self.fail_writes = before

    def _refuse_if_failing(self, what: str, key: str) -> None:
        if self.fail_writes:
            self.refused += 1
            raise DraftStoreError(f"{what} {key!r}: the draft store is failing")

    # -- operations ----------------------------------------------------------------------
    def write(self, key: str, record: dict) -> None:
        self._refuse_if_failing("write", key)
        data = json.dumps(record, sort_keys=True, ensure_ascii=True).encode()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.writes += 1

    def read(self, key: str) -> dict | None:
        try:
            return json.loads(self._path(key).read_bytes())
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        self._refuse_if_failing("delete", key)
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def keys(self, prefix: str = "") -> list[str]:
        out = []
        for p in self.directory.iterdir():
            if p.name.endswith(_SUFFIX) and not p.name.startswith(".tmp-"):
                key = unquote(p.name[: -len(_SUFFIX)])
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def siblings(self, kind: str, user: str, file_id: str, writer_id: str) -> list[dict]:
        """The drafts other writers of the same user left on the same document."""
        out = []
        for key in self.keys(self.prefix(kind, user, file_id)):
            record = self.read(key)
            if record is not None and record.get("writerId") != writer_id:
                out.append(record)
        return out

    def views(self) -> dict[str, DraftView]:
        """Every draft in the model's view shape, keyed by the slot it is really in."""
        out = {}
        for key in self.keys():
            record = self.read(key)
            if record is not None:
                out[key] = DraftView.from_record(key, record)
        return out

    def clear(self) -> None:
        for key in self.keys():
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
