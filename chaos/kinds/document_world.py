"""What acts on the document besides the sessions, as rules of the document-session check (a
mixin of :class:`~.document_session.DocumentSessionCheck`): clients that are not sessions — one
that sends what the contract refuses (:mod:`.document_requests`), one that reuses a save
identity for other content, an impostor that saves under another user's writer id and seq —,
the server-side writer, and the draft store failing and recovering."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.model.document import SaveRequest, State

from .document_plant import CLIENT, DOC, SLOTS
from .document_requests import HOSTILE, REQUEST_INVARIANTS, Hostile, judge

REUSE = "a save identity reused for other content"


class WorldRules:
    """The rules of what is not a session's own work (the other clients share one budget per
    example)."""

    # -- clients that are not sessions (see document_requests) ------------------------------
    def _server_calm(self) -> bool:
        link = self.plant.db_link
        return not link.toxics and link.enabled

    def _version(self) -> int:
        return self.worlds[0].model.server.docs[DOC].version

    @precondition(lambda self: self._server_calm() and self.budget["other client"])
    @rule(case=st.sampled_from((*HOSTILE, REUSE)))
    def other_client(self, case: Hostile | str) -> None:
        """A client that is not a session sends a request the contract refuses (a lenient server
        would apply it: it carries the current base and a fresh save identity), or reuses a save
        identity (one rule for all of them: they share one rule's share of the steps)."""
        self.budget["other client"] -= 1
        if case == REUSE:
            self._reused_save_seq()
        else:
            self._hostile_request(case)

    def _hostile_request(self, case: Hostile) -> None:
        self.begin_step()
        self.hostile_n += 1
        writer = f"hostile-{self.hostile_n}"
        method, path, headers, body = case.request(DOC, self._version(), writer)
        before = self.observer.documents()
        response = self.plant.raw.request(method, path, headers=headers, content=body)
        after = self.observer.documents()
        try:
            error = response.json().get("error")
        except (ValueError, AttributeError):
            error = None
        self.log(f"a client sends {case.name} -> {response.status_code} {error}")
        # judged with everything else after the step (a request applied that should not have
        # been may break the model's invariants too: they are named together)
        self.refusals = judge(case, response, before, after)
        self.stats.invariants_checked += len(REQUEST_INVARIANTS)
        if not self.refusals:
            self.event("hostile request refused")
            self.event(f"hostile request refused: {case.name}")

    def _alice_pending(self) -> list[str]:
        return [slot for slot in self._slots(*self.PENDING) if SLOTS[slot] == "alice"]

    @precondition(
        lambda self: self._server_calm() and self._alice_pending() and self.budget["impostor"]
    )
    @rule(data=st.data())
    def impostor_save(self, data) -> None:
        """An alice tab saves while offline (the request never arrives); bob's client then
        saves under that tab's writer id and seq, and the tab retries: bob's save is his own,
        and must neither answer nor replace her receipt — her retry is answered as if bob had
        saved under another id."""
        slot = self._pick(data, self._alice_pending())
        self.budget["impostor"] -= 1
        self.edits += 1
        base, title, now = self._version(), f"bob.{self.edits}", self.clock

        def script(side):
            t = side.tab(slot)
            with side.offline(slot):
                req = t.begin_save(now)
                t.finish_save(req, side.send(slot, req))
            side.send(
                CLIENT, SaveRequest(DOC, "bob", req.writer_id, req.seq, base, {"title": title}, 0)
            )
            return t.tick(now)  # the retry is due at once

        self._run(
            f"{slot} saves offline; bob's client saves as its writer and seq; {slot} retries",
            script,
        )

    def _reused_save_seq(self) -> None:
        """A client saves, then sends other content under the same (writerId, saveSeq): a save
        identity names one save, so the second is refused, naming the first's receipt."""
        self.hostile_n += 1
        writer, base = f"reuser-{self.hostile_n}", self._version()
        first = SaveRequest(DOC, "alice", writer, 1, base, {"title": f"{writer}.a"}, 0)
        again = SaveRequest(DOC, "alice", writer, 1, base + 1, {"title": f"{writer}.b"}, 0)

        def script(side):
            side.send(CLIENT, first)
            return side.send(CLIENT, again)

        self._run(f"a client saves as {writer}#1, then sends other content as {writer}#1", script)

    # -- the rest of the world ------------------------------------------------------------------
    @precondition(lambda self: self._slots(State.DIRTY, State.OFFLINE, State.CONFLICT))
    @rule(attr=st.sampled_from(["title", "qty", "done"]))
    def server_write(self, attr: str) -> None:
        """The server-side writer (the seed's "AI write") changes the document while a tab has
        unsaved work (the tab's next save is then based on a stale version)."""
        self.edits += 1
        k = self.edits
        patch = {attr: {"title": f"ai.{k}", "qty": 1000 + k, "done": k % 2 == 0}[attr]}
        self._run(f"server-side write {fmt_patch(patch)}", lambda side: side.server_write(patch))

    @precondition(
        lambda self: self.drafts_failing or (self._calm() and self._slots(*self.EDITABLE))
    )
    @rule()
    def fault_drafts(self) -> None:
        """The draft store starts refusing writes and deletes (quota, full disk, private mode), or
        works again — and then the user goes on typing in a tab that showed the failure (the
        first one): its next write retries, and the status must come back."""
        self.drafts_failing = self.drafts.fail_writes = not self.drafts_failing
        for w in self.worlds:
            w.model.set_drafts_failing(self.drafts_failing)
        if self.drafts_failing:
            self.fault("draft-store", "the draft store starts failing")
            return
        self.log("the draft store works again")
        failing = [
            slot
            for slot in self._slots(*self.EDITABLE)
            if self.sessions[slot].draft_status == "failing"
        ]
        if failing:
            slot, now = failing[0], self.clock
            patch = self._patch(slot, "title")
            self._run(
                f"edit {slot} {fmt_patch(patch)}", lambda side: side.tab(slot).edit(patch, now)
            )


def fmt_patch(patch: dict) -> str:
    return ", ".join(f"{k}={'(cleared)' if v is None else repr(v)}" for k, v in patch.items())
