"""The branch reset's clocks: every process's application clock, the skew rule, and the bound a
live run is judged against (a mixin of :class:`~.branch_reset.BranchResetCheck`).

Clocks. Every process's application clock is ``EPOCH + model.app_now(process)``, fully
controlled, so lease stamps (application time) are exact and need no rounding. The model's
``now`` is real time here: time passing moves every application clock; a skew moves one. No
branch-reset guard reads the database clock, so a database clock jump moves nothing in the model,
and the check shows that it moves nothing in the implementation either.

The skew bound. With lease ``L`` and poll margin ``M`` (a live run is polled at least every
``M``), ``skew_bound(L, M) = L - M``: a reaper whose clock is less than that ahead of the last
poller's never reaps a live run. The check keeps every running run's last lease stamp (when, and
by a clock skewed how far), and judges every live run (stamped at most ``M`` ago) that a reap
ended or a poll refused as lapsed: below the bound that fails the check; at or past it, it is the
recorded deviation of an application-clock lease, allowed, counted as "reaped live run under skew
past bound (known deviation)" and labelled in the trace. A reaper ahead within the bound that
spares a live run is counted too ("live run spared by a reaper ahead within bound").
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.model import branch_reset as model
from knownstate.model.branch_reset import Status
from knownstate.model.contract import Violation

from ..check import QUANTUM

POLLERS = (0, 1)
REAPER = 2

EPOCH = datetime(2030, 1, 1, tzinfo=timezone.utc)
"""Application time zero: every process's clock is EPOCH + model.app_now(process)."""

LEASE = 5 * QUANTUM
"""The check's lease L (the reference default is 600 s): short, so a stall lapses it in one rule."""

MARGIN = QUANTUM
"""The poll margin M: a run stamped at most this long ago is *live* (its poller is on schedule)."""

BOUND = model.skew_bound(LEASE, MARGIN)
"""L - M = 240 s with the check's lease: a reaper less than this ahead never ends a live run."""

SKEWS = (
    -QUANTUM,
    0,
    QUANTUM,
    2 * QUANTUM,
    BOUND - QUANTUM,
    BOUND,
    BOUND + QUANTUM,
    LEASE + QUANTUM,
    2 * LEASE,
)
"""What the app-clock skew rule sets one process's clock to, from real time: behind, on time,
ahead within the bound, and ahead at or past it, the bound's edge on both sides."""

SKEW_BOUND = (
    "A live run (stamped at most M ago) is reaped or refused as lapsed only by a "
    "clock at least L - M ahead of its last poller's: the bound of an app-clock lease."
)


class Clocks:
    """The application clocks of a branch-reset check: each process's, skewed by the skew rule,
    and the judge of every live run ended or refused by one."""

    def _app_clock(self, worker: str):
        return lambda: EPOCH + timedelta(seconds=self.model.app_now(worker))

    @staticmethod
    def _app_seconds(ts: datetime):
        """An application-time stamp as model seconds: exact, the clocks are the check's."""
        s = (ts - EPOCH).total_seconds()
        return int(s) if s.is_integer() else s

    def _skew(self, worker: str) -> int:
        return self.model.app_skew.get(worker, 0)

    def _live(self, run_id: str, m: model.BranchResetModel | None = None) -> tuple[int, int] | None:
        """(stamped at, stamper's skew) when the running run's last stamp in state ``m`` (default:
        the model's) is at most M old: its poller is on schedule, so the run is live. A stamp
        that is not the recorded one was made in the block ``m`` is part of, at ``m.now``."""
        m = self.model if m is None else m
        run = m.runs.get(run_id)
        if run is None or run.status is not Status.RUNNING:
            return None
        stamp = self.stamps.get(run_id)
        if stamp is None or stamp[0] != run.lease_until:
            return m.now, run.lease_until - self.lease - m.now
        _, at, skew = stamp
        return (at, skew) if m.now - at <= self.margin else None

    def _live_met(self, worker: str, run_id: str, drawn: tuple[int, int] | None) -> list:
        """The run's liveness as ``worker``'s operation met it: in a block, in each state the
        order that explains the block gave it (an operation before it may have stamped the run);
        in a step, as it was when the step was drawn."""
        states = self.met.get(worker)
        return [drawn] if states is None else [self._live(run_id, m) for m in states]

    def _judge_skew(self, run_id: str, worker: str, lives: list, what: str) -> None:
        """A run live in every state ``worker``'s operation may have met (``lives``) was ended
        (reap) or refused (poll) by its clock: only a clock at or past the bound ahead of its
        last poller's may do that (the most lenient of the states decides)."""
        at, poller_skew = min(lives, key=lambda lv: lv[1])
        rel = self._skew(worker) - poller_skew
        if rel < BOUND:
            problem = (
                f"{what} {run_id}, live (stamped {self.model.now - at}s ago), by a clock "
                f"{rel:+d}s from its poller's, below L - M = {BOUND}s"
            )
            self.fail(problem, [Violation("skew-bound", problem)])
        self.log(
            f"  ({what} live run {run_id}: {worker}'s clock is {rel:+d}s "
            "from its last poller's, "
            f">= L - M = {BOUND}s: the known deviation of an application-clock lease)"
        )

    @precondition(lambda self: self._runs(Status.RUNNING))
    @rule(skew=st.sampled_from([s for s in SKEWS if s > 0]))
    def reap_on_a_clock_ahead(self, skew: int) -> None:
        """The reaper job runs on a host whose clock is ``skew`` ahead of real time (and stays so):
        the case the skew bound is about, both sides of it. An operation with an app-clock skew,
        so swarm testing never switches it off."""
        self.fault_app_clock_skew(REAPER, skew)
        self.do(REAPER, self._reap())

    @precondition(lambda self: self.skews < 4)
    @rule(w=st.sampled_from([REAPER, *POLLERS]), skew=st.sampled_from(SKEWS))
    def fault_app_clock_skew(self, w: int, skew: int) -> None:
        """One process's application clock is set ``skew`` seconds from real time. The lease is in
        application time (the recorded deviation): the spread of the clocks is judged against
        the bound L - M. Not paced (it disturbs no connection); four per example."""
        self.skews += 1
        name = self.workers[w].name
        delta = skew - self._skew(name)
        for c in self.candidates:
            c.model.skew(name, delta)
        skews = [self._skew(x.name) for x in self.workers]
        spread = max(skews) - min(skews)
        what = "skew within bound" if spread < BOUND else "skew past bound (known deviation)"
        self.event(what)
        who = "the reaper" if w == REAPER else "poller"
        self.fault(
            "app-clock-skew",
            f"app clock of {who} {name} set {skew:+d}s from real time "
            f"(spread {spread}s, L - M = {BOUND}s: {what})",
            pace=False,
        )
