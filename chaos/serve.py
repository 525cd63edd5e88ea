"""``knownstate serve``: the document server on its own, to try the API by hand.

It runs on a throwaway PostgreSQL the harness creates (the same one the checks use, real
clock, removed when the server stops), or on ``--dsn``, where it creates its three tables if
they are missing (``documents``, ``document_acl``, ``document_history``) and drops nothing.
``--schema NAME`` keeps them in a schema of the user's choosing (created if missing); tables of
those names that are not knownstate's are refused, naming them, never used or changed. It
listens on loopback unless told otherwise, prints how to create a document and share it, and
serves until Ctrl-C (exit 130) or SIGTERM (exit 143), then stops everything it started. A
cause it cannot start for — a DSN that does not parse (exit 2), a wrong password, a host that
does not resolve, a port taken (exit 3) — is named in one line.

``X-User`` names the user and is trusted as sent: a stand-in for authentication, not
authentication. Anyone who reaches the port can be anyone, which is why the default is
loopback and why another ``--host`` is printed with a warning (README: "The document server").
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import sys

import psycopg

from knownstate.impl.errors import first_line

from . import dsn as dsns
from . import tools
from .browser import mount_page
from .cluster import ClusterError, ExternalDatabase, PostgresCluster, Unavailable

EXIT_OK, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


def add_parser(subparsers) -> None:
    """Register ``serve`` (sets ``func``)."""
    p = subparsers.add_parser(
        "serve",
        help="run the document server (on a throwaway PostgreSQL, or --dsn)",
        description="Run the document API on a throwaway PostgreSQL (or --dsn) until Ctrl-C. "
        "X-User names the user and is trusted as sent: a stand-in for "
        "authentication, so the server listens on loopback by default.",
    )
    p.add_argument(
        "--dsn",
        type=dsns.option,
        help="serve the documents of this PostgreSQL (tables are created if "
        "missing); env:NAME reads it from that variable; default: a throwaway cluster, "
        "removed on exit",
    )
    p.add_argument(
        "--schema",
        type=_schema_name,
        help="keep the three tables in this schema (created if missing); default: the DSN's "
        "default schema, usually public",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free one)")
    p.set_defaults(func=run)


def _port(s: str) -> int:
    import argparse

    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {v}")
    return v


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def guide(url: str) -> list[str]:
    """How to create a document and share it, as commands to paste."""
    files = f"{url}/api/desk/files"
    json = "-H 'Content-Type: application/json'"
    return [
        "create a document (alice owns it; the answer has its id):",
        f"  curl -s -X POST {files} -H 'X-User: alice' {json} \\",
        '    -d \'{"kind": "record", "schema": {"attributes": {"title": "text"}}, '
        '"content": {"title": "hello"}, "writerId": "cli", "saveSeq": 1}\'',
        "share it with bob (canWrite false: he may read it; true: write it too), "
        "and see who has it:",
        f"  curl -s -X PUT {files}/ID/acl/bob -H 'X-User: alice' {json} "
        "-d '{\"canWrite\": true}'",
        f"  curl -s {files}/ID/acl -H 'X-User: alice'",
        "read it as bob, and save on the version read (a stale one is 409 with the stored copy):",
        f"  curl -s {files}/ID -H 'X-User: bob'",
        f"  curl -s -X PUT {files}/ID -H 'X-User: bob' {json} \\",
        '    -d \'{"expectedVersion": 1, "content": {"title": "hi"}, "writerId": '
        '"bob-cli", "saveSeq": 1}\'',
        f"stop sharing: curl -s -X DELETE {files}/ID/acl/bob -H 'X-User: alice'",
    ]


def run(args) -> int:
    from knownstate.impl.documents import DocumentServer, DocumentStore
    from knownstate.impl.documents.server import ListenError
    from knownstate.impl.errors import KnownstateError

    with contextlib.ExitStack() as stack:
        try:
            if args.dsn:
                dsn, where = args.dsn, "the PostgreSQL at --dsn (tables created if missing)"
                _prepare(args.dsn, args.schema)
            else:
                pg = stack.enter_context(PostgresCluster(faketime=False))
                dsn, where = pg.dsn(), f"{pg.describe()}, removed when this stops"
                if args.schema:
                    _prepare(dsn, args.schema)
            if args.schema:
                dsn = dsns.with_options(dsn, f"search_path={args.schema}")
                where += f", schema {args.schema}"
            with DocumentStore(dsn, pool_size=None) as store:
                _install(store, args)
            server = DocumentServer(dsn, host=args.host, port=args.port or None)
            page = mount_page(server.app)
            stack.enter_context(server)
        except (ClusterError, Unavailable, ListenError, _CannotServe) as e:
            print(f"knownstate serve: cannot start: {e}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        except (KnownstateError, psycopg.Error) as e:
            print(f"knownstate serve: cannot start: {first_line(e)}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        print(
            f"knownstate serve: the document API on {server.url} (OpenAPI: {server.url}/openapi"
            f".json)",
            flush=True,
        )
        print(f"  database: {where}")
        if page:
            print(f"  the page (a record and a sheet editor): {server.url}{page}?user=alice")
        else:
            print("  the page is not built (web/dist): run `make setup` to build it")
        print(
            "  X-User names the user and is trusted as sent: a stand-in for authentication, "
            "not authentication."
        )
        if not _loopback(args.host):
            print(
                f"  WARNING: listening on {args.host}: anyone who reaches this port can act as "
                "any user. Put it behind a proxy that authenticates and sets X-User."
            )
        for line in guide(server.url):
            print(f"  {line}")
        print("  Ctrl-C stops it.", flush=True)
        try:
            server.wait()
            code = EXIT_OK
        except KeyboardInterrupt as e:
            tools.interrupt_caught()  # a second signal waits for the servers to stop
            code = EXIT_TERMINATED if getattr(e, "signal", "") == "SIGTERM" else EXIT_INTERRUPTED
        gone = "the server is" if args.dsn else "the server and its throwaway database are"
    print(f"knownstate serve: stopped; {gone} gone.", flush=True)
    return code


class _CannotServe(Exception):
    """The database is reachable but cannot hold the documents as asked: the message says why
    and what to do."""


def _prepare(dsn: str, schema: str | None) -> None:
    """Connect once (a refusal names its cause: a wrong password, a host that does not
    resolve, a PG* variable) and create ``schema`` if asked for and missing."""
    db = ExternalDatabase(dsn)
    with db.connect(deadline_s=10, application_name="knownstate-serve") as conn:
        if schema is None:
            return
        try:
            conn.execute(f"create schema if not exists {schema}")
        except psycopg.errors.InsufficientPrivilege:
            raise _CannotServe(
                f"user {db.user} may not create schema {schema} in database {db.dbname}: "
                f"GRANT CREATE ON DATABASE {dsns.ident(db.dbname)} TO {dsns.ident(db.user)}, "
                "or name a schema that exists and that user may create tables in"
            ) from None


def _install(store, args) -> None:
    """Create the three tables where missing and check that the ones found answer the store's
    queries: tables of the same names made by someone else are refused, naming them."""
    from knownstate.impl.errors import TransactionAborted

    where = f"schema {args.schema}" if args.schema else "the DSN's default schema (search_path)"
    elsewhere = (
        "choose another --schema"
        if args.schema
        else "serve into a schema of its own with --schema NAME"
    )
    try:
        store.install()
        store.probe()
    except TransactionAborted as e:
        cause = e.__cause__
        if isinstance(cause, psycopg.errors.InsufficientPrivilege):
            raise _CannotServe(
                f"cannot create the document tables in {where} ({first_line(cause)}): "
                f"{elsewhere} (created if missing), or grant CREATE on the schema"
            ) from None
        raise _CannotServe(
            f"{where} already has tables named documents, document_acl or document_history "
            f"that are not knownstate's ({first_line(cause)}): {elsewhere}; nothing was changed "
            "in them"
        ) from None


def _schema_name(text: str) -> str:
    import argparse

    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a schema name this command takes: lower-case letters, digits "
            "and _, starting with a letter or _"
        )
    return text
