"""A tab of the browser check: the client under test in one page, driven like the model's session.

:class:`BrowserTab` has the model session's methods (``begin_save`` / ``finish_save``, ``tick``,
``edit``, ...); each is carried out in the page through the driver contract (README: "Validating
your own client"), the :class:`~.browser_gateway.Gateway` deciding when its requests go out and
when their answers come back. :class:`BrowserDriver` forwards a held request over the tab's own
Toxiproxy link to the server and records the exchange for the model's replay; outcomes and errors
come back in the model's vocabulary. Waiting for the page is polling with a deadline
(:data:`~.browser.WAIT_S`): a page that does not answer within it is the environment's failure
(exit 3), never a verdict.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import httpx

from knownstate.impl.documents.session import HttpTransport
from knownstate.model.contract import IllegalTransition, Rejected, Won
from knownstate.model.document import (
    CloseResult,
    CopyRequest,
    Created,
    Dropped,
    KindError,
    MergeUnsupported,
    NoAnswer,
    ReadRequest,
    Saved,
    SaveRequest,
    SeqTaken,
    Snapshot,
    State,
    TabView,
    UnsavedWork,
    VersionConflict,
)

from .browser import WAIT_S, Chromium
from .browser_gateway import BAD_GATEWAY, Gateway, Held, parse_request
from .harness import EnvironmentFault

ARRIVAL_S = 0.5
"""How long a request the page started online may take to reach the gateway before the page is
asked again: a backstop (the wait ends when the request arrives), never a verdict."""

ERRORS: dict[str, type[Exception]] = {
    "IllegalTransition": IllegalTransition,
    "KindError": KindError,
    "MergeUnsupported": MergeUnsupported,
    "UnsavedWork": UnsavedWork,
    "KeyError": KeyError,
}


class ClientError(Exception):
    """The client threw something the driver contract does not name (a bug of the client, or
    a broken bundle): reported as the failure it is, never as a lost connection."""


def raise_client_error(error: dict) -> None:
    name, message = error.get("name", "Error"), error.get("message", "")
    cls = ERRORS.get(name)
    if cls is None:
        raise ClientError(f"the client threw {name}: {message}")
    e = Exception.__new__(cls)
    Exception.__init__(e, message)
    raise e


@dataclass(eq=False)
class Op:
    """An operation started in the page: its id, and its first poll (not read yet)."""

    id: int
    first: dict | None


@dataclass(eq=False)
class Pending:
    """An operation started in the page and the request it made (``begin_*``)."""

    op: Op
    request: Any
    held: Held | None = None  # at the gateway (None: it never left the browser)
    seq: int | None = None  # the page's number for the request (to release its failure)
    answer: Any = None  # what the check recorded for it, once sent


class Unsent:
    """A ``begin_*`` after which the client sent nothing (it refused, or it is wrong)."""

    def __init__(self, done: dict):
        self.done = done


class BrowserTab:
    """One tab: a session of the client under test in one page. Its methods are the model
    session's (``begin_save`` / ``finish_save``, ``tick``, ``edit``, ...), each carried out in the
    page through the driver contract, with the gateway deciding when requests go out and
    answers come back; outcomes and errors come back in the model's vocabulary."""

    def __init__(self, driver: "BrowserDriver", slot: str, user: str, view: dict):
        self.driver, self.slot, self.user = driver, slot, user
        self.page = driver.chromium.pages[slot]
        self.last = view
        self.pending: list[Pending] = []
        self.last_answer: Any = None

    # -- what the check reads ------------------------------------------------------------------
    @property
    def state(self) -> State:
        return State(self.last["state"])

    @property
    def writer_id(self) -> str:
        return self.last["writerId"]

    @property
    def draft_status(self) -> str:
        return self.last["draftStatus"]

    @property
    def siblings(self) -> list[dict]:
        return [{"writerId": w} for w in self.last["siblings"]]

    def view(self, tab: str) -> TabView:
        v = self.last
        return TabView(
            tab,
            v["user"],
            v["docId"],
            v["writerId"],
            v["kind"],
            v["state"],
            dict(v["local"]),
            v["baseVersion"],
            v["generation"],
            v["draftStatus"],
            tuple(tuple(t) for t in v["transitions"]),
            tuple(v["siblings"]),
            v["conflictVersion"],
        )

    # -- synchronous operations ------------------------------------------------------------------
    def _call(self, op: str, *args) -> Any:
        out = self.driver.evaluate(self.page, "([op, args]) => __ks.call(op, args)", [op, args])
        self._seen(out.get("view"))
        if out.get("error"):
            raise_client_error(out["error"])
        return self.outcome(out.get("result"))

    def edit(self, patch: dict, now: float):
        return self._call("edit", patch, now)

    def discard(self):
        return self._call("discard")

    def rebase(self, resolve):
        from knownstate.model.document import prefer_local

        return self._call("rebase", "local" if resolve is prefer_local else "stored")

    def adopt(self, writer_id: str):
        return self._call("adopt", writer_id)

    def discard_sibling(self, writer_id: str):
        return self._call("discardSibling", writer_id)

    # -- operations that talk to the server --------------------------------------------------------
    def tick(self, now: float):
        return self._pump(self._start("tick", now))

    def close(self, max_failures: int = 2):
        return self._pump(self._start("close"))

    def begin_read(self, purpose: str = "refresh"):
        op = self._start("load") if purpose == "load" else self._start("read", purpose)
        return self._begin(op, purpose)

    def finish_read(self, req, answer):
        return self._finish(req)

    def begin_save(self, now: float | None = None):
        return self._begin(self._start("save", now if now is not None else 0.0))

    def finish_save(self, req, answer):
        return self._finish(req)

    def begin_copy(self):
        return self._begin(self._start("keepLocalAsCopy"))

    def finish_copy(self, req, answer):
        return self._finish(req)

    # -- the machinery -----------------------------------------------------------------------------
    def _start(self, op: str, *args) -> "Op":
        first = self.driver.evaluate(self.page, "([op, args]) => __ks.start(op, args)", [op, args])
        return Op(first["id"], first)

    def _seen(self, view: dict | None) -> None:
        if view is not None:
            self.last = view

    def _next(self, op: "Op", purpose: str | None) -> tuple[str, Any]:
        """Wait until the operation makes a request (``("request", Pending)``) or finishes
        (``("done", poll)``)."""
        deadline = time.monotonic() + WAIT_S
        out, op.first = op.first, None
        gateway, wait_ms = self.driver.gateway, 1000
        while True:
            held = gateway.take(self.slot)
            if held is not None:
                return "request", self._pending(op, held.request, purpose, held=held)
            if out is None:
                out = self.driver.evaluate(
                    self.page, "([id, ms]) => __ks.waitFor(id, ms)", [op.id, wait_ms]
                )
            offline = self.driver.failed_in_browser(self.slot, out.get("wire", []))
            if offline:  # it never left the browser (offline): known from the page's own record
                for seq, extra in offline[1:]:
                    self.driver.record_offline(self, extra)
                    self.driver.release(self.page, seq)
                seq, request = offline[0]
                return "request", self._pending(op, request, purpose, seq=seq)
            if out["done"]:
                return "done", out
            if time.monotonic() > deadline:
                raise EnvironmentFault(
                    f"{self.driver.chromium.describe()}: tab {self.slot} did not finish an "
                    f"operation within {WAIT_S:.0f} s (is the machine overloaded?)"
                )
            # A request the page started and the gateway has not seen: online, it is on its way
            # to the gateway, which wakes this wait the moment it arrives; offline, it fails in
            # the browser, which wakes the page's wait. (Either wait is a backstop: what is
            # decided is what arrived, never how long it took.)
            unseen = any(not gateway.was_seen(self.slot, n) for n in out.get("inflight", []))
            online = not self.driver.chromium.offline.get(self.user, False)
            if unseen:
                gateway.take_wait(self.slot, ARRIVAL_S if online else 0.005)
            wait_ms = 20 if unseen else 1000
            out = None

    def _pending(
        self,
        op: "Op",
        request: Any,
        purpose: str | None,
        held: Held | None = None,
        seq: int | None = None,
    ) -> Pending:
        if isinstance(request, ReadRequest) and purpose is not None:
            request = ReadRequest(request.doc_id, request.user, 0, 0, None, purpose)
            if held is not None:
                held.request = request
        p = Pending(op, request, held, held.seq if held is not None else seq)
        self.pending.append(p)
        return p

    def _begin(self, op: "Op", purpose: str | None = None):
        kind, got = self._next(op, purpose)
        if kind == "done":
            self._seen(got.get("view"))
            if got.get("error"):
                raise_client_error(got["error"])
            return Unsent(got)
        return got.request

    def _find(self, req) -> Pending | None:
        return next((p for p in self.pending if p.request is req), None)

    def send(self, req) -> Any:
        """The request goes out (``side.send``): forwarded and recorded, or, if it never left the
        browser, recorded as unanswered."""
        if isinstance(req, Unsent):
            return NoAnswer("never sent")
        p = self._find(req)
        if p is None:
            raise RuntimeError(f"tab {self.slot}: no request {req!r} in flight")
        p.answer = self.driver.forward(self, p)
        return p.answer

    def _finish(self, req):
        if isinstance(req, Unsent):
            return self._result(req.done)
        p = self._find(req)
        if p is None:
            raise RuntimeError(f"tab {self.slot}: no request {req!r} in flight")
        if p.answer is None:
            p.answer = self.driver.forward(self, p)
        self.driver.deliver(self.page, p)
        self.pending.remove(p)
        return self._pump(p.op)

    def _pump(self, op: "Op"):
        """Carry the operation to its end: every request it makes is sent and answered at once."""
        while True:
            kind, got = self._next(op, None)
            if kind == "done":
                return self._result(got)
            got.answer = self.driver.forward(self, got)
            self.driver.deliver(self.page, got)
            self.pending.remove(got)

    def _result(self, done: dict):
        self._seen(done.get("view"))
        if done.get("error"):
            raise_client_error(done["error"])
        return self.outcome(done.get("result"))

    def outcome(self, r: Any) -> Any:
        """The client's outcome in the model's vocabulary."""
        if r is None or not isinstance(r, dict):
            return r
        t = r.get("type")
        if t == "won":
            return Won(r["value"])
        if t == "saved":
            return Won(Saved(r["version"], bool(r["replayed"])))
        if t == "created":
            return Won(Created(r["id"], r["version"], bool(r["replayed"])))
        if t == "snapshot":
            s = r["snapshot"]
            return Won(Snapshot(s["id"], s["kind"], s["schema"], s["version"], s["content"]))
        if t == "conflict":
            return VersionConflict("version_conflict", r["version"], r["content"])
        if t == "seqTaken":
            return SeqTaken("save_seq_taken", r["writerId"], r["seq"], r["version"], r["lastSeq"])
        if t == "rejected":
            return Rejected(r["reason"])
        if t == "noAnswer":
            last = self.last_answer
            return last if isinstance(last, NoAnswer) else NoAnswer(r.get("reason", ""))
        if t == "dropped":
            return Dropped(r["reason"])
        if t == "closed":
            return CloseResult(bool(r["flushed"]), bool(r["parkedInDraft"]))
        raise ClientError(f"the client answered an outcome the contract does not name: {r!r}")


class BrowserDriver:
    """The tabs of one run, the gateway they talk through, and the forwarding of their requests
    (over each slot's own Toxiproxy link, every exchange recorded for the replay)."""

    def __init__(self, chromium: Chromium, gateway: Gateway, upstream: dict[str, str], recorder):
        self.chromium, self.gateway, self.recorder = chromium, gateway, recorder
        limits = httpx.Limits(max_keepalive_connections=0)
        self.http = {
            slot: httpx.Client(base_url=url, timeout=5, limits=limits)
            for slot, url in upstream.items()
        }
        self.on_offline = lambda: None  # told of every request that failed in the browser

    def close(self) -> None:
        for c in self.http.values():
            with contextlib.suppress(Exception):
                c.close()

    def evaluate(self, page, script: str, arg: Any = None) -> Any:
        self.chromium.touch(page)
        try:
            out = page.evaluate(script, arg)
            if isinstance(out, dict) and "drafts" in out:
                self.chromium.note_drafts(page, out.pop("drafts"))
            return out
        except Exception as e:
            if not self.chromium.running:
                raise EnvironmentFault(
                    f"{self.chromium.describe()} died, and not by the harness: was it killed "
                    "from outside?"
                ) from None
            raise ClientError(f"the page failed: {str(e).strip().splitlines()[0]}") from None

    def open(self, slot: str, user: str, config: dict) -> BrowserTab:
        page = self.chromium.pages[slot]
        if page.url != self.chromium.harness_url:
            self.chromium.fresh(slot)
        out = self.evaluate(page, "config => __ks.open(config)", config)
        if out.get("error"):
            if out["error"].get("name") == "ContractError":
                raise ClientError(out["error"]["message"])
            raise_client_error(out["error"])
        return BrowserTab(self, slot, user, out["view"])

    def failed_in_browser(self, slot: str, wire: list[dict]) -> list[tuple[int, Any]]:
        """The requests the page says failed without reaching the gateway (the browser was
        offline), in the model's vocabulary."""
        out = []
        for e in wire:
            if e["failed"] and not self.gateway.was_seen(slot, e["n"]):
                body = (e.get("body") or "").encode()
                headers = {"x-user": e.get("user") or ""}
                path = e["url"].split(f"/t/{slot}", 1)[-1]
                out.append((e["n"], parse_request(e["method"], path, headers, body)))
        return out

    def record_offline(self, tab: BrowserTab, request: Any) -> NoAnswer:
        answer = NoAnswer("offline: the browser is offline")
        self.recorder.record(tab.slot, request, answer)
        tab.last_answer = answer
        self.on_offline()
        return answer

    def forward(self, tab: BrowserTab, p: Pending) -> Any:
        """Send the held request to the server over the slot's link; record what came back."""
        if p.held is None:
            return self.record_offline(tab, p.request)
        h = p.held
        headers = {
            k: v for k, v in h.headers.items() if k in ("x-user", "content-type", "if-match")
        }
        try:
            r = self.http[tab.slot].request(h.method, h.path, headers=headers, content=h.body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            answer, h.reply = NoAnswer(f"unreachable: {type(e).__name__}"), BAD_GATEWAY
        except httpx.TransportError as e:
            answer, h.reply = NoAnswer(f"lost: {type(e).__name__}"), BAD_GATEWAY
        else:
            kept = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "etag")}
            h.reply = (r.status_code, kept, r.content)
            if isinstance(p.request, (SaveRequest, ReadRequest, CopyRequest)):
                answer = HttpTransport.answer(p.request, r)
            else:
                answer = ("answered", r.status_code, r.text[:200])
        self.recorder.record(tab.slot, p.request, answer)
        tab.last_answer = answer
        return answer

    def deliver(self, page, p: Pending) -> None:
        """The browser gets the answer (or, if it was lost, a connection closed without one; or,
        if it never left the browser, its failure)."""
        if p.held is not None:
            self.gateway.reply(p.held, p.held.reply)
        if (p.held is None or p.held.reply is None) and p.seq is not None:
            self.release(page, p.seq)

    def release(self, page, seq: int) -> None:
        """The page's fetch number ``seq`` may fail now (its failure was held)."""
        self.evaluate(page, "n => __ksRelease(n)", seq)
