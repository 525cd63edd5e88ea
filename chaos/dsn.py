"""DSNs: one a user gives is checked before anything starts, shown without its secret, and
the throwaway cluster's are pinned so that libpq's environment variables cannot change them.

libpq fills every connection parameter a DSN leaves out from an environment variable (PGHOST,
PGPORT, PGUSER, PGPASSWORD, PGSSLMODE, PGOPTIONS, ...), and sends PGTZ, PGDATESTYLE and PGGEQO
as session settings whatever a DSN says. For a server the user names (``--dsn``) that is what
``psql`` does and what the user expects; for the harness's own throwaway cluster it never is:
``PGOPTIONS='-c statement_timeout=1'`` would turn the gate's own statements into failures.

- :func:`check` reads a DSN a user gave, or raises ValueError with one line (exit 2);
- :func:`redact` hides passwords in any text that may hold a DSN (argv, messages);
- :func:`pinned` builds a DSN in which every parameter libpq would take from the environment
  is given explicitly, so no variable reaches a connection made with it;
- :func:`ignore_environment` removes, from a process that talks only to the throwaway cluster
  (the ``knownstate`` command without ``--dsn``), the variables no DSN can override;
- :func:`from_environment` names the variables that do reach a ``--dsn`` connection, for the
  message about a connection that failed;
- :func:`refusal` is the one-line message for a connection the server (or the name service)
  refused, None for one that may yet succeed (a server still starting).
"""

from __future__ import annotations

import argparse
import os
import re

import psycopg

PINS = {
    "service": None,  # never pinned: an empty service name is looked up too
    "channel_binding": "prefer",
    "hostaddr": "",
    "client_encoding": "UTF8",
    "options": "",
    "application_name": "",
    "sslmode": "disable",  # the throwaway cluster listens on loopback, without TLS
    "sslnegotiation": "postgres",
    "sslcertmode": "disable",
    "require_auth": "none",  # it trusts local connections: no password is ever asked
    "min_protocol_version": "3.0",
    "max_protocol_version": "3.0",
    "gssencmode": "disable",
    "target_session_attrs": "any",
    "load_balance_hosts": "disable",
}
"""What the throwaway cluster's connections say for every parameter libpq would otherwise take
from the environment (those libpq ignores once TLS and GSS are off are left out)."""

SESSION_VARIABLES = ("PGTZ", "PGDATESTYLE", "PGGEQO", "PGSERVICE", "PGSERVICEFILE", "PGSYSCONFDIR")
"""Variables no DSN overrides: session settings libpq sends after a DSN's own, and the service
file lookup."""


def _libpq_options() -> dict[str, str | None]:
    """Every parameter this libpq knows, with the environment variable it reads (or None)."""
    return {
        o.keyword.decode(): o.envvar.decode() if o.envvar else None
        for o in psycopg.pq.Conninfo.get_defaults()
    }


def pinned(**params) -> str:
    """A DSN with ``params`` and every parameter libpq would read from the environment pinned
    (:data:`PINS`, as far as this libpq knows them)."""
    known = _libpq_options()
    pins = {k: v for k, v in PINS.items() if k in known and v is not None and k not in params}
    return psycopg.conninfo.make_conninfo(**params, **pins)


def variables() -> list[str]:
    """The libpq environment variables set in this process."""
    names = {v for v in _libpq_options().values() if v} | set(SESSION_VARIABLES)
    return sorted(n for n in names if os.environ.get(n) is not None)


def ignore_environment() -> list[str]:
    """Remove every libpq variable from this process's environment (and so from its children's);
    the names removed. Only for a process that talks to the throwaway cluster alone."""
    removed = variables()
    for name in removed:
        del os.environ[name]
    return removed


def from_environment(dsn: str) -> list[str]:
    """``NAME=value`` of each libpq variable that reaches a connection to ``dsn`` (a parameter
    the DSN leaves out, or a session variable), passwords hidden."""
    given = set(psycopg.conninfo.conninfo_to_dict(dsn))
    out = []
    for keyword, env in _libpq_options().items():
        if env and keyword not in given and os.environ.get(env) is not None:
            shown = "***" if "password" in keyword else os.environ[env]
            out.append(f"{env}={shown}")
    out += [f"{n}={os.environ[n]}" for n in SESSION_VARIABLES if os.environ.get(n) is not None]
    return out


def environment_note(dsn: str) -> str:
    """`` (from the environment: PGSSLMODE=require)``, or nothing: for a failed connection's
    message, so a variable the user forgot is named."""
    try:
        found = from_environment(dsn)
    except psycopg.Error:
        return ""
    return f" (libpq also read, from the environment: {', '.join(found)})" if found else ""


# ---------------------------------------------------------------------------------------
# A DSN a user gave.
# ---------------------------------------------------------------------------------------

_URI_SECRET = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^:/?#@\s]*:)([^@/?#\s]*)(@)")
_KEY_SECRET = re.compile(r"(?i)\b((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]*)")


def redact(text: str) -> str:
    """``text`` with every password a DSN in it carries replaced by ``***``: in a URI's user
    information, a ``password=`` pair or a ``?password=`` query parameter."""
    return _KEY_SECRET.sub(r"\1***", _URI_SECRET.sub(r"\1***\3", text))


def redact_argv(argv: list[str]) -> list[str]:
    return [redact(a) for a in argv]


def check(text: str) -> str:
    """The DSN ``text``, when libpq reads it (a URI or ``key=value`` pairs, with valid ports);
    else ValueError, one line, without any secret it holds."""
    if not text.strip():
        raise ValueError("--dsn needs a DSN (postgresql://... or key=value pairs) or env:NAME")
    try:
        params = psycopg.conninfo.conninfo_to_dict(text)
    except psycopg.Error as e:
        raise ValueError(
            f"not a DSN ({_masked(str(e).strip(), text)}): give "
            "postgresql://user@host:port/dbname or key=value pairs (host=... dbname=...)"
        ) from None
    for port in str(params.get("port", "")).split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"the DSN's port {port!r} is not a port number (1..65535)")
    return text


def _masked(message: str, dsn: str) -> str:
    """libpq's message about a DSN it cannot read, without a quoted fragment of the DSN that
    overlaps its password: a URI's password, or anything after a ``password=`` key (a DSN that
    does not parse has no reliable end to that value)."""
    first = message.splitlines()[0] if message else "unreadable"
    spans = [m.span(2) for m in _URI_SECRET.finditer(dsn)]
    spans += [(m.start(2), len(dsn)) for m in _KEY_SECRET.finditer(dsn)]

    def mask(m: re.Match) -> str:
        fragment = m.group(1)
        if not re.search(r"\w", fragment):
            return m.group(0)  # "=", a quote: punctuation says what is wrong, and nothing else
        at = dsn.find(fragment)
        while at >= 0:
            if any(start < at + len(fragment) and at < end for start, end in spans):
                return '"***"'
            at = dsn.find(fragment, at + 1)
        return m.group(0)

    return redact(re.sub(r'"([^"]*)"', mask, first))


def resolve(value: str) -> str:
    """The DSN a ``--dsn`` value names: the value itself, or with ``env:NAME`` the value of the
    environment variable NAME (so ``--dsn env:DATABASE_URL`` reads it on purpose; nothing ever
    reads it implicitly), checked (:func:`check`). Raises ValueError naming what is wrong,
    never the DSN's password."""
    if value.startswith("env:"):
        name = value[4:]
        found = os.environ.get(name, "")
        if not name or not found.strip():
            raise ValueError(
                f"--dsn {value}: the environment variable {name or '(none)'} is not set or empty"
            )
        value = found.strip()
    return check(value)


def option(value: str) -> str:
    """argparse type of ``--dsn`` (:func:`resolve`): a bad one is exit 2 with one line."""
    try:
        return resolve(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def with_options(dsn: str, *settings: str) -> str:
    """``dsn`` with ``-c NAME=VALUE`` for each setting added after its own ``options``."""
    given = psycopg.conninfo.conninfo_to_dict(dsn).get("options", "")
    extra = " ".join(f"-c {s}" for s in settings)
    return psycopg.conninfo.make_conninfo(dsn, options=f"{given} {extra}".strip())


# ---------------------------------------------------------------------------------------
# A connection that failed.
# ---------------------------------------------------------------------------------------


def reason(text: str) -> str:
    """The server's (or libpq's) reason in a connection error: its first line, without the
    address in front of it."""
    found = text.split("FATAL:", 1)[-1] if "FATAL:" in text else text.rsplit("failed:", 1)[-1]
    first = found.strip().splitlines()[0] if found.strip() else text
    return first.split(" DETAIL:")[0].split(" HINT:")[0].strip()


def refusal(text: str, where: str, user: str, dbname: str, dsn: str) -> str | None:
    """The one-line message for a connection to ``dsn`` that cannot succeed by waiting (None: a
    server that may be starting). ``where`` is ``host:port``."""
    text = " ".join(text.split())
    note = environment_note(dsn)
    if "permission denied for database" in text:
        return (
            f"user {user} may not connect to database {dbname} on {where}: grant it with "
            f"GRANT CONNECT ON DATABASE {ident(dbname)} TO {ident(user)}"
        )
    if f'database "{dbname}" does not exist' in text:
        return (
            f"database {dbname} does not exist on {where}: create it, or name an existing one "
            "in the DSN (knownstate never creates databases)"
        )
    if "could not translate host name" in text or "failed to resolve host" in text:
        host = where.rsplit(":", 1)[0]
        return f"cannot resolve host {host} ({reason(text)}): check the DSN's host{note}"
    if "password authentication failed" in text or "no password supplied" in text:
        return f"{where} refused user {user}: {reason(text)}: check the DSN's password{note}"
    if "SSL" in text or "GSSAPI" in text or "channel binding" in text or "require_auth" in text:
        return f"{where} refused the connection: {reason(text)}: check the DSN{note}"
    if any(
        m in text
        for m in (
            "authentication failed",
            "does not exist",
            "no pg_hba.conf entry",
            "not permitted to log in",
            "too many connections for role",
        )
    ):
        return f"{where} refused user {user}: {reason(text)}: check the DSN{note}"
    return None


def ident(name: str) -> str:
    """``name`` as an SQL identifier in a message a user copies."""
    return name if re.fullmatch(r"[a-z_][a-z0-9_$]*", name) else '"' + name.replace('"', '""') + '"'
