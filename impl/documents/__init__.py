"""The versioned document session: the store (:mod:`.store`), the HTTP server (:mod:`.server`,
reading requests strictly with :mod:`.reading`), the client session (:mod:`.session`) and the
per-writer draft store (:mod:`.drafts`).

The pure model, the session's state table and the invariants live in
:mod:`knownstate.model.document`; this package imports them from there.
"""

from .drafts import DraftStore, DraftStoreError
from .server import DocumentServer, create_app
from .session import HttpTransport, Session, Workspace
from .store import DocumentStore, schema_sql

__all__ = [
    "DocumentServer",
    "DocumentStore",
    "DraftStore",
    "DraftStoreError",
    "HttpTransport",
    "Session",
    "Workspace",
    "create_app",
    "schema_sql",
]
