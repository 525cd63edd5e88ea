"""Deterministic statement-level interleaving of concurrent operations on real PostgreSQL.

The theory of operation is in :mod:`.scheduler`, with the algorithm: the scheduler and its
blocks. Beside it, :mod:`.connection` (the intercepted connection, the gate of every round trip),
:mod:`.server` (lock waits read from the server, the session settings a block needs, the
environment's errors) and :mod:`.history` (what a block did, as a history for the
linearizability checker). Everything a caller uses is importable from here.
"""

from .connection import (
    AsyncScheduledConnection,
    Gated,
    ScheduledCalls,
    ScheduledConnection,
    round_trip_label,
    run_on,
    shutdown_socket,
    statement_label,
)
from .history import BlockResult, Op, OpResult, Raised, history
from .scheduler import DEADLINE_SECONDS, MAX_STEPS, Block, BlockAborted, Runaway, Scheduler
from .server import (
    SESSION_SETTINGS,
    ClockAhead,
    SchedulerEnvironmentError,
    SettingsRefused,
    WorkerStuck,
)

__all__ = [
    "AsyncScheduledConnection",
    "Gated",
    "DEADLINE_SECONDS",
    "MAX_STEPS",
    "SESSION_SETTINGS",
    "Block",
    "BlockAborted",
    "BlockResult",
    "ClockAhead",
    "Op",
    "OpResult",
    "Raised",
    "round_trip_label",
    "run_on",
    "Runaway",
    "ScheduledCalls",
    "ScheduledConnection",
    "Scheduler",
    "SchedulerEnvironmentError",
    "SettingsRefused",
    "WorkerStuck",
    "history",
    "shutdown_socket",
    "statement_label",
]
