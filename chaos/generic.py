"""A check built from a description and an adapter: the gate for a queue of the user's own.

:func:`kind` takes a :class:`~knownstate.model.describe.RunKind` and an
:class:`~knownstate.chaos.adapter.Adapter` and returns a :class:`~.check.KindCheck` subclass:
the model is the generic queue of :mod:`knownstate.model.generic`, the faults and the judging
are the base's, and this module only says what a worker of such a queue does — its loop's
steps as rules (claim, the external call, the fenced write of its outcome, the heartbeat), the
reaper, a producer (and a repeated request, with an idempotency key), a claim racing another
worker's open claim — and answers the fault policy's questions.

The external call, when the description has one, goes to a real HTTP stand-in on loopback
(:class:`Receiver`) through the worker's own Toxiproxy link: ``POST /runs/<key>``. It answers
what the check planned (200, a retryable 503, a permanent 422), records every call with its
``Idempotency-Key`` header, and so counts duplicates (allowed at-least-once) and checks that
every call for one run carries the same key (when the description says it does).

Mutants come from the adapter's SQL: for each guard it names (``Adapter.guards``), each query
containing it gets a mutant without it, which must be caught naming the invariant the guard
stands for. A user adds hand-written ones with ``kind(..., mutants=[...])``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from knownstate.impl.errors import (
    ClientError,
    CommitIndeterminate,
    ConnectionLost,
    KnownstateError,
    TransactionAborted,
    is_connection_error,
)
from knownstate.model import generic
from knownstate.model.contract import LostRace, Violation, Won
from knownstate.model.describe import RunKind
from knownstate.model.generic import Job, Observed, Timing

from .adapter import OK, PERMANENT, RETRY, Adapter, Claimed, as_row, no_answer_errors, unwrap
from .adapter import worker_class as adapter_worker
from .check import QUANTUM, Candidate, Failure, FaultPolicy, KindCheck, fmt
from .harness import EnvironmentFault, WorkerDied, watch
from .mutants import Mutant, sql_edit, with_attrs
from .sink import JsonHandler, NotificationSink

ANSWERS = {200: OK, 503: RETRY, 422: PERMANENT}

GUARDS = {"fence": "lease-fence", "status": "lease-fence", "lease": "lease", "skip_locked": "claim"}
"""A guard the adapter names -> the invariant a query without it must be caught breaking."""


class KindError(ValueError):
    """A description and an adapter that cannot make a check (the message says what to do)."""


# ---------------------------------------------------------------------------------------
# The external side: a real HTTP server on loopback.
# ---------------------------------------------------------------------------------------

_RUN_PATH = re.compile(r"^/runs/([^/?#]+)")


class _RunsHandler(JsonHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        m = _RUN_PATH.match(self.path)
        if m is None:
            return self._answer(404, {"error": "POST /runs/<key>"})
        key = (m.group(1), self.headers.get("Idempotency-Key") or "")
        code = self.server.sink._record(key)  # type: ignore[attr-defined]
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


# ---------------------------------------------------------------------------------------
# The check.
# ---------------------------------------------------------------------------------------


@dataclass
class Held:
    """A claim a worker holds in memory: the model's job, the adapter's, and the external
    side's answer once it called."""

    job: Job
    claimed: Claimed
    result: str | None = None


def _order(key: str) -> tuple:
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


class GenericCheck(KindCheck):
    """The check of a described queue. Built by :func:`kind`; not subclassed by hand."""

    description: ClassVar[RunKind]
    adapter_class: ClassVar[type[Adapter]]
    timing: ClassVar[Timing]
    adapter_queries: ClassVar[dict[str, str] | None] = None  # a mutant's edited SQL
    mutants: ClassVar[list[Mutant]] = []
    n_workers = 2
    lock_wait_breaks = "claim"
    own_invariants: ClassVar[dict[str, str]] = {}

    # -- set-up -------------------------------------------------------------------------------
    def reset_example(self) -> None:
        self.adapter = self.adapter_class(self.timing)
        if self.adapter_queries is not None:
            self.adapter.queries = dict(self.adapter_queries)
        self.held: list[dict[str, Held]] = [{} for _ in self.workers]
        self.owing: frozenset[str] = frozenset()
        self._unsure: tuple[str, int] | None = None  # a stale owner's write, answer lost
        self._duplicates = 0
        for w in self.workers:
            w.binding = self.adapter
        self.receiver = None
        if self.description.external != "none":
            self.receiver = self.env.stand_in("receiver", lambda: Receiver())  # in process
            self.receiver.reset()
            for w in self.workers:
                w.ext_link = self.env.api.link(
                    f"{self.kind}-{w.name}-ext", self.receiver.host, self.receiver.port
                )
                w.links = [w.link, w.ext_link]

    def new_model(self) -> generic.GenericModel:
        return generic.GenericModel(self.description, self.timing)

    def observe_model(self, m: generic.GenericModel):
        return m.state(), tuple(sorted(m.received.items(), key=lambda kv: _order(kv[0])))

    def observe_impl(self):
        try:
            rows = [as_row(r) for r in self.adapter.read(self.ws.admin())]
        except (KeyError, TypeError) as e:
            self.fail(
                f"the adapter's read gave a row without {e}: return Row(...) or "
                "mappings with 'key' and 'status'",
                [],
            )
        now = self.candidates[0].model.now
        observed = tuple(sorted((self._observe(r, now) for r in rows), key=lambda o: _order(o.key)))
        received = self.receiver.received() if self.receiver else {}
        return observed, tuple(
            sorted(((str(k), n) for k, n in received.items()), key=lambda kv: _order(kv[0]))
        )

    def _observe(self, r, now: int) -> Observed:
        d, model = self.description, self.model
        due = lease = None
        if d.retry is not None and r.status == d.initial:
            due = 0 if r.due is None else max(0, self._time(r.due, "due") - now)
        if d.lease is not None and r.status in d.owned and r.lease_until is not None:
            lease = max(0, self._time(r.lease_until, "lease_until") - now)
        return Observed(
            r.key, r.status, r.attempts if model.tracks_attempts() else None, due, lease
        )

    def _time(self, ts, column: str) -> int:
        if getattr(ts, "tzinfo", None) is None:
            self.fail(
                f"the adapter's read gave {column} = {ts!r}, not a timestamp with a "
                "time zone: use timestamptz columns",
                [],
            )
        return self.to_model_time(ts)

    def views(self, observation):
        rows, received = observation
        return generic.views(self.description, self.timing, rows, dict(received), self.owing)

    def kind_violations(self, real) -> list[Violation]:
        rows, _ = real
        out = []
        if self._unsure is not None:
            key, token = self._unsure
            landed = {r.status for r in rows if r.key == key}
            possible = {c.model.runs[key].status for c in self.candidates if key in c.model.runs}
            if landed and not landed <= possible:
                out.append(
                    Violation(
                        "lease-fence",
                        f"run {key}: a write with stale token {token} "
                        f"landed (its answer was lost; the run is now "
                        f"{', '.join(sorted(landed))})",
                    )
                )
        keys = [r.key for r in rows]
        for key in sorted({k for k in keys if keys.count(k) > 1}, key=_order):
            out.append(
                Violation(
                    "claim",
                    f"run {key}: {keys.count(key)} runs under one key (a "
                    "repeated request must get the existing run)",
                )
            )
        if self.receiver is not None and self.description.external_key:
            for run, sent in sorted(self.receiver.keys().items(), key=lambda kv: _order(kv[0])):
                if len(sent) > 1 or "" in sent:
                    out.append(
                        Violation(
                            "external-effect-semantics",
                            f"run {run}: its external "
                            f"calls carried idempotency keys {sorted(sent)}; the "
                            "same key on every call lets the other side de-duplicate",
                        )
                    )
        return out

    def observed(self, m: generic.GenericModel) -> None:
        self.owing, self._unsure = frozenset(), None
        dups = sum(n - 1 for n in m.received.values())
        self.event("duplicate delivery", max(0, dups - self._duplicates))
        self._duplicates = dups

    def forget(self, worker) -> None:
        self.held[worker.index].clear()

    # -- the fault policy's questions ------------------------------------------------------------
    def clock_matters(self) -> bool:
        held = {key for _, key in self._holding()}
        m = self.model
        return any(
            (r.status == m.owned and r.key not in held)
            or (r.status == self.description.initial and r.due > m.now)
            for r in m.runs.values()
        )

    def turns(self, w: int) -> list[str]:
        """What ``w`` can do next: record an outcome, make the external call, claim."""
        held = self.held[w].values()
        out = []
        if any(h.result is not None for h in held) or (held and not self.receiver):
            out.append("record")
        if self.receiver and any(h.result is None for h in held):
            out.append("send")
        if self.model.due():
            out.append("claim")
        return out

    def turn(self, w: int, data) -> None:
        """The step that meets the fault armed for it: a lost reply meets the external call,
        a COMMIT fault a step that commits."""
        options = self.turns(w)
        step = options[0]
        if self.reply_lost_armed == w and "send" in options:
            step = "send"
        elif self.workers[w].before_commit is not None:
            step = next((o for o in options if o != "send"), step)
        if step == "claim":
            return self.claim(w, 3)
        key = data.draw(
            st.sampled_from(self._mine(w, sent=step == "record" and self.receiver is not None)),
            label="run",
        )
        if step == "send":
            commit_armed = self.workers[w].before_commit is not None
            self._send(w, key, data.draw(st.sampled_from(self._answers()), label="answer"))
            if not commit_armed or key not in self.held[w]:
                return
            # A COMMIT fault was armed and the worker's next step is its call: its loop goes on
            # to the write that commits, so the fault meets a COMMIT, not nothing.
        self._record(w, key, data)

    def external_links(self, worker) -> list:
        """The worker's link to the external side, while it has a call to make."""
        unsent = any(h.result is None for h in self.held[worker.index].values())
        return [worker.ext_link] if self.receiver and unsent else []

    def leases(self) -> list[int]:
        m = self.model
        live = {
            r.key
            for r in m.runs.values()
            if r.status == m.owned and r.lease_until is not None and r.lease_until > m.now
        }
        return sorted(
            {w for w, key in self._holding() if key in live and m.owns(self.held[w][key].job)}
        )

    def meanwhile(self, w: int, data) -> None:
        other = 1 - w
        if self.description.lease and data.draw(st.booleans(), label="reaper runs"):
            self.reclaim_stale(other)
            if data.draw(st.booleans(), label="the other worker claims"):
                self.claim(other, 3)

    # -- helpers --------------------------------------------------------------------------------
    def _answers(self) -> list[int]:
        events = self.description.events()
        out = [200]
        if self.description.retry is not None or generic.FAIL in events:
            out.append(503)
        if generic.FAIL in events:
            out.append(422)
        return out

    def _holding(self, sent: bool | None = None) -> list[tuple[int, str]]:
        return [
            (w, k)
            for w, held in enumerate(self.held)
            for k in sorted(held, key=_order)
            if sent is None or (held[k].result is not None) == sent
        ]

    def _mine(self, w: int, sent: bool | None) -> list[str]:
        return [k for x, k in self._holding(sent) if x == w]

    def _call(self, worker, op: str, conn, *args, closes: bool = True) -> tuple[Any, bool]:
        """Run the adapter's ``op``: (its result, whether it signalled a lost race). Driver
        errors become the engine's: a lost connection (indeterminate when COMMIT was in
        flight, in autocommit, or on a driver of its own), a refused statement, a refused call."""
        fn = getattr(self.adapter, op)
        try:
            result = worker.run(fn(conn, *args))
        except (WorkerDied, EnvironmentFault, Failure, KnownstateError):
            raise
        except Exception as e:
            if self.adapter.lost_race.raised(e):
                worker.settle_after_error()
                return None, True
            raise self._translate(e, worker, op) from e
        if closes and worker.mode != "own" and worker.in_transaction():
            worker.abandon()
            self.fail(
                f"{op}: the adapter returned with its transaction still open: commit it "
                "(or use conn.transaction())"
            )
        return result, self.adapter.lost_race.returned(result)

    def _translate(self, e: BaseException, worker, op: str) -> BaseException:
        where = f"{self.kind}.{op}"
        pg = unwrap(e)
        text = str(pg or e).strip().splitlines()[0] if str(pg or e).strip() else type(e).__name__
        if pg is not None and is_connection_error(pg):
            conn = worker.conn
            if (
                worker.mode == "own"
                or getattr(conn, "in_commit", False)
                or getattr(conn, "autocommit", False)
            ):
                return CommitIndeterminate(f"{where}: {text}")
            return ConnectionLost(f"{where}: {text}")
        if pg is not None and not pg.sqlstate:
            return ClientError(f"{where}: {type(pg).__name__}: {text}")
        if pg is not None:
            return TransactionAborted(f"{where}: {pg.sqlstate} {text}")
        if isinstance(e, self.adapter_class.connection_errors):
            return CommitIndeterminate(f"{where}: {type(e).__name__}: {text}")
        worker.abandon()
        self.fail(f"{op}: the adapter raised {type(e).__name__}: {text}")

    def _write(self, op: str):
        """impl_op of a fenced write: Won, or LostRace('fenced')."""

        def impl(worker, *args):
            def run(conn):
                _, lost = self._call(worker, op, conn, *args)
                return LostRace("fenced") if lost else Won()

            return run

        return impl

    def _fence(self, h: Held):
        return lambda: (h.job.key, h.job.attempt, self.model.owns(h.job))

    def _unanswered(self, worker, h: Held):
        """A fenced write whose answer was lost: the worker forgets what it held, and if the
        writer no longer owned the run, the observation that follows judges whether the write
        landed anyway (the fence's violation, with no answer to show it)."""

        def lost() -> None:
            self.forget(worker)
            if not self.model.owns(h.job):
                self._unsure = (h.job.key, h.job.attempt)

        return lost

    def _stale(self, h: Held) -> bool:
        """Whether ``h``'s holder writes on a run another claim took since: what a fence is
        for. Counted per write, so a run goes on until each write met it often enough."""
        r = self.model.runs.get(h.job.key)
        return (
            r is not None
            and r.status == self.model.owned
            and h.job.attempt is not None
            and r.attempts > h.job.attempt
        )

    def _waiting(self) -> int:
        return sum(r.status == self.description.initial for r in self.model.runs.values())

    # -- operations ---------------------------------------------------------------------------
    @initialize(n=st.integers(1, 2))
    def enqueue_some(self, n: int) -> None:
        """Every example starts with a few runs waiting, so work flows from the first step."""
        for _ in range(n):
            self.enqueue(0)

    @precondition(lambda self: self._waiting() < 3)
    @rule(w=st.integers(0, 1))
    def enqueue(self, w: int) -> None:
        self._enqueue(w, self.model.next_key())

    @precondition(lambda self: self.description.idempotency_key and self.model.runs)
    @rule(w=st.integers(0, 1), data=st.data())
    def repeat(self, w: int, data) -> None:
        """A producer repeats a request under a key already used: it gets the same run."""
        key = data.draw(st.sampled_from(sorted(self.model.runs, key=_order)), label="key")
        if self._enqueue(w, key) is not None:
            self.event("repeat answered")

    def _enqueue(self, w: int, key: str):
        worker = self.workers[w]

        def impl(conn):
            self._call(worker, "enqueue", conn, key)
            return Won(key)

        return self.apply(worker, f"enqueue(w{w}, key={key})", lambda m: m.enqueue(key), impl)

    @rule(w=st.integers(0, 1), batch=st.integers(1, 3))
    def claim(self, w: int, batch: int) -> None:
        worker = self.workers[w]
        box: dict[str, Any] = {}
        got = self.apply(
            worker,
            f"claim(w{w}, batch={batch})",
            lambda m: self._expect_claim(m, batch, box),
            lambda conn: self._claim(worker, conn, batch, box),
            on_error=lambda: self.forget(worker),
            guarantee="claim",
        )
        if isinstance(got, Won):
            self._hold(w, box)

    def _expect_claim(self, m, batch: int, box: dict) -> Won:
        got = m.claim(batch)
        box["jobs"] = {j.key: j for j in got.value}
        return Won(tuple(self._token(j) for j in got.value))

    def _token(self, job: Job) -> Job:
        return job if self.model.tracks_attempts() else Job(job.key, None)

    def _claim(self, worker, conn, batch: int, box: dict, closes: bool = True) -> Won:
        result, _ = self._call(worker, "claim", conn, batch, closes=closes)
        claimed = [c if isinstance(c, Claimed) else Claimed(str(c)) for c in (result or ())]
        box["claimed"] = {c.key: c for c in claimed}
        jobs = sorted((Job(c.key, c.attempt) for c in claimed), key=lambda j: _order(j.key))
        return Won(tuple(self._token(j) for j in jobs))

    def _hold(self, w: int, box: dict) -> None:
        for key, job in box.get("jobs", {}).items():
            self.held[w][key] = Held(job, box["claimed"].get(key, Claimed(key, job.attempt)))

    @precondition(lambda self: self.receiver is not None and self._holding(sent=False))
    @rule(data=st.data())
    def send(self, data) -> None:
        """The external call for a claimed run, through the worker's own link. At-least-once."""
        w, key = data.draw(st.sampled_from(self._holding(sent=False)), label="worker, run")
        self._send(w, key, data.draw(st.sampled_from(self._answers()), label="answer"))

    def _send(self, w: int, key: str, answer: int) -> None:
        h, worker = self.held[w][key], self.workers[w]
        self.start_step()
        trial = self.model.copy()
        trial.sent(key)
        self.receiver.plan(answer)
        url = f"http://127.0.0.1:{worker.ext_link.port}/runs/{key}"
        label = f"send(w{w}, {key}, attempt={h.job.attempt}) answers {answer}"
        try:
            with self.external_call(worker):
                h.result = worker.run(self.adapter.send(h.claimed, url))
        except no_answer_errors(self.adapter_class) as e:
            h.result = RETRY
            self.log(f"{label} -> no answer ({type(e).__name__}); it may have arrived")
            self.event("external reply lost")
            self.maybe(Candidate(self.model, external=False), Candidate(trial, external=True))
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
            self.model = trial
            self.candidates = [Candidate(trial)]
        finally:
            self.receiver.reset_plan()

    @precondition(lambda self: self._holding(sent=True if self.receiver else None))
    @rule(data=st.data())
    def record(self, data) -> None:
        """The owner's fenced write of the outcome: complete, or fail (retry / give up / end)."""
        sent = True if self.receiver else None
        w, key = data.draw(st.sampled_from(self._holding(sent)), label="worker, run")
        self._record(w, key, data)

    def _record(self, w: int, key: str, data) -> None:
        worker, h = self.workers[w], self.held[w].pop(key)
        result = h.result or ANSWERS[data.draw(st.sampled_from(self._answers()), label="work")]
        write = self._write("complete" if result == OK else "fail")
        if result == OK:
            label = f"complete(w{w}, {key}, attempt={h.job.attempt})"
            model_op, impl = (lambda m: m.complete(h.job)), write(worker, h.claimed)
        else:
            permanent = result == PERMANENT
            label = f"fail(w{w}, {key}, attempt={h.job.attempt}, permanent={permanent})"

            def model_op(m):
                self.owing = frozenset({key})  # judged after this step: it owes its backoff
                return m.fail(h.job, permanent)

            impl = write(worker, h.claimed, permanent)
        stale = self._stale(h)
        got = self.apply(
            worker,
            label,
            model_op,
            impl,
            on_error=self._unanswered(worker, h),
            fenced=self._fence(h),
        )
        if stale and got is not None:
            self.event(f"stale {'complete' if result == OK else 'fail'} on a re-claimed run")
        if isinstance(got, LostRace):
            self.event("fence rejection")
        elif any(e == generic.RETRY for _, _, e, _ in self.model.transitions):
            self.event("backoff")

    @precondition(lambda self: generic.EXTEND in self.description.events() and self._holding())
    @rule(data=st.data())
    def extend_lease(self, data) -> None:
        """The owner's heartbeat (on a timer: a stall freezes it with the worker)."""
        w, key = data.draw(st.sampled_from(self._holding()), label="worker, run")
        worker, h = self.workers[w], self.held[w][key]
        stale = self._stale(h)
        got = self.apply(
            worker,
            f"extend_lease(w{w}, {key}, attempt={h.job.attempt})",
            lambda m: m.extend_lease(h.job),
            self._write("extend_lease")(worker, h.claimed),
            on_error=self._unanswered(worker, h),
            fenced=self._fence(h),
        )
        if stale and got is not None:
            self.event("stale extend_lease on a re-claimed run")
        if isinstance(got, LostRace):
            self.event("fence rejection")
            self.held[w].pop(key, None)

    @precondition(lambda self: self.description.lease is not None)
    @rule(w=st.integers(0, 1))
    def reclaim_stale(self, w: int) -> None:
        worker = self.workers[w]
        box: dict[str, Any] = {}

        def expect(m):
            box["expected"] = m.reclaim_stale()
            return box["expected"]

        def impl(conn):
            result, _ = self._call(worker, "reclaim_stale", conn)
            expected = box["expected"]
            if result is None:
                return expected  # the adapter cannot tell which: the state read back decides
            if isinstance(result, int) and not isinstance(result, bool):
                return expected if result == len(expected.value) else Won(f"{result} runs")
            keys = [
                getattr(r, "key", None) or (r["key"] if isinstance(r, dict) else r) for r in result
            ]
            return Won(tuple(sorted((str(k) for k in keys), key=_order)))

        got = self.apply(worker, f"reclaim_stale(w{w})", expect, impl, guarantee="lease")
        if isinstance(got, Won) and got.value:
            self.event("reclaim", len(got.value))

    def _may_race(self) -> bool:
        return (
            self.description.claim.skip_locked
            and self.workers[0].mode != "own"
            and all(w.clean() for w in self.workers)
            and len(self.model.due()) >= 2
        )

    @precondition(lambda self: self._may_race())
    @rule(ba=st.integers(1, 2), bb=st.integers(1, 2))
    def claim_race(self, ba: int, bb: int) -> None:
        """w1 claims at the instant w0's claim sends its COMMIT — w0's transaction still open,
        its rows still locked. The claim must skip them, at once, and never take the same runs;
        a claim that waits on them is seen waiting by the server (pg_blocking_pids)."""
        wa, wb = self.workers
        self.begin_step(2)
        trial = self.model.copy()
        box_a: dict[str, Any] = {}
        expected = self._expect_claim(trial, ba, box_a)
        race: dict[str, Any] = {}
        wa.arm(lambda conn: race.update(self._race(wb, bb)))
        label = f"claim_race: w0 claim(batch={ba})"
        try:
            got = self._claim(wa, wa.connection(), ba, box_a)
        except ConnectionLost as e:  # its connection died with the server, before anything
            self.log(f"{label} -> {type(e).__name__}")
            wa.abandon()
            return
        except CommitIndeterminate as e:  # in autocommit: the claim may have landed
            self.log(f"{label} -> indeterminate ({e.detail})")
            wa.abandon()
            self.maybe(Candidate(self.model, committed=False), Candidate(trial, committed=True))
            return
        except TransactionAborted as e:
            wa.abandon()
            self.fail(f"{label}: the server refused a statement the model accepts: {e.detail}")
        finally:
            wa.before_commit = None
        self.log(f"{label} -> {fmt(got)}")
        if "failure" in race:
            raise race["failure"]
        if got != expected:
            self.fail(
                f"{label}: implementation answered {fmt(got)}, the model expects {fmt(expected)}",
                otherwise="claim",
            )
        self.model = trial
        self.candidates = [Candidate(trial)]
        self._hold(0, box_a)
        if not race:
            self.log("  (w0's claim sent no COMMIT: no race to see; w1 claims after it)")
            return self.claim(1, bb)
        self._raced(race, bb, got)

    def _race(self, wb, bb: int) -> dict[str, Any]:
        """w1's claim, run while w0's COMMIT waits (inside w0's COMMIT hook): never raises, so
        w0's own code cannot swallow a failure; the caller judges what it returns."""
        box: dict[str, Any] = {}
        seen = None
        try:
            conn = wb.connection()
            with watch(self.env, wb, [self.workers[0]]) as seen:
                return {"got": self._claim(wb, conn, bb, box), "box": box, "seen": seen}
        except Failure as e:
            return {"failure": e}
        except KnownstateError as e:
            wb.abandon()
            return {"error": e, "seen": seen}

    def _raced(self, race: dict[str, Any], bb: int, got_a: Won) -> None:
        label = f"claim_race: w1 claim(batch={bb}) at w0's COMMIT, w0's rows locked"
        seen, error = race.get("seen"), race.get("error")
        if error is not None:
            self.log(f"{label} -> {type(error).__name__}")
            if seen is not None and seen.blocked_by:
                problem = (
                    f"{label}: waited on a lock held by w0's open transaction (seen by "
                    "the server: pg_blocking_pids), and was cancelled"
                )
                self.fail(problem, [Violation("claim", problem)])
            if isinstance(error, ConnectionLost):
                return
            self.fail(f"{label}: {error}")
        box = race["box"]
        trial = self.model.copy()
        expected = self._expect_claim(trial, bb, box)
        got = race["got"]
        self.log(f"{label} -> {fmt(got)}")
        self.log("  (w0 commits)")
        if got != expected:
            self.fail(
                f"{label}: implementation answered {fmt(got)}, the model expects {fmt(expected)}",
                otherwise="claim",
            )
        self.model = trial
        self.candidates = [Candidate(trial)]
        self._hold(1, box)
        if got_a.value and got.value:
            self.event("skip locked")


# ---------------------------------------------------------------------------------------
# Building a check.
# ---------------------------------------------------------------------------------------


def adapter_problems(d: RunKind, adapter: type[Adapter]) -> list[str]:
    """What the adapter lacks for this description (empty: nothing), with hints."""
    out = []
    name = adapter.__name__
    events = d.events()
    need = {
        "enqueue": "(conn, key)",
        "claim": "(conn, batch) -> [Claimed]",
        "complete": "(conn, job)",
    }
    if d.retry is not None or generic.FAIL in events:
        need["fail"] = "(conn, job, permanent)"
    if generic.EXTEND in events:
        need["extend_lease"] = "(conn, job)"
    if d.lease is not None:
        need["reclaim_stale"] = "(conn) -> keys taken back"
    if d.external != "none":
        need["send"] = "(job, url) -> OK | RETRY | PERMANENT"
    for op, sig in need.items():
        if not adapter.implements(op):
            out.append(f"{name} has no {op}{sig}, which the description needs: implement it")
    if not adapter.schema.strip():
        out.append(f"{name}.schema is empty: give the SQL that creates the tables")
    if not adapter.read_query and adapter.read is Adapter.read:
        out.append(
            f"{name} has neither read_query nor read(conn): give the query that reads "
            "every run back (key, status, attempts, due, lease_until)"
        )
    for guard, text in adapter.guards.items():
        if guard not in GUARDS:
            out.append(f"{name}.guards names {guard!r}: choose from {', '.join(GUARDS)}")
        elif not any(text in q for q in adapter.queries.values()):
            out.append(
                f"{name}.guards[{guard!r}] = {text!r} appears in none of its queries: "
                "copy the guard's text exactly as the SQL has it"
            )
    try:
        adapter.mode()
    except TypeError as e:
        out.append(str(e))
    return out


def derived_mutants(d: RunKind, adapter: type[Adapter]) -> list[Mutant]:
    """For each guard the adapter names, a mutant of each query containing it, without it."""
    out = []
    for guard, text in adapter.guards.items():
        for query, sql in adapter.queries.items():
            if guard in GUARDS and text in sql:
                edited = sql_edit(adapter.queries, query, text, "")
                out.append(
                    Mutant(
                        f"no-{guard.replace('_', '-')}-in-{query.replace('_', '-')}",
                        d.name,
                        GUARDS[guard],
                        f"query {query!r} without its {guard} guard ({text.strip()!r})",
                        with_attrs(adapter_queries=edited),
                    )
                )
    return out


def required_events(d: RunKind, mode: str) -> tuple[str, ...]:
    out = ["connection lost"]
    if d.fence.kind != "none":
        out += ["lost race", "fence rejection"]
    if d.lease is not None:
        out.append("reclaim")
        if d.retry is not None:  # a run taken back is claimed again: each fenced write meets it
            writes = ["complete", "fail"] + (
                ["extend_lease"] if generic.EXTEND in d.events() else []
            )
            out += [f"stale {w} on a re-claimed run" for w in writes]
    if d.retry is not None:
        out.append("backoff")
    if mode != "own":
        out += [
            "worker died before commit",
            "indeterminate commit",
            "indeterminate resolved: committed",
            "indeterminate resolved: not committed",
        ]
        if d.claim.skip_locked:
            out.append("skip locked")
    if d.external != "none":
        out.append("external reply lost")
    if d.external == "at-least-once":
        out.append("duplicate delivery")
    if d.idempotency_key:
        out.append("repeat answered")
    return tuple(out)


def kind(
    description: RunKind, adapter: type[Adapter], *, mutants: Iterable[Mutant] = ()
) -> type[GenericCheck]:
    """The check of ``description`` run against the system ``adapter`` binds. Raises
    :class:`KindError` naming what to change when the two cannot make a check."""
    problems = generic.fit_problems(description) + adapter_problems(description, adapter)
    if problems:
        raise KindError(f"run kind {description.name!r}: " + "; ".join(problems))
    timing = Timing.of(description, QUANTUM)
    mode = adapter.mode()
    policy = FaultPolicy(
        gap=1,
        heal_after=6,
        stall=timing.lease + QUANTUM if timing.lease else None,
        reply_lost=description.external != "none",
        commit_faults=() if mode == "own" else FaultPolicy().commit_faults,
    )
    title = "".join(p.capitalize() for p in description.name.split("-"))
    cls = type(
        f"{title}Check",
        (GenericCheck,),
        {
            "__module__": adapter.__module__,
            "__doc__": f"The {description.name} kind, checked from its description.",
            "kind": description.name,
            "description": description,
            "adapter_class": adapter,
            "timing": timing,
            "contract": description.contract(),
            "schema": adapter.schema,
            "policy": policy,
            "required_events": required_events(description, mode),
            "worker_class": adapter_worker(adapter),
        },
    )
    cls.mutants = derived_mutants(description, adapter) + list(mutants)
    return cls
