"""The report as JUnit XML, rendered from the document of :mod:`.report`: one test case per
run, named the same on every run (CI tools track a test's history by its name)."""

from __future__ import annotations

import re
from xml.etree import ElementTree as ET

from .reporttext import _why_not_caught, not_applicable, run_lines

_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(text: str) -> str:
    return _NOT_XML.sub("?", text)


def case_name(r: dict, doc: dict) -> str:
    """A test case's name, the same on every run (a random seed is not in it): CI tools track
    a test's history by its name."""
    name = (
        r["mutant"]["name"]
        if r["mutant"]
        else (r["kind"] if doc["command"] == "verify" else "reference")
    )
    seeds = doc["seeds"]
    return name + (
        f" (seed {seeds.index(r['seed']) + 1} of {len(seeds)})"
        if len(seeds) > 1 and r["seed"] in seeds
        else ""
    )


def junit(doc: dict) -> str:
    runs = doc["runs"]
    suite = ET.Element(
        "testsuite",
        name=f"knownstate {doc['command']}",
        tests=str(len(runs)),
        time=f"{doc['seconds']:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for key in ("version", "knownstate", "profile", "seed", "outcome", "exit_code", "message"):
        if doc[key] is not None:
            ET.SubElement(props, "property", name=key, value=_x(str(doc[key])))
    tallies = {"failures": 0, "errors": 0, "skipped": 0}
    for r in runs:
        classname = f"knownstate.{doc['command']}" + (
            f".{r['kind']}" if doc["command"] == "mutants" else ""
        )
        case = ET.SubElement(
            suite,
            "testcase",
            classname=classname,
            name=case_name(r, doc),
            time=f"{r['seconds']:.3f}",
        )
        tag, kind, message, text = _junit_outcome(r, doc)
        if tag:
            tallies[{"failure": "failures", "error": "errors", "skipped": "skipped"}[tag]] += 1
            el = ET.SubElement(case, tag, message=_x(message), type=kind)
            if text:
                el.text = _x(text)
        if r["status"] != "not run":
            ET.SubElement(case, "system-out").text = _x("\n".join(run_lines(r)))
    for k, v in tallies.items():
        suite.set(k, str(v))
    root = ET.Element(
        "testsuites",
        name="knownstate",
        tests=str(len(runs)),
        time=f"{doc['seconds']:.3f}",
        **{k: str(v) for k, v in tallies.items()},
    )
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"


def _junit_outcome(r: dict, doc: dict) -> tuple[str | None, str, str, str]:
    status = r["status"]
    if status == "not run":
        why = {
            "interrupted": "the command was interrupted before it began",
            "environment": "a real part died before it began",
        }.get(doc["outcome"], "")
        return "skipped", "not-run", "not run" + (f": {why}" if why else ""), ""
    if status in ("interrupted", "environment"):
        message = (
            f"interrupted ({doc['signal'] or 'SIGINT'})"
            if status == "interrupted"
            else f"environment: {doc['message'] or 'a real part died'}"
        )
        return "error", status, f"{message} after {r['examples']} examples", ""
    if status == "not covered":  # this database cannot reach it: neither caught nor missed
        needs = ", ".join(r.get("not_covered") or [])
        return "skipped", "not-covered", f"not covered on this database: needs {needs}", ""
    if status == "not applicable":
        return "failure", "not-applicable", not_applicable(r), ""
    if r["mutant"] is not None:
        if r["caught"]:
            return None, "", "", ""
        return "failure", "not-caught", f"NOT CAUGHT: {_why_not_caught(r)}", ""
    if status == "failed":
        text = "\n".join(
            [r["failure"], "counterexample:", *r["counterexample"], f"replay: {r['replay']}"]
        )
        return "failure", "counterexample", r["failure"].splitlines()[0], text
    if status == "vacuous":
        return "failure", "vacuous", "vacuous: never observed " + "; ".join(r["vacuous"]), ""
    return None, "", "", ""
