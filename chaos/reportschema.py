"""The report's vocabulary: the JSON Schema and its version, the statuses a run ends with, and
the exit code of each outcome (:mod:`.report` builds the document; :mod:`.reporttext` and
:mod:`.junit` render it)."""

from __future__ import annotations

from importlib import metadata, resources

SCHEMA_VERSION = 1
STATUSES = (
    "passed",
    "failed",
    "vacuous",
    "interrupted",
    "environment",
    "not run",
    "not covered",
    "not applicable",
)
OUTCOMES = ("passed", "failed", "vacuous", "interrupted", "environment")
EXIT_CODES = {"passed": 0, "failed": 1, "vacuous": 1, "environment": 3}
SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def schema() -> dict:
    """The JSON Schema of the report (shipped as package data)."""
    import json

    return json.loads(resources.files(__package__).joinpath("report.schema.json").read_text())


def knownstate_version() -> str:
    try:
        return metadata.version("knownstate")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"
