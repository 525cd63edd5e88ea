"""What the harness raises, apart from what it reports: the environment failing (exit 3, never a
counterexample), a worker's injected death, and a schema the server refused. Importable from
:mod:`.harness`, which every part of a run uses."""

from __future__ import annotations

from typing import Any

from knownstate.impl.errors import KnownstateError


class EnvironmentFault(BaseException):
    """The environment broke, not the code under test: a real part died or misbehaved.
    A BaseException, so Hypothesis neither shrinks it nor mistakes it for a counterexample.
    ``partial``: what the interrupted kind's check had done so far (a ``CheckResult``, set by
    ``run_check``), for the reports."""

    partial: Any = None


class WorkerDied(KnownstateError):
    """The worker process died (injected): its connection closed without COMMIT."""


class SchemaRefused(Exception):
    """The server refused the kind's schema SQL: the implementation's failure (its schema), not
    the environment's, reported with the error and the line of the schema it is on."""
