"""The time shift: leases that lapse on a database whose clock the harness does not own.

On its throwaway cluster the harness moves the server's ``now()`` (libfaketime,
:class:`~.cluster.DbClock`). On a database someone else runs it cannot, and it must not. Yet a
lease, a heartbeat or a backoff is a comparison of a stored timestamp with ``now()``
(``lease_until <= now()``, ``heartbeat_at < now() - interval``), and moving ``now()`` forward by
``s`` seconds or moving every stored timestamp back by ``s`` seconds gives each such comparison
the same answer. So :meth:`TimeShift.jump` rewrites every timestamp column of the workspace's
tables, ``col = col - s``, in one transaction; the model's clock moves forward by ``s``; and the
check reads stored timestamps back in model time adding :attr:`TimeShift.shifted`
(``KindCheck.to_model_time``), so a row keeps its model time and a new stamp lands ``s`` later.

Sound for every guard that compares timestamps the database stamped, with ``now()`` or with
each other: the difference between two stored values is kept, and each stored value's distance
to ``now()`` moves by exactly ``s``.

What it cannot reach
    - A disagreement between the application's clock and the database's. Both still read real
      time, so a lease stamped or judged with the application's clock behaves as if it were
      right: the app-clock mutants need ``db-clock``.
    - A jump that must change nothing: a kind whose leases are in application time (branch
      reset) checks that a database clock jump moves nothing, but a shift would move its
      application-time stamps. Such jumps need ``db-clock``.
    - Timestamps outside the workspace's timestamp columns: in a worker's memory, in a stand-in,
      inside a JSON or text column, a ``date`` column. And the clock moving while a transaction
      is open (jumps happen between steps, as with libfaketime here).
    - A crash of the server (``db-crash``): nothing here can do that.
    - A clock that stands still between steps (:class:`~.cluster.DbClock`): here ``now()`` runs
      on in real time, so an example must last less than the clock tolerance
      (``Engine.to_model_time``); on a slow or loaded machine a long one is the environment's
      failure (exit 3), never a verdict.

What it costs
    One transaction per jump, one UPDATE per table with timestamp columns (the workspace holds a
    handful of rows during an example), a new version of each row. Tables with user triggers
    have them disabled inside that transaction (``ALTER TABLE``), so a trigger that stamps or
    counts writes sees nothing. A schema whose constraints read ``now()``, or a unique index on
    a timestamp that a uniform shift collides with row by row, would refuse the shift: the
    error says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .harness import Env


class TimeShift:
    """The clock of a run on a database the harness does not own: ``jump(seconds)`` moves the
    timestamps of the active workspace back (the model's time forward), ``reset()`` moves them
    back where they were, ``shifted`` is how far they moved. The same interface as
    :class:`~.cluster.DbClock`."""

    label = "time shift"
    held_total = 0.0  # it never holds (see hold)
    app_offset = 0.0  # no base to match: now() is the server's real time

    def __init__(self, env: "Env"):
        self.env = env

    @property
    def shifted(self) -> int:
        """Seconds the active workspace's stored timestamps were moved back since its reset."""
        ws = self.env.active
        return ws.shifted if ws is not None else 0

    def jump(self, seconds: int) -> None:
        ws = self.env.active
        if ws is None:
            raise RuntimeError("a time shift needs a workspace: Env.workspace() creates one")
        ws.shift(seconds)

    def hold(self) -> None:
        """Nothing: the server's clock cannot stand still between steps here, so an example's
        real length counts against the clock tolerance (``Engine.to_model_time``)."""

    def release(self) -> None:
        """Nothing (see :meth:`hold`)."""

    def reset(self, to: float = 0.0) -> None:
        """The stored timestamps back where they were. ``to`` (where a libfaketime clock starts
        each example, relative to real time) means nothing here: ``now()`` stays the server's,
        and model time counts from the example's first ``now()``."""
        ws = self.env.active
        if ws is not None and ws.shifted:
            ws.shift(-ws.shifted)
