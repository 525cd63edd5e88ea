"""The report as text: what a run prints, and the summaries printed at the end (stability
across seeds, the mutant catalogue, the verdict). Rendered from the document of
:mod:`.report`, like the JSON and JUnit reports."""

from __future__ import annotations

from typing import Iterable

from . import timings
from .reportschema import STATUSES


def status_word(r: dict) -> str:
    if r["mutant"] is not None and r["status"] in ("passed", "failed"):
        return "CAUGHT" if r["caught"] else "NOT CAUGHT"
    return {
        "passed": "passed",
        "not run": "not run",
        "not covered": "not covered on this database",
    }.get(r["status"], r["status"].upper())


def run_lines(r: dict) -> list[str]:
    """A run's summary, as printed at its end and kept in the JUnit test case."""
    rate = r["steps"] / r["seconds"] if r["seconds"] else 0.0
    head = r["kind"] + (f" mutant {r['mutant']['name']}" if r["mutant"] else "")
    out = [
        f"{head}: {status_word(r)} — {r['examples']} examples, {r['steps']} steps "
        f"({rate:.0f} steps/s), {r['seconds']:.1f} s, seed {r['seed']}"
    ]
    if r["stored_examples"]:
        out.append(
            f"  replayed first: {r['stored_examples']} stored failing example(s) from "
            "the example database"
        )
    out.append(f"  faults injected: {_counts(r['faults'])}")
    out += [f"  fault unavailable: {u}" for u in r["unavailable"]]
    out.append(f"  events observed: {_counts(r['events'])}")
    seen = sum(1 for n in r["transitions"].values() if n)
    out.append(f"  transitions observed: {seen} distinct, {sum(r['transitions'].values())} taken")
    out.append(f"  invariants checked: {r['invariants_checked']}")
    if r["stopped"]:
        out.append(f"  stopped: {r['stopped']}")
    out += [f"  not covered on this database: {n}" for n in r["not_covered"]]
    if r.get("timings"):
        out += timings.table(r["timings"])
    if r["mutant"] is not None and r["status"] in ("passed", "failed"):
        out.append(
            f"  {status_word(r)}: "
            + (
                f"the failure names {r['mutant']['invariant']}, the invariant the mutant breaks"
                if r["caught"]
                else _why_not_caught(r)
            )
        )
    if r["status"] == "not applicable":
        out.append(f"  {not_applicable(r)}")
    if r["failure"]:
        out.append(f"  failure: {r['failure']}")
        if r["counterexample"]:  # none when the check could not start (a refused schema)
            out.append(
                f"  counterexample ({r['counterexample_steps']} steps, one operation or "
                "fault per line):"
            )
            out += [f"    {line}" for line in r["counterexample"]]
        if r.get("shrinking"):
            k = r["shrinking"]
            out.append(
                f"  found after {k['first_failure_seconds']:.1f} s; shrunk in {k['seconds']:.1f} s "
                f"and {k['replays']} replays "
                f"(from {k['steps_before']} rule steps to {k['steps_after']})"
            )
        out += _others(r)
        out.append(f"  replay: {r['replay']}")
    elif r["vacuous"]:
        out.append("  vacuous: the run never observed " + "; ".join(r["vacuous"]))
        out.append(
            "  (a gate that never reached these proves nothing about them: raise "
            "--examples/--steps, or try another seed)"
        )
    return out


def not_applicable(r: dict) -> str:
    """Why a mutant's run said nothing of the gate, as one line: the mutant ran as the
    reference (its edit found nothing to change), so it was neither caught nor missed."""
    return (
        f"NOT APPLICABLE: {r['not_applicable']}: the mutant ran as the reference did, "
        "neither caught nor missed"
    )


def _others(r: dict) -> list[str]:
    """The shortest failure seen per invariant, when the run met more than the one it shrank:
    each other invariant's failing example as it was seen (not shrunk), in full."""
    seen = r.get("shortest") or {}
    if not set(seen) - set(r["invariants"]):
        return []
    out = [
        "  shortest failure seen per invariant: "
        + ", ".join(f"{name} {s['steps']} steps" for name, s in seen.items())
    ]
    examples: dict[tuple, list[str]] = {}  # one example may be the shortest of several
    for name, s in seen.items():
        if name not in r["invariants"]:
            examples.setdefault((s["failure"], tuple(s["counterexample"])), []).append(name)
    for (failure, trace), names in examples.items():
        steps = seen[names[0]]["steps"]
        out.append(f"  {', '.join(names)} ({steps} steps, seen, not shrunk): {failure}")
        out += [f"    {line}" for line in trace]
    return out


def _seeds(runs: Iterable[dict]) -> str:
    return ", ".join(str(r["seed"]) for r in runs)


def stability_lines(doc: dict) -> list[str]:
    """Per kind, over the seeds: passes, vacuous, failed, and the seeds of each."""
    runs = [r for r in doc["runs"] if r["mutant"] is None]
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    out = [
        f"over {len(doc['seeds'])} seeds ({_seeds_list(doc['seeds'])}):",
        f"  {'kind':<18} {'passed':>6} {'vacuous':>8} {'failed':>7} {'unfinished':>11}",
    ]
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        by = {s: [r for r in mine if r["status"] == s] for s in STATUSES}
        unfinished = by["interrupted"] + by["environment"] + by["not run"]
        line = (
            f"  {kind:<18} {len(by['passed']):>6} {len(by['vacuous']):>8} "
            f"{len(by['failed']):>7} {len(unfinished):>11}"
        )
        notes = [f"{s} at seed {_seeds(by[s])}" for s in ("vacuous", "failed") if by[s]]
        out.append(line + ("   " + "; ".join(notes) if notes else ""))
    return out


def _seeds_list(seeds: list[int]) -> str:
    return (
        ", ".join(map(str, seeds))
        if len(seeds) <= 6
        else f"{seeds[0]}, {seeds[1]}, ..., {seeds[-1]}"
    )


def mutant_lines(doc: dict) -> list[str]:
    """Per mutant: on how many seeds it was caught, seconds, counterexample steps."""
    finished = ("passed", "failed", "vacuous")
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in doc["runs"]:
        groups.setdefault((r["kind"], r["mutant"]["name"] if r["mutant"] else ""), []).append(r)
    # the columns as wide as their longest entry (a long mutant name pushes the table right
    # rather than into the next column)
    k = max([16, *(len(kind) for kind, _ in groups)])
    m = max([28, *(len(name) for _, name in groups)])
    out = [
        f"  {'kind':<{k}} {'mutant':<{m}} {'invariant broken':<30} {'caught':>14} "
        f"{'seconds':>8} {'steps':>6}"
    ]
    for (kind, name), runs in groups.items():
        done = [r for r in runs if r["status"] in finished]
        if not name:
            bad = [r for r in done if not r["ok"]]
            if bad or doc["command"] == "mutants":
                word = f"FAILS at seed {_seeds(bad)}" if bad else f"passes {len(done)}/{len(runs)}"
                out.append(f"  {kind:<{k}} {'(reference)':<{m}} {'':<30} {word:>14}")
            continue
        if all(r["status"] == "not covered" for r in runs):
            out.append(
                f"  {kind:<{k}} {name:<{m}} {runs[0]['mutant']['invariant']:<30} "
                f"{'not covered':>14}   needs {', '.join(runs[0]['not_covered'])}"
            )
            continue
        caught = [r for r in done if r["caught"]]
        missed = [r for r in done if not r["caught"]]
        idle = [r for r in runs if r["status"] == "not applicable"]
        tally = f"{len(caught)}/{len(runs)}"
        if missed:
            word = f"NOT CAUGHT {tally}"
        elif idle:
            word = "NOT APPLICABLE"
        else:
            word = tally if len(done) == len(runs) else f"{tally} (unfinished)"
        timed = done + idle  # a mutant not applicable ran as long as the reference did
        secs = sum(r["seconds"] for r in timed) / len(timed) if timed else 0.0
        steps = max((r["counterexample_steps"] for r in caught), default=None)
        line = (
            f"  {kind:<{k}} {name:<{m}} {runs[0]['mutant']['invariant']:<30} {word:>14} "
            f"{secs:>8.1f} {steps if steps is not None else '-':>6}"
        )
        notes = [f"missed at seed {_seeds(missed)}"] if missed else []
        if idle:
            notes.append(f"not applicable at seed {_seeds(idle)}: {idle[0]['not_applicable']}")
        out.append(line + "".join(f"   {note}" for note in notes))
    return out


def verdict_line(doc: dict) -> str:
    runs, c = doc["runs"], doc["counts"]
    mutants = [r for r in runs if r["mutant"] is not None]
    outcome = doc["outcome"]
    seeds = (
        f"seed {doc['seed']}" if len(doc["seeds"]) == 1 else f"seeds {_seeds_list(doc['seeds'])}"
    )
    tail = f", {doc['seconds']:.1f} s, {seeds}"
    if outcome in ("interrupted", "environment"):
        done = c["runs"] - c["not run"] - c["interrupted"] - c["environment"]
        word = "INTERRUPTED" if outcome == "interrupted" else "STOPPED (environment)"
        return f"knownstate {doc['command']}: {word} — {done} of {c['runs']} runs finished{tail}"
    if doc["command"] == "verify" and mutants and len(mutants) == len(runs):
        caught = sum(1 for r in mutants if r["caught"])
        idle = sum(1 for r in mutants if r["status"] == "not applicable")
        missed = any(r["caught"] is False for r in mutants)
        word = (
            "CAUGHT"
            if caught == len(mutants)
            else ("NOT APPLICABLE" if idle and not missed else "NOT CAUGHT")
        )
        return (
            f"knownstate verify: {word} — mutant {mutants[0]['mutant']['name']} of "
            f"{mutants[0]['kind']} caught at {caught} of {len(mutants)} seeds"
            + (f", not applicable at {idle}" if idle else "")
            + tail
        )
    if doc["command"] == "mutants":
        names = list(dict.fromkeys((r["kind"], r["mutant"]["name"]) for r in mutants))
        idle = _names(r for r in mutants if r["status"] == "not applicable")
        missed = _names(r for r in mutants if not r["ok"] and r["status"] != "not applicable")
        ref_bad = [r for r in runs if r["mutant"] is None and not r["ok"]]
        word = "PASSED" if outcome == "passed" else "FAILED"
        bad = set(missed) | set(idle)
        text = (
            f"knownstate mutants: {word} — {len(names) - len(bad)}/{len(names)} mutants "
            f"caught at every seed"
        )
        text += f"; NOT CAUGHT: {', '.join(missed)}" if missed else ""
        text += f"; NOT APPLICABLE: {', '.join(idle)}" if idle else ""
        text += (
            f"; the reference FAILS ({', '.join(r['kind'] for r in ref_bad)})" if ref_bad else ""
        )
        return text + tail
    word = {"passed": "PASSED", "failed": "FAILED", "vacuous": "VACUOUS"}[outcome]
    return f"knownstate verify: {word} — {c['ok']}/{c['runs']} runs passed{tail}"


def _names(runs: Iterable[dict]) -> list[str]:
    """The mutants of ``runs``, each named once, in order."""
    return list(dict.fromkeys(r["mutant"]["name"] for r in runs))


def _counts(counter: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


def _why_not_caught(r: dict) -> str:
    declared = r["mutant"]["invariant"]
    if r["failure"] is None:
        n = r["examples"]
        return f"it survived {n} example{'s' if n != 1 else ''} (it breaks {declared})"
    named = ", ".join(r["invariants"]) or "no invariant"
    return f"the failure names {named}, not {declared}, the invariant the mutant breaks"
