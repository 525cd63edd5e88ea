"""The claim race of a described queue: a rule of :class:`~.generic.GenericCheck`.

w1 claims at the instant w0's claim sends its COMMIT, w0's rows still locked: a claim that
skips them (``SKIP LOCKED``) takes other runs at once; one that waits on them is seen waiting
by the server (``pg_blocking_pids``); one that takes the same runs is a claim violation.
A mixin of the generic check, using its claim helpers (``_claimed``, ``_tokens``, ``_took``).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from knownstate.impl.errors import (
    CommitIndeterminate,
    ConnectionLost,
    KnownstateError,
    TransactionAborted,
)
from knownstate.model.contract import Violation, Won

from .check import Candidate, Failure, fmt
from .harness import watch


class ClaimRace:
    """The claim race rule (and its precondition) of the generic check."""

    def _may_race(self) -> bool:
        """Two clean workers, two due runs, one possible state (the race's claims are judged on
        it); with a lease per worker, both workers registered (a worker registers when it
        starts, before its first claim). In autocommit no claim sends a COMMIT to race."""
        return (
            self.description.claim.skip_locked
            and self.description.commits == "transaction"
            and len(self.candidates) == 1
            and self.workers[0].mode != "own"
            and all(w.clean() for w in self.workers)
            and len(self.model.due()) >= 2
            and all(self._holder(w) in self.model.beats for w in (0, 1) if self._holder(w))
        )

    @precondition(lambda self: self._may_race())
    @rule(ba=st.integers(1, 2), bb=st.integers(1, 2))
    def claim_race(self, ba: int, bb: int) -> None:
        """w1 claims at the instant w0's claim sends its COMMIT — w0's transaction still open,
        its rows still locked. The claim must skip them, at once, and never take the same runs;
        a claim that waits on them is seen waiting by the server (pg_blocking_pids)."""
        ba, bb = min(ba, self._batches()[-1]), min(bb, self._batches()[-1])
        wa, wb = self.workers[:2]
        self.begin_step(2)
        trial = self.model.copy()
        expected = self._tokens(trial.claim(ba, self._holder(0)))
        race: dict[str, Any] = {}
        wa.arm(lambda conn: race.update(self._race(wb, bb)))
        label = f"claim_race: w0 claim(batch={ba})"
        try:
            got = self._claimed(wa, wa.connection(), ba)
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
        self._agreed(label, got, expected, trial, 0)
        if not race:
            self.log("  (w0's claim sent no COMMIT: no race to see; w1 claims after it)")
            self.do(1, self._claim(1, bb))
            return
        self._raced(race, bb, got)

    def _agreed(self, label: str, got: Any, expected: Any, trial: Any, w: int) -> None:
        """Worker ``w``'s claim answered as the model expects (else the claim is named): the
        model moves on, and the claimed runs are worker ``w``'s."""
        if got != expected:
            self.fail(
                f"{label}: implementation answered {fmt(got)}, the model expects {fmt(expected)}",
                otherwise="claim",
            )
        self.model = trial
        self.candidates = [Candidate(trial)]
        self._took(w)(got)

    def _race(self, wb, bb: int) -> dict[str, Any]:
        """w1's claim, run while w0's COMMIT waits (inside w0's COMMIT hook): never raises, so
        w0's own code cannot swallow a failure; the caller judges what it returns."""
        seen = None
        try:
            conn = wb.connection()
            with watch(self.env, wb, [self.workers[0]]) as seen:
                return {"got": self._claimed(wb, conn, bb), "seen": seen}
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
        trial = self.model.copy()
        expected = self._tokens(trial.claim(bb, self._holder(1)))
        got = race["got"]
        self.log(f"{label} -> {fmt(got)}")
        self.log("  (w0 commits)")
        self._agreed(label, got, expected, trial, 1)
        if got_a.value and got.value:
            self.event("skip locked")
