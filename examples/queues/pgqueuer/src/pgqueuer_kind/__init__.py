"""pgqueuer 1.6.0 under knownstate's gate: :mod:`pgqueuer_kind.binding` is its description
and adapter (``knownstate verify pgqueuer``); ``PgqueuerOwnersOnly`` in the same module is the
control in which a worker never writes for a job it no longer owns."""
