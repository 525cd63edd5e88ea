"""chancy 0.26.0 under knownstate's gate: :mod:`chancy_kind.binding` is its description and
adapter (``knownstate verify chancy``); ``ChancyOwnersOnly`` in the same module is the control
in which a worker never writes for a job it no longer owns, with chancy's workers table kept
through a crash."""
