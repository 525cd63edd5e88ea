"""The run kinds knownstate checks, by name. Each module defines its check class and MUTANTS."""

from __future__ import annotations

import importlib

# name -> (module, check class name). The order is the order `knownstate verify` runs them in.
REGISTRY: dict[str, tuple[str, str]] = {
    "outbox": ("outbox", "OutboxCheck"),
    "approved-plan": ("approved_plan", "ApprovedPlanCheck"),
    "branch-reset": ("branch_reset", "BranchResetCheck"),
    "document-session": ("document_session", "DocumentSessionCheck"),
}


def names() -> list[str]:
    return list(REGISTRY)


def check(name: str):
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def mutants(name: str):
    module, _ = REGISTRY[name]
    return list(getattr(importlib.import_module(f"{__name__}.{module}"), "MUTANTS", []))
