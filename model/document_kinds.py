"""Document kinds: what an id and a value may be, and how (and whether) three copies merge.

Both kinds are flat maps ``id -> value``. A ``record``'s ids are the attribute ids of its
schema, each typed (``text``, ``number``, ``bool``), and it merges by attribute id; a ``sheet``'s
ids are cell references inside its size, and it does not merge (a formula has no merge
semantics: an explicit conflict is more honest than a silent merge). The limits here are the
ones the HTTP layer enforces too (it imports them). Identifiers are always matched in full.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping

# ---------------------------------------------------------------------------------------
# Limits (the HTTP layer enforces the same ones: imported from here).
# ---------------------------------------------------------------------------------------

MAX_BODY_BYTES = 64 * 1024
MAX_KEYS = 500
MAX_TEXT = 2000
MAX_VERSION = 2**62
MAX_NUMBER = 2**53
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
USER_PATTERN = r"^[A-Za-z0-9_.@-]{1,64}$"
WRITER_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""Identifier patterns. Always matched in full (``re.fullmatch``): with ``re.match`` a ``$`` also
matches before a trailing newline, so ``"A1\\n"`` would pass as ``A1``."""
SERVER_AUTHOR = "server"

Value = str | int | float | bool
Content = dict[str, Value]


class KindError(ValueError):
    """A content, patch or schema does not fit the document's kind. The message names the
    problem."""


# ---------------------------------------------------------------------------------------
# The kinds.
# ---------------------------------------------------------------------------------------


def _check_text(what: str, s: str) -> None:
    if "\x00" in s:
        raise KindError(f"{what} contains a NUL character")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise KindError(f"{what} is not valid Unicode (lone surrogate)") from None


def _check_number(what: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise KindError(f"{what} must be a number, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        raise KindError(f"{what} must be a finite number")
    if abs(v) > MAX_NUMBER:
        raise KindError(f"{what} is out of range (|x| <= 2**53)")


def _check_string(what: str, v) -> None:
    if not isinstance(v, str):
        raise KindError(f"{what} must be a string, got {type(v).__name__}")
    if len(v) > MAX_TEXT:
        raise KindError(f"{what} is longer than {MAX_TEXT} characters")
    _check_text(what, v)


def same(a, b) -> bool:
    """Value equality that does not confuse ``True`` with ``1`` or ``1`` with ``1.0``."""
    return type(a) is type(b) and a == b


def same_content(a: Mapping, b: Mapping) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


Resolve = Callable[[str, object, object, object], object]
"""A clash resolver: ``resolve(id, base, local, stored) -> value`` (``None``: the id is absent)."""


def prefer_local(_id, _base, local, _stored):
    return local


def prefer_stored(_id, _base, _local, stored):
    return stored


class Kind:
    name: str = ""
    can_merge: bool = False

    @staticmethod
    def matches(pattern: re.Pattern, text: str) -> re.Match | None:
        """An identifier against its pattern, in full: no trailing newline slips through."""
        return pattern.fullmatch(text)

    def validate_schema(self, schema) -> dict:
        raise NotImplementedError

    def validate_value(self, schema: Mapping, key: str, value) -> None:
        raise NotImplementedError

    def validate_content(self, schema: Mapping, content) -> None:
        if not isinstance(content, Mapping):
            raise KindError(f"{self.name} content must be an object of id -> value")
        if len(content) > MAX_KEYS:
            raise KindError(f"{self.name} content has more than {MAX_KEYS} ids")
        for key, value in content.items():
            if value is None:
                raise KindError(f"content[{key!r}] is null: omit the id to clear it")
            self.validate_value(schema, key, value)

    def validate_patch(self, schema: Mapping, patch) -> None:
        """A patch maps ids to new values; ``None`` clears an id."""
        if not isinstance(patch, Mapping) or not patch:
            raise KindError("an edit is a non-empty map of id -> value (None clears)")
        for key, value in patch.items():
            if value is None:
                self.validate_value(schema, key, None)
            else:
                self.validate_value(schema, key, value)

    @staticmethod
    def apply(content: Mapping, patch: Mapping) -> Content:
        out = dict(content)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    def merge(self, base: Mapping, local: Mapping, stored: Mapping, resolve: Resolve) -> Content:
        raise MergeUnsupported(self.name)


class RecordKind(Kind):
    """Dynamic attributes keyed by attribute id; the schema names each attribute's type."""

    name = "record"
    can_merge = True
    TYPES = ("text", "number", "bool")
    ATTR = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

    def validate_schema(self, schema) -> dict:
        if not isinstance(schema, Mapping) or set(schema) != {"attributes"}:
            raise KindError(
                'a record schema is {"attributes": {attribute id: "text" | "number" | "bool"}}'
            )
        attrs = schema["attributes"]
        if not isinstance(attrs, Mapping) or not attrs or len(attrs) > MAX_KEYS:
            raise KindError(f"a record schema needs 1..{MAX_KEYS} attributes")
        for a, t in attrs.items():
            if not isinstance(a, str) or not self.matches(self.ATTR, a):
                raise KindError(f"attribute id {a!r} must match {self.ATTR.pattern}")
            if t not in self.TYPES:
                raise KindError(
                    f"attribute {a!r} has type {t!r}; expected one of {', '.join(self.TYPES)}"
                )
        return {"attributes": dict(attrs)}

    def validate_value(self, schema, key, value) -> None:
        if not isinstance(key, str):
            raise KindError(f"attribute id {key!r} must be a string")
        t = schema["attributes"].get(key)
        if t is None:
            _check_text("attribute id", key)
            raise KindError(f"unknown attribute id {key!r}")
        if value is None:
            return
        what = f"attribute {key!r}"
        if t == "text":
            _check_string(what, value)
        elif t == "number":
            _check_number(what, value)
        elif not isinstance(value, bool):
            raise KindError(f"{what} must be a boolean, got {type(value).__name__}")

    def merge(self, base, local, stored, resolve: Resolve) -> Content:
        """Three-way merge by attribute id: a side that left an attribute as in the base takes
        the other side's value; only an attribute both sides changed differently is a clash,
        decided by ``resolve``."""
        out: Content = {}
        for key in sorted(set(base) | set(local) | set(stored)):
            b, l, s = base.get(key), local.get(key), stored.get(key)
            if same(l, s):
                v = l
            elif same(l, b):
                v = s
            elif same(s, b):
                v = l
            else:
                v = resolve(key, b, l, s)
            if v is not None:
                out[key] = v
        return out


class SheetKind(Kind):
    """Cells keyed by reference (``A1`` .. ``ZZ99999``) inside the sheet's size. No merge: a
    formula cell has no merge semantics, and an explicit conflict is more honest."""

    name = "sheet"
    can_merge = False
    CELL = re.compile(r"^([A-Z]{1,2})([1-9][0-9]{0,4})$")

    def validate_schema(self, schema) -> dict:
        if not isinstance(schema, Mapping) or set(schema) != {"rows", "cols"}:
            raise KindError('a sheet schema is {"rows": 1..10000, "cols": 1..702}')
        rows, cols = schema["rows"], schema["cols"]
        for what, v, hi in (("rows", rows, 10000), ("cols", cols, 702)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise KindError(f"sheet {what} must be an integer in 1..{hi}")
        return {"rows": rows, "cols": cols}

    @staticmethod
    def column_number(letters: str) -> int:
        n = 0
        for ch in letters:
            n = n * 26 + (ord(ch) - 64)
        return n

    def validate_value(self, schema, key, value) -> None:
        if not isinstance(key, str):
            raise KindError(f"cell id {key!r} must be a string")
        m = self.matches(self.CELL, key)
        if not m:
            _check_text("cell id", key)
            raise KindError(
                f"unknown cell id {key!r}: a cell is a column letter and a row number, like B7"
            )
        if self.column_number(m.group(1)) > schema["cols"] or int(m.group(2)) > schema["rows"]:
            raise KindError(
                f"unknown cell id {key!r}: outside the sheet's {schema['cols']} "
                f"columns x {schema['rows']} rows"
            )
        if value is None:
            return
        what = f"cell {key!r}"
        if isinstance(value, str):
            _check_string(what, value)
        else:
            _check_number(what, value)


class MergeUnsupported(KindError):
    """This document kind does not merge; resolve the conflict by keeping a copy, discarding, or
    reloading."""

    def __init__(self, kind: str):
        super().__init__(
            f"{kind} documents do not merge: keep the local copy as a new document, "
            "discard it, or discard and reload"
        )


RECORD, SHEET = RecordKind(), SheetKind()
KINDS: dict[str, Kind] = {"record": RECORD, "sheet": SHEET}


def kind_of(name: str, kinds: Mapping[str, Kind] = KINDS) -> Kind:
    try:
        return kinds[name]
    except KeyError:
        raise KindError(f"unknown document kind {name!r}; expected record or sheet") from None


def new_document(kind: str | None, schema, content, kinds: Mapping[str, Kind] = KINDS) -> dict:
    """The schema of a new document of ``kind`` holding ``content``, both checked (a
    :class:`KindError` names the problem)."""
    k = kind_of(kind or "", kinds)
    schema = k.validate_schema(schema)
    k.validate_content(schema, content)
    return schema
