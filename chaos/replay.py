"""Run, then replay: the engine of a check whose operations are a client's scripts.

How it works
------------

A client protocol (the document session is the first) is not a run a worker claims: it is a
client doing something — a few requests, decisions between them — against a server. A check of
one writes each operation as a *script*, a function of a *side*: run once on the real side (real
clients, real HTTP, real database, real faults) while every exchange is recorded, then replayed
on the model side, whose network is the recording. The model must send the same requests in the
same order, its server must give the same answers, and the script must end the same way.

A request whose answer never arrived may or may not have been applied by the server. Each such
request gives the model two worlds, landed and not landed (one only, when landing would change
nothing); the engine keeps every world that agrees with what the implementation did
(:class:`Candidate`, with what became of each lost request) and the next observation decides
between them — it never assumes lost and never assumes done. After each step the real world is
observed and must equal one candidate's, and the kind's judge (its invariants) runs on the real
world: when the implementation disagrees with every candidate, the judge runs first, so a
failure names the invariant it broke when it broke one, and otherwise shows the difference.

What a kind provides: :meth:`~ReplayCheck.real_side`, :meth:`~ReplayCheck.model_side`, the
:class:`Recorder` its real wires record to, which answers were lost (:meth:`~ReplayCheck.lost`)
and which requests change state (:meth:`~ReplayCheck.may_change`),
:meth:`~ReplayCheck.deliver_to_model`, :meth:`~ReplayCheck.landing_changes`,
:meth:`~ReplayCheck.judge`, :meth:`~ReplayCheck.difference`, :meth:`~ReplayCheck.counted`, and
how to show a request and an answer in the trace. Its rules call :meth:`~ReplayCheck.play`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple

from hypothesis.stateful import invariant

from . import steps, timings
from .engine import Engine


@dataclass(frozen=True)
class Raised:
    """An operation refused with an exception (the model must refuse it the same way)."""

    error: str


def outcome(fn: Callable[[], Any], errors: tuple[type[BaseException], ...]) -> Any:
    """What a script ended with: its value, or the domain error it raised (as :class:`Raised`)."""
    try:
        return fn()
    except errors as e:
        return Raised(type(e).__name__)


def _encode(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return [type(o).__name__, *(getattr(o, f.name) for f in dataclasses.fields(o))]
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    raise TypeError(f"cannot compare a {type(o).__name__}")


def canon(x: Any) -> str:
    """A strict canonical form (JSON): ``true`` is not ``1``, ``1`` is not ``1.0``, and dict
    order does not count."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"), default=_encode)


def short(x: Any, limit: int = 400) -> str:
    text = repr(x)
    return text if len(text) < limit else text[: limit - 3] + "..."


class Diverged(Exception):
    """The model cannot follow what the implementation did."""


class Redundant(Exception):
    """A 'the lost request landed' world that equals the 'it did not' one: not kept twice."""


class Exchange(NamedTuple):
    wire: str  # which client made it
    request: Any
    answer: Any


class Recorder:
    """Every exchange the real side made, in the order it happened."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []

    def record(self, wire: str, request: Any, answer: Any) -> None:
        self.exchanges.append(Exchange(wire, request, answer))

    def take(self) -> list[Exchange]:
        out, self.exchanges = self.exchanges, []
        return out


@dataclass
class Candidate(steps.Candidate):
    """One possible world: the model after the steps so far, what became of each request whose
    answer was lost in the last step, and how many lost requests landed or not so far."""

    fates: list[str] = field(default_factory=list)
    landed: int = 0
    not_landed: int = 0

    def fork(self) -> "Candidate":
        return Candidate(copy.deepcopy(self.model), landed=self.landed, not_landed=self.not_landed)


class ReplayCheck(Engine):
    """The replay engine: base of a check of a client protocol, the transactions engine's
    sibling (:mod:`.engine` lists the hooks of both). Rules call :meth:`play` with a script."""

    domain_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    """What a script may raise as an outcome (the model must raise the same)."""

    recorder: Recorder

    # -- what a kind provides --------------------------------------------------------------
    def real_side(self) -> Any:
        raise NotImplementedError

    def model_side(self, model: Any, deliver: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def lost(self, answer: Any) -> bool:
        """The answer never arrived (the request may or may not have reached the server)."""
        raise NotImplementedError

    def may_change(self, request: Any) -> bool:
        """Whether the request changes the server's state when it lands (a read does not)."""
        raise NotImplementedError

    def compared(self, outcome: Any) -> Any:
        """An outcome as it is compared with the model's (default: all of it)."""
        return outcome

    def unanswered(self, why: str) -> Any:
        """The answer a model's client gets for a request the real side never made (only while
        following a diverged run, so the judge can look at the real world)."""
        raise NotImplementedError

    def deliver_to_model(self, model: Any, request: Any) -> Any:
        raise NotImplementedError

    def landing_changes(self, answer: Any) -> bool:
        """Whether a lost request the model's server answers so changed anything by landing."""
        return True

    def judge(self, real: Any, model: Any, exchanges: list[Exchange]) -> list:
        """The invariants (violations) on the real world after a step."""
        return []

    def difference(self, expected: Any, real: Any) -> str:
        return f"  model:          {short(expected)}\n  implementation: {short(real)}"

    def counted(self, chosen: Candidate) -> None:
        """The real world matched ``chosen`` after a step: count what it observed."""

    def after_step(self) -> None:
        """Called after each script ran on the real side (e.g. to heal old faults)."""

    def on_the_wire(self, request: Any) -> Any:
        """What of a request crosses the wire: model and implementation must send the same. A
        client whose requests are read off the wire (a browser's, at a gateway) cannot show its
        client-side fields, so its check compares only this (default: the whole request)."""
        return request

    def describe(self, x: Any) -> str:
        return short(x, 120)

    def describe_request(self, request: Any) -> str:
        return short(request, 120)

    # -- the engine --------------------------------------------------------------------------
    def begin_example(self) -> None:
        self.worlds = [Candidate(self.model)]
        self.before_step = self.worlds
        self.divergence: str | None = None
        self.step_exchanges: list[Exchange] = []

    def play(self, label: str, script: Callable[[Any], Any], fault=None) -> Any:
        """Run ``script`` on the real side (inside the ``fault`` context, which yields a tag for
        the trace), then on every possible model world; keep the worlds that agree with what
        the implementation did (answers, requests, outcome)."""
        self.begin_step()
        self.recorder.take()
        self.before_step = self.worlds
        with fault if fault is not None else contextlib.nullcontext("") as tag:
            with timings.span("impl"):
                real = outcome(lambda: script(self.real_side()), self.domain_errors)
        exchanges = self.recorder.take()
        self.step_exchanges += exchanges
        wire = "; ".join(
            f"{self.describe_request(x.request)} -> {self.describe(x.answer)}" for x in exchanges
        )
        self.log(f"{label}{tag}{': ' + wire if wire else ''} => {self.describe(real)}")
        self.after_step()
        unknown = [
            i for i, x in enumerate(exchanges) if self.lost(x.answer) and self.may_change(x.request)
        ]
        kept, problems = [], []
        for world in self.worlds:
            for fates in itertools.product((False, True), repeat=len(unknown)):
                trial = world.fork()
                try:
                    got = self._replay(trial, script, exchanges, dict(zip(unknown, fates)))
                except Redundant:
                    continue
                except Diverged as e:
                    problems.append(f"{label}: {e}")
                    continue
                if canon(self.compared(got)) != canon(self.compared(real)):
                    problems.append(
                        f"{label}: the implementation's outcome is "
                        f"{self.describe(real)} ({short(real)}), the model's is "
                        f"{self.describe(got)} ({short(got)})"
                    )
                    continue
                kept.append(trial)
        if kept:
            self.worlds = kept
            return real
        # The model cannot follow. Keep the world in which the model's clients got the answers
        # the real ones got (requests never sent reach nothing), so the judge can still run.
        self.divergence = problems[0]
        follow = self.worlds[0].fork()
        with contextlib.suppress(Exception):
            self._replay(follow, script, exchanges, {}, follow=True)
        self.worlds = [follow]
        return real

    @timings.timed("check")
    def _replay(
        self,
        trial: Candidate,
        script,
        exchanges: list[Exchange],
        landed: dict[int, bool],
        follow: bool = False,
    ) -> Any:
        pos = 0

        def deliver(req):
            nonlocal pos
            i, pos = pos, pos + 1
            if i >= len(exchanges):
                if follow:
                    return self.unanswered("never sent")
                raise Diverged(
                    f"the model sends {self.describe_request(req)}, which the "
                    "implementation never sent"
                )
            _, sent, answer = exchanges[i]
            if canon(self.on_the_wire(req)) != canon(self.on_the_wire(sent)):
                if follow:
                    return self.unanswered("diverged")
                raise Diverged(
                    f"the implementation sent {self.describe_request(sent)} "
                    f"({short(sent)}), the model sends {self.describe_request(req)} "
                    f"({short(req)})"
                )
            if self.lost(answer):
                if follow or not self.may_change(req):
                    return answer
                if landed.get(i):
                    if not self.landing_changes(self.deliver_to_model(trial.model, req)):
                        raise Redundant()
                    trial.landed += 1
                else:
                    trial.not_landed += 1
                fate = "landed" if landed.get(i) else "left nothing stored"
                trial.fates.append(f"{self.describe_request(req)} {fate}")
                return answer
            expected = self.deliver_to_model(trial.model, req)
            if not follow and canon(expected) != canon(answer):
                raise Diverged(
                    f"{self.describe_request(req)}: the server answered "
                    f"{self.describe(answer)} ({short(answer)}), the model's server "
                    f"answers {self.describe(expected)} ({short(expected)})"
                )
            return answer

        got = outcome(lambda: script(self.model_side(trial.model, deliver)), self.domain_errors)
        if pos < len(exchanges) and not follow:
            raise Diverged(
                f"the implementation sent "
                f"{self.describe_request(exchanges[pos].request)}, which the model "
                "never sends"
            )
        return got

    @invariant()
    @timings.timed("check")
    def model_agrees(self) -> None:
        """The real world equals one possible model world, and the judge finds nothing on the
        real world. The judge runs before a disagreement is reported, so a failure names the
        invariant it broke."""
        if not getattr(self, "worlds", None):
            return
        self.clock_runs()
        real = self.observe_impl()
        matching = [w for w in self.worlds if self.observe_model(w.model) == real]
        exchanges, self.step_exchanges = self.step_exchanges, []
        if self.divergence is not None or not matching:
            w = self.worlds[0]
            why = self.divergence or (
                "the implementation disagrees with the model after this step:\n"
                + self.difference(self.observe_model(w.model), real)
                + (
                    ""
                    if len(self.worlds) == 1
                    else f"\n  (none of the {len(self.worlds)} possible worlds matched)"
                )
            )
            violations = self.judge(real, w.model, exchanges)
            if not violations and self.before_step is not self.worlds:
                # what the model can no longer follow, judged against the last world both agreed
                # on (its ledger knows which edits nothing had covered yet)
                violations = self.judge(real, self.before_step[0].model, exchanges)
            self.fail(why, violations)
        chosen = matching[0]
        if len(self.worlds) > 1 and all(w.fates == chosen.fates for w in matching):
            self.log(f"  (observed: {'; '.join(chosen.fates)})")
        chosen.fates = []
        self.worlds = [chosen]
        self.model, self.candidates = chosen.model, [chosen]
        self.counted(chosen)
        violations = self.judge(real, chosen.model, exchanges)
        if violations:
            self.fail("", violations)
        self.clock_stands()
