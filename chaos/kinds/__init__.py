"""The run kinds knownstate checks: found, not forked.

Three ways a kind is found, in this order:

1. the built-in kinds: each module of this package that names its check class ``CHECK`` (beside
   it, ``MUTANTS`` and, if it can be soaked, its soak binding ``SOAK``), in the order of their
   names; a new kind's module is found without a line anywhere else. A module is named after
   its kind (``approved_plan.py`` holds ``approved-plan``), so a command imports only the kinds
   it runs;
2. kinds an installed package registers in the entry point group ``knownstate.kinds``, e.g. in
   its ``pyproject.toml``::

       [project.entry-points."knownstate.kinds"]
       webhook = "webhook_kind.binding:WebhookKind"

   (the entry point's name is the kind's name);
3. a kind named on the command line, ``knownstate verify --kind package.module:Thing`` (the
   current directory is searched first, as ``python -m`` does).

``Thing`` is a check class: a :class:`~knownstate.chaos.check.KindCheck` subclass, such as
:func:`knownstate.chaos.generic.kind` returns. Its mutants are its ``mutants`` attribute, else
its module's ``MUTANTS``; its soak binding is its module's ``SOAK``, else (a described kind) one
built from its description. A kind that cannot be found or imported is one line saying what is
wrong and what to do (:class:`KindNotFound`).
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

GROUP = "knownstate.kinds"


class Entry(NamedTuple):
    """One built-in kind: its module's name here (the module imported when first asked for),
    and whether it sets ``SOAK``."""

    module: str
    soaks: bool = False

    @property
    def loaded(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.module}")

    @property
    def check(self) -> type:
        found, name = self.loaded.CHECK, self.module.replace("_", "-")
        if found.kind != name:
            raise KindNotFound(
                f"chaos/kinds/{self.module}.py holds kind {found.kind!r}: a built-in kind's "
                f"module is named after its kind: rename the module or the kind to {name!r}"
            )
        return found

    @property
    def soak(self) -> type | None:
        """Its soak binding (a :class:`~knownstate.chaos.soakkinds.SoakKind`), or None."""
        return getattr(self.loaded, "SOAK", None)


def _sets(module: str) -> set[str]:
    """Which of ``CHECK`` and ``SOAK`` a module of this package sets: read in its source,
    without importing it (a module whose source is not there is imported to be asked)."""
    try:
        source = Path(__path__[0], f"{module}.py").read_text()
    except OSError:
        loaded = importlib.import_module(f"{__name__}.{module}")
        return {n for n in ("CHECK", "SOAK") if hasattr(loaded, n)}
    return set(re.findall(r"^(CHECK|SOAK)\s*=", source, re.MULTILINE))


@functools.cache
def built_in() -> dict[str, Entry]:
    """The built-in kinds by name, in the order ``knownstate verify`` runs them (their names'):
    every module of this package that sets ``CHECK``."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        sets = _sets(info.name)
        if "CHECK" in sets:
            found[info.name.replace("_", "-")] = Entry(info.name, "SOAK" in sets)
    return dict(sorted(found.items()))


def described() -> list:
    """The built-in durable kinds' descriptions (:class:`~knownstate.model.describe.RunKind`), in
    the registry's order: each kind's model module (``knownstate.model.<module>``) states its own
    as ``DESCRIPTION``; a client protocol has none."""
    out = []
    for entry in built_in().values():
        name = f"knownstate.model.{entry.module}"
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        if hasattr(found, "DESCRIPTION"):
            out.append(found.DESCRIPTION)
    return out


_named: dict[str, tuple[type, str]] = {}  # kinds loaded from --kind: name -> (check, spec)
_arguments: dict[str, str] = {}  # how a replay command names a kind run with options of its own


class KindNotFound(LookupError):
    """A kind that cannot be found or imported; the message says what to do."""


def _entry_points() -> dict[str, metadata.EntryPoint]:
    out: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUP):
        if ep.name not in built_in():
            out.setdefault(ep.name, ep)
    return out


def names() -> list[str]:
    """Every kind: built-in, registered by installed packages, then named with --kind."""
    out = list(built_in()) + sorted(_entry_points())
    return out + [n for n in _named if n not in out]


def _describe(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    package = f", package {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value}{package}"


def _as_check(obj, where: str) -> type:
    from ..engine import Engine

    if isinstance(obj, type) and issubclass(obj, Engine) and obj.kind:
        return obj
    what = type(obj).__name__ if not isinstance(obj, type) else f"class {obj.__name__}"
    raise KindNotFound(
        f"{where} is a {what}, not a check: give a KindCheck (or ReplayCheck) subclass with a "
        "kind name, e.g. knownstate.chaos.generic.kind(description, adapter)"
    )


def _import(spec: str, where: str):
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise KindNotFound(
                f"{where}: no module {e.name!r} (is the package installed, or the "
                "current directory the one that holds it?)"
            ) from None
        raise KindNotFound(
            f"{where} cannot be imported: {type(e).__name__}: {e} (install what it needs)"
        ) from None
    except AttributeError:
        raise KindNotFound(f"{where}: module {module!r} has no {attr!r}") from None
    except KindNotFound:
        raise
    except Exception as e:  # the user's module raised while importing
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise KindNotFound(f"{where} cannot be imported: {type(e).__name__}: {first}") from None


def load(spec: str) -> str:
    """Import ``package.module:Thing`` (the --kind option) and register it; its kind's name."""
    module, colon, attr = spec.partition(":")
    if not colon or not module or not attr:
        raise KindNotFound(f"--kind {spec!r}: write it as package.module:Thing (a check class)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    check_class = _as_check(_import(spec, f"--kind {spec}"), f"--kind {spec}")
    name = check_class.kind
    if name in built_in() or name in _entry_points():
        if check(name) is not check_class:
            raise KindNotFound(
                f"--kind {spec}: its kind is named {name!r}, like another kind "
                "already known: give it a name of its own"
            )
        return name
    _named[name] = (check_class, spec)
    return name


def register(check_class: type) -> str:
    """A check class given as is (a test's, through the pytest plugin): known by its kind's
    name from now on in this process, and named in replay commands by where it lives."""
    check_class = _as_check(check_class, repr(check_class))
    module = sys.modules.get(check_class.__module__)
    attr = next((k for k, v in vars(module).items() if v is check_class), None) if module else None
    name = check_class.kind
    if name not in built_in() and name not in _entry_points():
        _named[name] = (check_class, f"{check_class.__module__}:{attr}" if attr else "")
    return name


def argument(name: str) -> str:
    """How a command line names the kind (a replay command must find it again)."""
    if name in _arguments:
        return _arguments[name]
    spec = _named[name][1] if name in _named else ""
    return f"--kind {spec}" if spec else name


def set_argument(name: str, words: str) -> None:
    """Name the kind so in replay commands (its run has options of its own, e.g. a client
    bundle)."""
    _arguments[name] = words


def check(name: str):
    if name in built_in():
        return built_in()[name].check
    if name in _named:
        return _named[name][0]
    ep = _entry_points().get(name)
    if ep is None:
        raise KindNotFound(
            f"unknown kind {name}: choose from {', '.join(names())}, or name "
            "one with --kind package.module:Thing"
        )
    where = f"kind {name!r} ({_describe(ep)})"
    found = _as_check(_import(ep.value, where), where)
    if found.kind != name:
        raise KindNotFound(
            f"{where} loads a check of kind {found.kind!r}: name the entry point {found.kind!r}"
        )
    return found


def mutants(name: str):
    return mutants_of(check(name))


def mutants_of(check_class: type) -> list:
    """A check's mutant catalogue: its ``mutants`` attribute, else its module's ``MUTANTS``."""
    own = getattr(check_class, "mutants", None)
    if isinstance(own, (list, tuple)):
        return list(own)
    return list(getattr(sys.modules.get(check_class.__module__), "MUTANTS", []))


def soak(name: str):
    """The soak binding of kind ``name``: its check module's ``SOAK``, else (a described kind)
    built from its description and adapter. KindNotFound when it has none."""
    check_class = check(name)
    own = getattr(sys.modules.get(check_class.__module__), "SOAK", None)
    if own is not None:
        return own()
    from ..soakgeneric import described

    return described(check_class)
