"""The versioned document session: the server (:mod:`.server`), the client session
(:mod:`.session`) and the per-writer draft store (:mod:`.drafts`).

The pure model, the session's state table and the invariants live in
:mod:`knownstate.model.document`; this package imports them from there.
"""

from .drafts import DraftStore, DraftStoreError
from .server import DocumentServer, DocumentStore, create_app, schema_sql
from .session import HttpTransport, Session, Workspace

__all__ = ["DocumentServer", "DocumentStore", "DraftStore", "DraftStoreError", "HttpTransport", "Session",
           "Workspace", "create_app", "schema_sql"]
