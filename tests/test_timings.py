"""``--timings``: where a run's time goes, per category of work (``chaos/timings.py``).

- The collector: spans are exclusive (a span inside another counts once, in its own category),
  only the collecting thread records, and ``hypothesis`` is the run's time no span covered.
- A real run of the outbox's check with ``timings=True`` (a few examples on the session's real
  parts): every category is reported, the categories sum to the run's seconds, the spans that
  every run must cross (the implementation, the checks, the reset between examples, Toxiproxy,
  a new connection) were counted, the record follows the report's schema and the summary prints
  the table. Without it nothing is collected and the record has no ``timings``.

No speed is asserted: timings are reported, never judged.
"""

from __future__ import annotations

import threading
import time

import pytest
from gate_fakes import validate

from knownstate.chaos import timings
from knownstate.chaos.check import Env, run_check
from knownstate.chaos.cli import build_parser
from knownstate.chaos.kinds.outbox import OutboxCheck
from knownstate.chaos.toxi import ToxiproxyServer
from knownstate.chaos.report import Replay, Report, Unit, finished_record, run_lines, schema


def _busy(seconds: float) -> None:
    """Spend ``seconds`` on this thread (a measured cost, not a wait for a state)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_spans_are_exclusive_and_only_the_collecting_thread_records():
    with timings.collecting() as t:
        start = time.perf_counter()
        with timings.span("impl"):
            _busy(0.02)
            with timings.span("connect"):
                _busy(0.03)
        other = threading.Thread(target=lambda: timings.span("crash").__enter__())
        other.start()
        other.join()
        total = time.perf_counter() - start
    with timings.span("impl"):  # no collector: nothing recorded anywhere
        pass
    report = t.as_dict(total, steps=10)
    cats = report["categories"]
    assert 0.02 <= cats["impl"]["seconds"] < 0.03 + 0.02  # the connect inside is not its
    assert 0.03 <= cats["connect"]["seconds"] < 0.03 + 0.02
    assert cats["impl"]["calls"] == cats["connect"]["calls"] == 1
    assert cats["crash"]["calls"] == 0  # another thread's span
    assert abs(sum(c["seconds"] for c in cats.values()) - total) < 0.005
    assert report["steps_per_s"] == round(10 / total, 1)


def test_the_schema_names_every_category():
    run = schema()["$defs"]["run"]["properties"]["timings"]
    assert run["properties"]["categories"]["required"] == list(timings.CATEGORIES)


@pytest.fixture
def env(knownstate_cluster):
    """An Env of its own on the session's PostgreSQL (no connection kept from another test)
    with a Toxiproxy server of its own (no proxy of another Env's)."""
    with ToxiproxyServer() as toxiproxy:
        env = Env(knownstate_cluster, toxiproxy)
        yield env
        env.close()


def test_a_run_with_timings_reports_every_category_summing_to_its_time(env):
    assert build_parser().parse_args(["verify", "outbox", "--timings"]).timings
    r = run_check(OutboxCheck, env, seed=5, examples=3, steps=12, require_all=False, timings=True)
    assert r.failure is None, r.failure
    t = r.timings
    assert list(t["categories"]) == list(timings.CATEGORIES)
    total = sum(c["seconds"] for c in t["categories"].values())
    assert abs(total - r.seconds) <= 0.01 + 0.01 * r.seconds, (total, r.seconds)
    assert abs(sum(c["share"] for c in t["categories"].values()) - 1) < 0.01
    for category in ("impl", "check", "reset", "toxiproxy", "connect"):
        assert t["categories"][category]["calls"] > 0, category
        assert t["categories"][category]["seconds"] > 0, category
    assert t["steps_per_s"] > 0 and r.steps > 0
    # every concurrent block is one span of its own, not a part of "the rest"
    blocks = r.stats.events["concurrent block"]
    assert blocks > 0 and t["categories"]["block"]["calls"] == blocks

    unit = Unit(0, "outbox", 5, None)
    rec = finished_record(unit, r, Replay())
    report = Report("verify", ["verify", "outbox", "--timings"], "ci", [5], [unit], 1)
    report.finish(unit, rec)
    validate(report.document())
    printed = "\n".join(run_lines(rec))
    assert "timings:" in printed and "steps/s" in printed
    for label in timings.CATEGORIES.values():
        assert label in printed

    plain = run_check(OutboxCheck, env, seed=5, examples=1, steps=5, require_all=False)
    assert plain.timings is None and "timings" not in finished_record(unit, plain, Replay())
