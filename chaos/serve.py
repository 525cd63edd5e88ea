"""``knownstate serve``: the document server on its own, to try the API by hand.

It runs on a throwaway PostgreSQL the harness creates (the same one the checks use, real
clock, removed when the server stops), or on ``--dsn``, where it creates its three tables if
they are missing (``documents``, ``document_acl``, ``document_history``) and drops nothing.
It listens on loopback unless told otherwise, prints how to create a document and share it,
and serves until Ctrl-C (or SIGTERM), then stops everything it started.

``X-User`` names the user and is trusted as sent: a stand-in for authentication, not
authentication. Anyone who reaches the port can be anyone, which is why the default is
loopback and why another ``--host`` is printed with a warning (README: "The document server").
"""

from __future__ import annotations

import contextlib
import ipaddress

import psycopg

from .browser import mount_page
from .cluster import ClusterError, PostgresCluster, Unavailable

EXIT_OK, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 2, 3


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
        help="serve the documents of this PostgreSQL (tables are created if "
        "missing); default: a throwaway cluster, removed on exit",
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
    from knownstate.impl.errors import KnownstateError, first_line

    with contextlib.ExitStack() as stack:
        try:
            if args.dsn:
                dsn, where = args.dsn, "the PostgreSQL at --dsn (tables created if missing)"
            else:
                pg = stack.enter_context(PostgresCluster(faketime=False))
                dsn, where = pg.dsn(), f"{pg.describe()}, removed when this stops"
            with DocumentStore(dsn, pool_size=None) as store:
                store.install()
            server = DocumentServer(dsn, host=args.host, port=args.port or None)
            page = mount_page(server.app)
            stack.enter_context(server)
        except (ClusterError, Unavailable, KnownstateError, psycopg.Error) as e:
            print(f"knownstate serve: cannot start: {first_line(e)}")
            return EXIT_ENVIRONMENT
        except RuntimeError as e:  # uvicorn could not listen
            print(f"knownstate serve: {e}: is port {args.port} taken? choose another with --port")
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
        except KeyboardInterrupt:
            pass
        gone = "the server is" if args.dsn else "the server and its throwaway database are"
        print(f"knownstate serve: stopped; {gone} gone.", flush=True)
    return EXIT_OK
