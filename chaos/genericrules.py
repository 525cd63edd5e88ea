"""Rules only some described queues get: a mixin each of :class:`~.generic.GenericCheck`,
given by :func:`~.generic.kind` to the kinds whose description calls for it, so the rules of
every other kind, and what a seed draws there, stay as they were.

- :class:`FailsAgain`: the attempt limit reached on purpose, where attempts count no claims.
- :class:`SkewsAppClock`: the application's clock set apart from the database's, where the
  application's now schedules runs or stamps leases (within ``RunKind.clock_skew``, if bounded).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from . import rows
from .adapter import RETRY
from .harness import QUANTUM


class FailsAgain:
    """The attempt limit reached on purpose: a mixin of the check of a queue whose attempts
    count no claims (``Retry(counts="retries" | "executions")``). There the limit takes one run
    failing at every attempt, a backoff between each, which outcomes drawn evenly met three
    times in about a thousand examples (pgqueuer's give-up decided its control's length); where
    a claim counts one, any claims of a run reach it. Only such kinds get the rule, so the
    rules of every other kind, and what a seed draws there, stay as they were."""

    def _fails_again(self) -> list[str]:
        """Runs waiting after a failed run of their work, while a worker is idle: due now, or
        once the database's clock may jump to them."""
        if not self._idle():
            return []
        m = self.model
        jump = self._may_jump()
        return [
            r.key
            for r in sorted(m.runs.values(), key=lambda r: r.seq)
            if r.status in m.waiting and r.attempts > 0 and (r.due <= m.now or jump)
        ]

    def _idle(self) -> list[int]:
        return [w for w in (0, 1) if not self.held[w] and self.workers[w].clean()]

    @precondition(lambda self: self._fails_again())
    @rule(data=st.data())
    def fail_again(self, data) -> None:
        """A run that failed before is claimed once due and fails again (a job that fails tends
        to fail each time): the attempt limit, where its retries end, reached on purpose."""
        m, key = self.model, rows.row(data, self._fails_again(), "run")
        wait = m.runs[key].due - m.now
        if wait > 0:  # its backoff, passed by a jump of the database's clock
            self.jump_clock(wait)
        w = rows.row(data, self._idle(), "worker")
        due = [r.key for r in self.model.due()]
        if key not in due:
            return
        self.do(w, self._claim(w, min(self._batches()[-1], due.index(key) + 1)))
        if key not in self.held[w]:
            return
        if self.receiver is not None:
            self.do(w, self._send(w, key, 503))
            self.do(w, self._records(w, key)[0])
        else:
            self.do(w, self._record(w, key, RETRY))


class SkewsAppClock:
    """The application's clock set apart from the database's: a mixin of the check of a queue
    whose runs are scheduled by the application's now (``Claim(unscheduled="application")``,
    chancy's ``Job.scheduled_at``). The clock the gate hands the adapter (``Adapter.now()``)
    jumps, forward or back, and the database's stays: a run added then is due when the
    database's clock reaches the application's now, early or late by the skew, and the model
    moves its application clock with the adapter's. The database clock's own jumps already set
    the two apart the other way. Only such kinds get the rule, so the rules of every other
    kind, and what a seed draws there, stay as they were.

    Where the description bounds the two clocks (``RunKind.clock_skew``, NTP's seconds), the
    gate keeps them within it: a skew draws the distance between them anew, within the bound
    either way, and a jump of the database's clock, or a stall, is time passing on both.
    The bound is scaled with the description's other durations (``Timing.scale``), so it is
    a whole number of the check's quanta, as every time the model keeps is, and a distance
    drawn is one too (5 s beside a 1 m lease: the lease 12 m, the clocks -1, 0 or +1 m
    apart). Unbounded (None, the default), the clocks are apart by every jump and skew drawn."""

    @precondition(lambda self: self._calm())
    @rule(data=st.data())
    def fault_app_clock_skew(self, data) -> None:
        bound = self.description.clock_skew
        if bound is None:
            seconds = data.draw(st.sampled_from(self.policy.clock_jumps), label="seconds")
            self._skew_app(seconds)
            self.fault("app-clock-skew", f"application clock {seconds:+d}s (the database's stays)")
            return
        quanta = self.timing.clock_skew // QUANTUM  # a whole number, as every duration is
        apart = data.draw(st.integers(-quanta, quanta), label="apart") * QUANTUM
        seconds = apart - self.candidates[0].model.app_apart()
        self._skew_app(seconds)
        self.fault("app-clock-skew", f"application clock {seconds:+d}s, {self._apart()}")

    def _skew_app(self, seconds: int) -> None:
        self.adapter.app_skew += seconds
        for c in self.candidates:
            c.model.skew_app(seconds)

    def _apart(self) -> str:
        """How far apart the two clocks are now, against the bound, as the trace says it."""
        apart, scale = self.candidates[0].model.app_apart(), self.timing.scale
        where = "ahead of" if apart >= 0 else "behind"
        described = f", the described {self.description.clock_skew}s × {scale}" if scale > 1 else ""
        return f"{abs(apart)}s {where} the database's (bound {self.timing.clock_skew}s{described})"

    def jump_clock(self, seconds: int) -> None:
        """A jump of the database's clock moves the database's only; where the clocks are
        bounded (``RunKind.clock_skew``) it is time passing on both, the application's moving
        with it (a backoff passed by a jump too), so the distance stays what a skew drew."""
        super().jump_clock(seconds)
        if self.description.clock_skew is not None:
            self._skew_app(seconds)
            self.log(f"application clock {seconds:+d}s with it, {self._apart()}")

    def stall_passes(self, seconds: int) -> None:
        """A stall passes on the application's clock too where the lease is stamped and judged
        by it (``Lease(clock="application")``): the stalled holder's lease lapses. Where it only
        schedules runs, the stall is a jump of the database's clock like the others (chancy's
        control took 806, 165, 800, 763, 642 examples at seeds 1-5 with its stalls passing on
        both clocks, 319, 270, 411, 536, 407 without: the same verdicts). Where the clocks are
        bounded (``RunKind.clock_skew``), it passes on both, as a jump of the database's does."""
        super().stall_passes(seconds)
        if self.description.app_clock_lease or self.description.clock_skew is not None:
            self._skew_app(seconds)
