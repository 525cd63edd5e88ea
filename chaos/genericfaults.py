"""The fault policy's questions, answered for a described queue: a mixin of
:class:`~.generic.GenericCheck`.

The base's fault policy asks a kind when the clock matters, what a worker does next (and which
step meets an armed fault), who holds a live lease, which write a worker makes next, and what
happens while a worker is frozen. A described queue answers from its model and the runs its
workers hold, with the generic check's helpers (``_holding``, ``_mine``, ``_claim``, ``_send``,
``_records``, ``_extend``, ``_reap``).
"""

from __future__ import annotations

from hypothesis import strategies as st

from . import rows
from .adapter import OK


def _after(n: int, worker, hook):
    """``hook``, armed on ``worker``'s COMMIT, meeting the one after the next ``n``: an
    operation of several transactions fails after some of them landed."""

    def later(conn) -> None:
        nonlocal n
        if n:
            n -= 1
            worker.before_commit = later  # the COMMIT that ran it took it: armed again
            return
        hook(conn)

    return later


class FaultAnswers:
    """The generic check's answers to the fault policy."""

    frozen_aim: str = "complete"
    """A holder frozen inside its write while its run changed hands makes its completion twice
    as often as its other writes together: the stale completion is the write a fence exists for
    (drawn as one of its writes, heartbeats and failures took five draws in six, and a
    completion that read the run's attempt between two statements was missed at outbox seed 5)."""

    def clock_matters(self) -> bool:
        held = {key for _, key in self._holding()}
        m = self.model
        return any(
            (r.status == m.owned and r.key not in held) or (r.status in m.waiting and r.due > m.now)
            for r in m.runs.values()
        )

    def turns(self, w: int) -> list[str]:
        """What ``w`` can do next: record an outcome, make the external call, claim; and, while
        it holds runs, its heartbeat, whose timer may fire first (after a stall it is overdue);
        and the reaper, whose COMMIT a fault may meet after some of its take-backs: described
        as one transaction per run (``Lease(reaps="one-by-one")``) or not (a reaper described
        as one transaction that commits each run apart leaves a state the model cannot reach;
        met once in about 500 examples by blocks alone, ``tests/test_reaps_apart.py``)."""
        ops = {a.op for a in self.actions(w)}
        steps = ("record", "send", "claim", self.heartbeat_op, "reclaim_stale")
        return [op for op in steps if op in ops]

    def turn(self, w: int, data, due: frozenset = frozenset()) -> None:
        """The step that meets the fault armed for it: a lost reply meets the external call,
        a COMMIT fault a step that commits; or the heartbeat, when its timer fires first. After
        a stall, the write it was about to make (``due``: its record of one of those runs),
        never its heartbeat first."""
        options = self.turns(w)
        step = options[0]
        if self.reply_lost_armed == w and "send" in options:
            step = "send"
        elif self.workers[w].before_commit is not None:
            step = next((o for o in options if o != "send"), step)
        beat = self.heartbeat_op
        if beat in options and step != beat and self.reply_lost_armed != w and not due:
            if data.draw(st.booleans(), label="its heartbeat fires first"):
                step = beat
        if step == "claim":
            self.do(w, self._claim(w, self._batches()[-1]))
            return
        if step == "reclaim_stale":
            reap = self._reap(w)
            worker = self.workers[w]
            if worker.before_commit is not None and reap.runs:  # its read commits too
                # a COMMIT per run at most (one transaction meets the fault at its first)
                met = data.draw(st.integers(0, len(reap.runs)), label="COMMITs before the fault")
                worker.before_commit = _after(met, worker, worker.before_commit)
            self.do(w, reap)
            return
        if step == beat:
            key = rows.row(data, self._mine(w, sent=None), "run")
            self.do(w, self._extend(w, key))
            return
        mine = self._mine(w, sent=step == "record" and self.receiver is not None)
        key = rows.row(data, [k for k in mine if k in due] or mine, "run")
        if step == "send":
            commit_armed = self.workers[w].before_commit is not None
            answer = data.draw(st.sampled_from(self._answers()), label="answer")
            self.do(w, self._send(w, key, answer))
            if not commit_armed or key not in self.held[w]:
                return
            # A COMMIT fault was armed and the worker's next step is its call: its loop goes on
            # to the write that commits, so the fault meets a COMMIT, not nothing.
        self.do(w, data.draw(st.sampled_from(self._records(w, key)), label="work"))

    def leases(self) -> list[int]:
        """Workers holding a live lease; those that called out and have not recorded it yet when
        there are any: a stall between the call and the record is where a stale owner's write
        meets the reaper and a new owner."""
        m = self.model
        live = {
            r.key
            for r in m.runs.values()
            if r.status == m.owned and r.lease_until is not None and not m.lapsed(r)
        }
        holding = [(w, k) for w, k in self._holding() if k in live and m.owns(self.held[w][k].job)]
        sent = {w for w, k in holding if self.held[w][k].result is not None}
        return sorted(sent or {w for w, _ in holding})

    def next_write(self, w: int, data, frozen: bool = False) -> frozenset:
        """The write a worker's loop makes next is the record of a run it called out for: one
        that called for none yet makes its call first. The completion is the write a stall
        aims at (:attr:`frozen_aim`): of the runs it called for, one answered 200 is drawn as
        often as the others together; and a worker about to freeze inside its write that holds
        none answered 200 but one it has not called for makes that call first, answered 200.
        (At outbox seed 11 the worker holding a lease had only failed calls in 36 of 46 frozen
        stalls, and the frozen completion, met last at 9 of seeds 1-20, took 516 examples; with
        the call first, 133. Seeds 1-20: 3,120 examples against 4,393, at most 258 against 598.)
        The runs: that one (without an external side: every run it holds)."""
        if self.receiver is None:
            return frozenset(self._mine(w, sent=None))
        called, unsent = self._mine(w, sent=True), self._mine(w, sent=False)
        aimed = frozen and self.frozen_aim == "complete" and unsent
        if aimed and not any(self.held[w][k].result == OK for k in called):
            key = rows.row(data, unsent, "run")
            self.do(w, self._send(w, key, 200))
        elif not called and unsent:
            key = rows.row(data, unsent, "run")
            answer = data.draw(st.sampled_from(self._answers()), label="answer")
            self.do(w, self._send(w, key, answer))
        sent = self._mine(w, sent=True)
        ok = [k for k in sent if self.held[w][k].result == OK]
        rest = [k for k in sent if k not in ok]
        runs = ok or rest
        if ok and rest:  # drawn as a number: a row's score is not uniform over Hypothesis's draws
            pick = data.draw(st.integers(0, 1), label="its next write completes (0) or not")
            runs = ok if pick == 0 else rest
        return frozenset({rows.row(data, runs, "its next write's run")} if runs else ())

    def meanwhile(self, w: int, data, retake: bool = False) -> None:
        """While ``w`` is frozen the reaper runs, or not, and the other worker claims again, or
        not: a stale owner resumes on a run still waiting, re-claimed, or never taken back. With
        ``retake`` both happen, the claim taking as many due runs as reaches ``w``'s."""
        if not self.description.lease:
            return
        reaper = self.n_workers > self.REAPER
        if not reaper or retake or data.draw(st.booleans(), label="reaper runs"):
            if reaper:
                self.do(self.REAPER, self._reap(self.REAPER))
            if retake or data.draw(st.booleans(), label="the other worker claims"):
                due = [r.key for r in self.model.due()]
                mine = [due.index(k) + 1 for k in self.held[w] if k in due]
                most = self._batches()[-1]
                batch = min(most, max(mine)) if retake and mine else most
                self.do(1 - w, self._claim(1 - w, batch))
