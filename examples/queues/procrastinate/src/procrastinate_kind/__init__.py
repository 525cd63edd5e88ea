"""procrastinate 3.10.0 under knownstate's gate: :mod:`procrastinate_kind.binding` is its
description and adapter (``knownstate verify procrastinate``); ``ProcrastinateOwnersOnly`` in
the same module is the control in which a worker never writes for a job it no longer owns."""
