"""The external side of a described kind: a real HTTP server on loopback, and the worker's
call to it (:class:`ExternalCall`, a part of :class:`~.generic.GenericCheck`).

``POST /runs/<key>/<code>`` answers the code its URL asks for (the check writes it in the URL
it hands the adapter's ``send``: 200, a retryable 503, a permanent 422; an adapter may add a path
of its own after it; without one, what the check planned, then 200), so several calls at once,
in a concurrent block, each get their own answer whatever order they arrive in. It records
every call with its ``Idempotency-Key`` header, so duplicates are counted (allowed
at-least-once) and every call for one run can be checked to carry the same key.
"""

from __future__ import annotations

import re

from knownstate.impl.errors import ExternalCallFailed
from knownstate.model import generic

from .adapter import OK, PERMANENT, RETRY, no_answer_errors
from .schedules import WHOLE_CALL
from .check import Action, Candidate, Failure
from .harness import EnvironmentFault, WorkerDied
from .sink import JsonHandler, NotificationSink

ANSWERS = {200: OK, 503: RETRY, 422: PERMANENT}

_RUN_PATH = re.compile(r"^/runs/([^/?#]+)(?:/(200|503|422)(?:[/?#]|$))?")


class _RunsHandler(JsonHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        m = _RUN_PATH.match(self.path)
        if m is None:
            return self._answer(404, {"error": "POST /runs/<key>"})
        key = (m.group(1), self.headers.get("Idempotency-Key") or "")
        asked = int(m.group(2)) if m.group(2) else None
        code = self.server.sink._record(key, asked)  # type: ignore[attr-defined]
        self._answer(code, {"received": True} if code == 200 else {"error": f"planned {code}"})


class Receiver(NotificationSink):
    """The external API of a described kind: ``POST /runs/<key>``, every call recorded with its
    ``Idempotency-Key``; answers what the check planned (then 200)."""

    handler = _RunsHandler

    def keys(self) -> dict[str, set[str]]:
        """Per run, the idempotency keys its calls carried."""
        with self._lock:
            out: dict[str, set[str]] = {}
            for run, key in self.log:
                out.setdefault(run, set()).add(key)
            return out


class ExternalCall:
    """The worker's external call for a run it holds, through its own link (a mixin of the
    generic check: ``receiver``, ``held``, ``workers`` are the check's)."""

    def external_links(self, worker) -> list:
        """The worker's link to the external side, while it has a call to make."""
        unsent = any(h.result is None for h in self.held[worker.index].values())
        return [worker.ext_link] if self.receiver and unsent else []

    def _answers(self) -> list[int]:
        """What the external side may answer, as a list to draw from: 200 as often as the
        others together. A completion is the write a fence exists for; one answer in three, a
        stale completion refused on a re-claimed run was the outbox's rarest event (seed 2)."""
        events = self.description.events()
        fails = [503] if self.description.retry is not None or generic.FAIL in events else []
        fails += [422] if generic.FAIL in events else []
        return [200] * max(1, len(fails)) + fails

    def _send(self, w: int, key: str, answer: int) -> Action:
        """The external call for a claimed run, through the worker's own link (at-least-once),
        the stand-in answering ``answer``. As a step of its own the check drives it (a lost
        reply armed for it, the adapter's reading of the answer judged); in a block the call is
        one step of the schedule, like a statement (:meth:`_posted`), its outcome the adapter's
        reading of the answer, which the model's must equal."""
        h = self.held[w][key]
        label = f"send({key}, attempt={h.job.attempt}) answers {answer}"

        def model_op(m):
            m.sent(key)
            return ANSWERS[answer]

        def after(got) -> None:
            h.result = got

        return Action(
            "send",
            label,
            model_op,
            lambda conn: self._posted(w, key, answer, conn),
            after=after,
            external_maybe=lambda m: m.sent(key),
            runs=frozenset({key}),
            run=lambda: self._call_out(w, key, answer),
        )

    def _url(self, w: int, key: str, answer: int) -> str:
        return f"http://127.0.0.1:{self.workers[w].ext_link.port}/runs/{key}/{answer}"

    def _posted(self, w: int, key: str, answer: int, conn) -> str:
        """The call in a block: one step of the schedule, on the worker's thread. No answer (a
        fault struck its link) is an external call failed: it may have arrived."""
        h, worker = self.held[w][key], self.workers[w]
        with conn.step(f"{WHOLE_CALL}POST /runs/{key} (answers {answer})"):
            try:
                return worker.run(self.adapter.send(h.claimed, self._url(w, key, answer)))
            except no_answer_errors(self.adapter_class) as e:
                raise ExternalCallFailed(f"send({key}): {type(e).__name__}") from e

    def _call_out(self, w: int, key: str, answer: int) -> None:
        h, worker = self.held[w][key], self.workers[w]
        self.start_step()
        bases = [c.model for c in self.candidates]
        trials = [b.copy() for b in bases]
        for t in trials:
            t.sent(key)
        url = self._url(w, key, answer)
        label = f"send(w{w}, {key}, attempt={h.job.attempt}) answers {answer}"
        try:
            with self.external_call(worker):
                h.result = worker.run(self.adapter.send(h.claimed, url))
        except no_answer_errors(self.adapter_class) as e:
            h.result = RETRY
            self.log(f"{label} -> no answer ({type(e).__name__}); it may have arrived")
            self.event("external reply lost")
            self.maybe(
                *(Candidate(b, external=False) for b in bases),
                *(Candidate(t, external=True) for t in trials),
            )
        except (WorkerDied, EnvironmentFault, Failure):
            raise
        except Exception as e:
            self.fail(f"{label}: the adapter's send raised {type(e).__name__}: {e}")
        else:
            self.log(f"{label} -> {h.result}")
            if h.result != ANSWERS[answer]:
                self.fail(
                    f"{label}: the adapter read the answer as {h.result!r}, not {ANSWERS[answer]!r}"
                )
            self.model = trials[0]
            self.candidates = [Candidate(t) for t in trials]
