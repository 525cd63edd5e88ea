"""The document session's mutant catalogue: realistic bugs, each caught by the check with the
invariant it declares (``knownstate mutants document-session``).

A mutant overrides one seam of the reference — one method of the session machine, one step of
how the server reads a request, one named SQL query, the draft store's key — through the
check's class attributes (``session_class``, ``reader_class``, ``store_class``,
``drafts_class``, ``queries``, ``schema``). It never copies a reference method's body, so it
cannot go stale silently when the reference changes; an SQL edit that no longer applies raises
:class:`~knownstate.chaos.mutants.CatalogueDrift`.
"""

from __future__ import annotations

import json

from knownstate.impl.documents import store as store_impl
from knownstate.impl.documents.drafts import DraftStore
from knownstate.impl.documents.reading import BadRequest, RequestReader
from knownstate.impl.documents.session import Session
from knownstate.impl.documents.store import DocumentStore
from knownstate.model.contract import Won
from knownstate.model.document import RecordKind, SheetKind, State, VersionConflict, prefer_local

from ..mutants import Mutant, sql_edit, with_attrs

_Q = store_impl.Q
KIND = "document-session"


# -- the session ----------------------------------------------------------------------------


class _SuccessWipesPendingEdit(Session):
    """The save's answer handler takes the saved snapshot as the local copy: an edit typed while
    the save was in flight is wiped (the autosave bug of the seed)."""

    def finish_save(self, req, answer):
        if isinstance(answer, Won) and req == self.inflight:
            self.local = dict(req.content)
        return super().finish_save(req, answer)


class _ReadGuardWithoutOrder(Session):
    """The stale-read guard checks only a local edit and a save in flight: a read answered late,
    after a newer one, is applied."""

    read_guards = ("_read_raced_local_edit", "_read_during_save")


class _ReadGuardWithoutGeneration(Session):
    """A discard-and-reload skips the generation check ("the user discards anyway"): its answer,
    arriving after the user typed again, wipes the new edit."""

    def _read_raced_local_edit(self, req, snap):
        return super()._read_raced_local_edit(req, snap) if req.purpose == "refresh" else None


class _ReloadClearsFirst(Session):
    """discard_and_reload() clears the local copy and its draft first, then fetches."""

    def begin_read(self, purpose="refresh"):
        req = super().begin_read(purpose)
        if purpose == "replace":
            self.local = dict(self.base_content)
            self._delete_draft()
        return req


class _AutoRebase(Session):
    """A conflict is resolved on the spot by merging, local values winning: no user involved."""

    def finish_save(self, req, answer):
        out = super().finish_save(req, answer)
        if isinstance(answer, VersionConflict) and self.k.can_merge:
            self.rebase(prefer_local)
        return out


class _CloseDropsPending(Session):
    """close() cancels the debounce timer: an edit not sent yet is dropped instead of flushed."""

    def close(self, max_failures: int = 2):
        if self.state is State.DIRTY:
            self.local, self.due_at = dict(self.base_content), None
            self._delete_draft()
            self._go("discard")
        return super().close(max_failures)


class _DraftSlotWithoutWriter(DraftStore):
    """The draft key leaves out the writer id: every tab of a user shares one slot per
    document."""

    def key(self, kind, user, file_id, writer_id):
        return f"knownstate:{kind}-draft:{user}:{file_id}"


# -- the server: how it reads a request ---------------------------------------------------------


def _match_with_dollar(pattern, text):
    return pattern.match(text)  # "$" also matches before a trailing newline


class _DollarRecord(RecordKind):
    matches = staticmethod(_match_with_dollar)


class _DollarSheet(SheetKind):
    matches = staticmethod(_match_with_dollar)


class _DollarIdStore(DocumentStore):
    kinds = {"record": _DollarRecord(), "sheet": _DollarSheet()}


class _LastKeyWins(RequestReader):
    def object_from_pairs(self, pairs):
        return dict(pairs)


class _SniffedEncoding(RequestReader):
    def decode(self, raw):
        return raw.decode(json.detect_encoding(raw))


class _NumericETag(RequestReader):
    def tag_version(self, opaque, *, weak):
        return int(opaque) if opaque.isdigit() and int(opaque) > 0 else None


class _FirstHeaderWins(RequestReader):
    def header(self, headers, name):
        values = headers.getlist(name)
        return values[0] if values else None


class _AnyContentType(RequestReader):
    def content_type(self, headers):
        return None


class _NotJson422(RequestReader):
    def not_json(self, what):
        return BadRequest(422, "invalid_request", f"0: JSON decode error ({what})")


class _RedirectSlashes(RequestReader):
    redirect_slashes = True


# -- the server: its SQL ------------------------------------------------------------------------

_BASE_GUARD = "AND d.version = %(expected)s\n      AND EXISTS"
_RECEIPT_KEY = "AND h.writer_id = %(writer)s AND h.save_seq = %(seq)s\n) r"
_SEQ_GUARD = """
      AND NOT EXISTS (SELECT 1 FROM document_history h
                      WHERE h.document_id = d.id AND h.author = %(user)s
                        AND h.writer_id = %(writer)s AND h.save_seq = %(seq)s)"""
_UNIQUE_SAVE = """create unique index if not exists document_history_save
    on document_history (document_id, author, writer_id, save_seq) where writer_id is not null;"""


_NO_RECEIPT = "AND false\n) r"  # the ``missed`` read finds no receipt
_VERSION_SQL = "SELECT version FROM documents WHERE id = %(id)s"


# -- the server under concurrency: its compare-and-swap and its receipts -------------------------


class _CasInPython(DocumentStore):
    """The compare-and-swap is a read of the version, a comparison in Python, then the UPDATE by
    id (the ``save`` query without its version guard): two saves on one version both read it,
    both compare equal, and both land (a lost update)."""

    def _swap(self, conn, args):
        row = conn.execute(_VERSION_SQL, args).fetchone()
        if row is None or row[0] != args["expected"]:
            return None
        return super()._swap(conn, args)


class _ReceiptBeforeSwapOnly(DocumentStore):
    """A save's receipt is looked up before the compare-and-swap, and only then: a retry racing
    its original finds no receipt yet, then misses the swap the original made, and is answered
    with a conflict against itself."""

    def _swap(self, conn, args):
        row = conn.execute(_Q["missed"], args).fetchone()
        if row is not None and row[1] is not None:
            return self._missed(row, args)
        return super()._swap(conn, args)


def _schema_without(text: str) -> str:
    schema = store_impl.schema_sql()
    if text not in schema:
        raise RuntimeError(f"mutant schema edit: {text!r} not found")
    return schema.replace(text, "")


MUTANTS = [
    Mutant(
        "server-ignores-base-version",
        KIND,
        "no-stale-save-accepted",
        "the save's UPDATE does not match the base version: a stale save overwrites",
        with_attrs(queries=sql_edit(_Q, "save", _BASE_GUARD, "AND EXISTS")),
    ),
    Mutant(
        "success-wipes-pending-edit",
        KIND,
        "no-edit-lost-silently",
        "a successful save's answer replaces the local copy: an edit typed during the save is gone",
        with_attrs(session_class=_SuccessWipesPendingEdit),
    ),
    Mutant(
        "draft-key-without-writer",
        KIND,
        "unsaved-work-in-one-place",
        "the draft slot is keyed by user and document only: tabs overwrite each other's drafts",
        with_attrs(drafts_class=_DraftSlotWithoutWriter),
    ),
    Mutant(
        "stale-read-applied",
        KIND,
        "no-stale-read-applied",
        "the read guard has no read sequence: a read answered after a newer one is applied",
        with_attrs(session_class=_ReadGuardWithoutOrder),
    ),
    Mutant(
        "read-that-raced-an-edit-applied",
        KIND,
        "no-edit-lost-silently",
        "a discard-and-reload ignores the edit generation: its late answer wipes an edit "
        "typed meanwhile",
        with_attrs(session_class=_ReadGuardWithoutGeneration),
    ),
    Mutant(
        "reload-clears-before-fetch",
        KIND,
        "no-edit-lost-silently",
        "discard_and_reload() drops the local copy and draft before the fetch succeeded",
        with_attrs(session_class=_ReloadClearsFirst),
    ),
    Mutant(
        "automatic-rebase-on-conflict",
        KIND,
        "no-last-write-wins",
        "a version conflict is merged and resaved at once, local values winning",
        with_attrs(session_class=_AutoRebase),
    ),
    Mutant(
        "close-drops-pending-edit",
        KIND,
        "close-flushes-never-drops",
        "close() cancels the pending debounced save instead of flushing it",
        with_attrs(session_class=_CloseDropsPending),
    ),
    Mutant(
        "retry-conflicts-with-itself",
        KIND,
        "retry-answered-from-receipt",
        "the server keeps no save receipts: a retry whose first answer was lost gets a 409",
        with_attrs(queries=sql_edit(_Q, "missed", _RECEIPT_KEY, _NO_RECEIPT)),
    ),
    # The server findings of issue 10: each a bug the hardened server had, put back.
    Mutant(
        "ids-matched-with-dollar",
        KIND,
        "refused-request-changes-nothing",
        "attribute and cell ids are checked with re.match: 'A1\\n' passes as A1",
        with_attrs(store_class=_DollarIdStore),
    ),
    Mutant(
        "receipt-lookup-ignores-user",
        KIND,
        "receipt-is-the-users-own",
        "the receipt of (writerId, saveSeq) is looked up without the user: another user's "
        "save under the same writer id answers",
        with_attrs(
            queries=sql_edit(
                _Q,
                "missed",
                "AND h.author = %(user)s\n      " + _RECEIPT_KEY,
                _RECEIPT_KEY.replace(") r", "    ORDER BY h.version DESC LIMIT 1\n) r"),
            )
        ),
    ),
    Mutant(
        "reused-save-seq-applied",
        KIND,
        "one-version-per-save",
        "a reused (writerId, saveSeq) with other content is applied as a new write",
        with_attrs(
            queries=sql_edit(_Q, "save", _SEQ_GUARD, ""), schema=_schema_without(_UNIQUE_SAVE)
        ),
    ),
    # Issue 19: the server's races, caught only when its operations run concurrently.
    Mutant(
        "cas-compared-in-python",
        KIND,
        "no-stale-save-accepted",
        "a save reads the version, compares it in Python and updates by id: two saves on one "
        "version both land",
        with_attrs(
            store_class=_CasInPython, queries=sql_edit(_Q, "save", _BASE_GUARD, "AND EXISTS")
        ),
        needs=("concurrency",),
    ),
    Mutant(
        "receipt-looked-up-before-the-swap-only",
        KIND,
        "retry-answered-from-receipt",
        "a save's receipt is looked up before the compare-and-swap only: a retry racing its "
        "original gets a 409 against itself",
        with_attrs(
            store_class=_ReceiptBeforeSwapOnly,
            queries=sql_edit(_Q, "missed", _RECEIPT_KEY, _NO_RECEIPT),
        ),
        needs=("concurrency",),
    ),
    Mutant(
        "json-last-key-wins",
        KIND,
        "refused-request-changes-nothing",
        "a key twice in a JSON object is read last-wins instead of refused",
        with_attrs(reader_class=_LastKeyWins),
    ),
    Mutant(
        "body-encoding-sniffed",
        KIND,
        "refused-request-changes-nothing",
        "a body that is not UTF-8 is decoded as whatever it looks like (UTF-16, UTF-32)",
        with_attrs(reader_class=_SniffedEncoding),
    ),
    Mutant(
        "if-match-read-as-a-number",
        KIND,
        "refused-request-changes-nothing",
        'If-Match: "0004" is read as version 4, not compared as an entity tag',
        with_attrs(reader_class=_NumericETag),
    ),
    Mutant(
        "first-header-wins",
        KIND,
        "refused-request-changes-nothing",
        "a header sent twice is read as its first value instead of refused",
        with_attrs(reader_class=_FirstHeaderWins),
    ),
    Mutant(
        "content-type-not-checked",
        KIND,
        "refusal-answered-clearly",
        "a body is read as JSON whatever its Content-Type says",
        with_attrs(reader_class=_AnyContentType),
    ),
    Mutant(
        "unparseable-body-is-422",
        KIND,
        "refusal-answered-clearly",
        "a body that is not JSON is answered 422 with a validation error, not 400",
        with_attrs(reader_class=_NotJson422),
    ),
    Mutant(
        "trailing-slash-redirects",
        KIND,
        "refusal-answered-clearly",
        "a request to /api/desk/files/ is redirected (307) instead of refused",
        with_attrs(reader_class=_RedirectSlashes),
    ),
]
