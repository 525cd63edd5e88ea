"""A check built from a description and an adapter (``knownstate.chaos.generic``), on the real
parts.

The reference outbox, bound through its adapter (the one the outbox's own check runs on),
passes the gate — reaching the fence's own case (a stale owner writing on a run claimed again)
and SKIP LOCKED — and the mutants derived from its SQL guards are each caught, naming the
invariant the guard stands for. A mutant of the SQL a library sends whose edit changed nothing
is reported not applicable, never NOT CAUGHT. An adapter's own bugs are reported as the
adapter's; a description and an adapter that cannot make a check are refused with what to do;
a driver that brings its own connection is checked too, every lost connection kept as
indeterminate.
"""

from __future__ import annotations

from dataclasses import replace
from xml.etree import ElementTree as ET

import psycopg
import pytest
from gate_fakes import validate

from knownstate.chaos.adapter import Adapter
from knownstate.chaos.adaptercall import EDITED
from knownstate.chaos.check import PROFILES, Profile, run_check
from knownstate.chaos.generic import KindError, kind
from knownstate.chaos.genericbuild import WIRE_GUARDS, wire_mutant
from knownstate.chaos.report import (
    Replay,
    Report,
    Unit,
    finished_record,
    junit,
    run_lines,
    status_word,
    verdict_line,
)
from knownstate.chaos.kinds.outbox import OutboxAdapter
from knownstate.impl import outbox as impl
from knownstate.model.describe import Retry
from knownstate.model.outbox import DESCRIPTION as OUTBOX

pytestmark = pytest.mark.slow


DESCRIBED = OUTBOX.model_copy(
    update={
        "name": "outbox-described",
        "external_key": True,
        "retry": Retry(max_attempts=2, base="1m", cap="1h"),
    }
)
OutboxKind = kind(DESCRIBED, OutboxAdapter)


def profile(**kw) -> Profile:
    """The CI profile, quick: one example at least, each requirement seen once."""
    quick = dict(name="test", min_examples=1, max_examples=400, steps=40, times_each=1)
    return replace(PROFILES["ci"], **{**quick, "too_slow_s": 1e9, **kw})


def test_the_reference_outbox_bound_through_its_description_passes(knownstate_env):
    r = run_check(OutboxKind, knownstate_env, seed=3, profile=profile())
    assert r.passed, r.failure or r.vacuous
    assert r.coverage["stale complete on a re-claimed run"] >= 1 and r.coverage["skip locked"] >= 1
    assert r.coverage["transition processing -reclaim_dead-> dead"] >= 1
    # every operation raced: the call to the external side, a step of a block's schedule, too;
    # and a holder's write against the reaper on its run
    assert r.coverage["in a block: send"] >= 1
    assert r.coverage["raced on one row: reclaim_stale × record"] >= 1


@pytest.mark.parametrize(
    "name",
    [
        "no-fence-in-complete",
        "no-skip-locked-in-claim-due",
        "no-lease-in-reclaim-stale",
        "stale-write-takes-current-token",
    ],
)
def test_the_mutants_derived_from_the_adapters_guards_are_caught(knownstate_env, name):
    mutant = {m.name: m for m in OutboxKind.mutants}[name]
    # caught is what this proves, naming the invariant (the only one each names, as after 100
    # replays): a short counterexample is the gate's mutant tests' (test_check_*.py)
    r = run_check(mutant.machine(OutboxKind), knownstate_env, seed=3, require_all=False, shrinks=20)
    assert r.failure is not None and mutant.invariant in r.invariants, r.failure


def test_a_wire_mutant_whose_edit_changed_nothing_is_not_applicable_not_missed(knownstate_env):
    """Mutants of the SQL a library sends (its claim's, as derived for a library that names
    none): one whose pattern matches nothing the claim sends nor the schema (NOWAIT: the outbox
    claims with SKIP LOCKED) ran as the reference, and every report says NOT APPLICABLE naming
    the pattern (exit 1); one whose edit changed the claim's statements, counted, is judged as
    any mutant is, CAUGHT or NOT CAUGHT. Three examples each, no shrinking: only the counts
    and the verdicts' words are asserted."""
    nowait = (r"\s+NOWAIT\b", "")
    mutants = [
        wire_mutant(DESCRIBED, OutboxAdapter, "claim-without-nowait", nowait, "NOWAIT out"),
        wire_mutant(DESCRIBED, OutboxAdapter, *WIRE_GUARDS[0]),  # claim-waits-on-locks
    ]
    units = [Unit(i, OutboxKind.kind, 1, m) for i, m in enumerate(mutants)]
    report = Report("mutants", ["knownstate", "mutants"], "ci", [1], units, len(units))
    few = replace(PROFILES["ci"], min_examples=1, max_examples=3)  # named ci, as reports know
    for unit in units:
        machine = unit.mutant.machine(OutboxKind)
        r = run_check(machine, knownstate_env, seed=1, profile=few, require_all=False, shrinks=0)
        report.finish(unit, finished_record(unit, r, Replay()))
    doc = report.document()
    validate(doc)
    idle, judged = doc["runs"]

    why = (
        r"its edit (pattern '\s+NOWAIT\b') matched no statement the library sent for claim and "
        "nothing in its schema"
    )
    assert (idle["status"], idle["caught"], idle["ok"]) == ("not applicable", None, False)
    assert idle["not_applicable"] == why and EDITED not in idle["events"]
    assert run_lines(idle)[0].startswith("outbox-described mutant claim-without-nowait: NOT APP")
    assert f"  NOT APPLICABLE: {why}: the mutant ran as the reference did, neither caught nor " in (
        "\n".join(run_lines(idle))
    )
    assert (doc["outcome"], doc["exit_code"], doc["counts"]["not applicable"]) == ("failed", 1, 1)
    assert "; NOT APPLICABLE: claim-without-nowait" in verdict_line(doc)
    case = ET.fromstring(junit(doc)).find(".//testcase[@name='claim-without-nowait']")
    failure = case.find("failure")
    assert failure.get("type") == "not-applicable" and why in failure.get("message")

    assert judged["status"] in ("passed", "failed") and "not_applicable" not in judged
    assert status_word(judged) in ("CAUGHT", "NOT CAUGHT") and judged["caught"] is not None
    assert judged["events"][EDITED] >= 1  # the claim's statements, SKIP LOCKED taken out


class _Broken(OutboxAdapter):
    def complete(self, conn, job):
        raise KeyError("payload")


class _Unfinished(OutboxAdapter):
    def complete(self, conn, job):
        conn.execute(
            "UPDATE outbox_delivery SET status = 'sent', lease_until = NULL "
            "WHERE id = %s AND attempts = %s",
            (job.handle.id, job.attempt),
        )
        return True  # and no COMMIT


@pytest.mark.parametrize(
    "adapter, says",
    [
        (_Broken, "complete: the adapter raised KeyError"),
        (_Unfinished, "the adapter returned with its transaction still open"),
    ],
)
def test_an_adapters_own_bug_is_reported_as_the_adapters(knownstate_env, adapter, says):
    r = run_check(
        kind(DESCRIBED, adapter), knownstate_env, seed=1, examples=10, require_all=False, shrinks=30
    )
    assert r.failure is not None and says in r.failure, r.failure


class _RefusedSchema(OutboxAdapter):
    schema = impl.SCHEMA.rstrip() + "\nCREATE TABLE extra (v txt);\n"


def test_a_schema_the_server_refuses_is_the_kinds_failure_naming_its_line(knownstate_env):
    r = run_check(
        kind(DESCRIBED, _RefusedSchema), knownstate_env, seed=1, examples=10, require_all=False
    )
    line = _RefusedSchema.schema.splitlines().index("CREATE TABLE extra (v txt);") + 1
    assert r.failure is not None and r.examples == 0, r.failure
    assert f'refused the kind\'s schema SQL at line {line}: 42704 type "txt"' in r.failure


class _Partial(Adapter):
    schema = "CREATE TABLE t (k text)"
    queries = {"claim": "SELECT 1"}
    guards = {"fence": "AND attempts = %(attempt)s"}

    def enqueue(self, conn, key):
        pass

    async def claim(self, conn, batch):
        return []


def test_a_description_and_an_adapter_that_cannot_make_a_check_are_refused_with_hints():
    with pytest.raises(KindError) as e:
        kind(DESCRIBED, _Partial)
    text = str(e.value)
    for hint in (
        "_Partial has no complete(conn, job)",
        "has no reclaim_stale(conn)",
        "has no send(job, url)",
        "neither read_query nor read(conn)",
        "guards['fence'] = 'AND attempts = %(attempt)s' appears in none of its queries",
        "make every operation async, or none",
    ):
        assert hint in text, hint


class OwnDriver(OutboxAdapter):
    """The outbox through connections the adapter opens itself (a driver of its own): the
    gate cannot see its COMMIT, so every connection it loses is indeterminate."""

    def connect(self, dsn):
        return psycopg.connect(dsn, connect_timeout=3)

    def close(self, conn):
        conn.close()


def test_a_driver_that_brings_its_own_connection_is_checked(knownstate_env):
    own = kind(DESCRIBED.model_copy(update={"name": "outbox-own-driver"}), OwnDriver)
    assert own.policy.commit_faults == () and "indeterminate commit" not in own.required_events
    r = run_check(own, knownstate_env, seed=2, profile=profile(max_examples=400))
    assert r.passed, r.failure or r.vacuous
    unfenced = {m.name: m for m in own.mutants}["no-fence-in-complete"]
    caught = run_check(
        unfenced.machine(own), knownstate_env, seed=2, examples=300, require_all=False, shrinks=60
    )
    assert "lease-fence" in caught.invariants, caught.failure
