"""The browser check's mutant catalogue: the client mutants of ``web/src/mutants.ts``, each
caught by ``knownstate mutants document-session --client browser`` only when the failure names
the invariant it declares here.

A client mutant is a subclass of the reference TypeScript ``Session`` that overrides one seam;
it is built into its own bundle (``web/dist/knownstate-client-mutants.js``) and chosen by name in
the tab's configuration (the check's ``client_mutant``). The names here and the keys of the
TypeScript ``MUTANTS`` are one list, kept so by a drift test (``tests/test_browser_check.py``).
"""

from __future__ import annotations

from .mutants import Mutant, with_attrs

KIND = "document-session-browser"


def _client(name: str, invariant: str, description: str) -> Mutant:
    return Mutant(name, KIND, invariant, description, with_attrs(client_mutant=name))


MUTANTS = [
    _client(
        "success-wipes-pending-edit",
        "no-edit-lost-silently",
        "a save's success replaces the local copy with the snapshot it sent: an edit typed "
        "during the save is gone",
    ),
    # the seed's "nothing deletes [unsaved work] until a save of that work succeeded": the
    # draft goes before the save's answer, whether the save then lands (the edit is stored, no
    # edit lost) or not (then the edit is lost too)
    _client(
        "draft-cleared-when-save-starts",
        "unsaved-work-in-one-place",
        "the draft is removed as soon as a save starts: a save that gets no answer leaves the "
        "edit in memory only",
    ),
    _client(
        "conflict-resolved-by-overwrite",
        "no-last-write-wins",
        "a 409 is answered by putting the local copy on the stored version and saving it again",
    ),
    _client(
        "sibling-draft-applied-silently",
        "sibling-draft-offered-not-applied",
        "on load, another tab's draft of the same user is restored as this tab's own",
    ),
    _client(
        "reload-clears-before-fetch",
        "no-edit-lost-silently",
        "discardAndReload() drops the local copy and the draft before the fetch succeeded",
    ),
    _client(
        "stale-read-applied",
        "no-stale-read-applied",
        "the read guard has no read sequence: a read answered after a newer one is applied",
    ),
    _client(
        "read-that-raced-an-edit-applied",
        "no-edit-lost-silently",
        "a discard-and-reload ignores the edit generation: its late answer wipes an edit typed "
        "meanwhile",
    ),
    _client(
        "close-drops-pending-edit",
        "close-flushes-never-drops",
        "close() cancels the pending debounced save instead of flushing it",
    ),
    _client(
        "draft-key-without-writer",
        "unsaved-work-in-one-place",
        "the localStorage key leaves out the writer id: a user's tabs overwrite each other's "
        "drafts",
    ),
]
