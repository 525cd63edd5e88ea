"""The command line of the browser check: ``--client`` and ``--client-bundle``.

``knownstate verify document-session --client browser`` is the kind ``document-session-browser``
(the document-session check with its tabs in Chromium); ``--client-bundle FILE`` points it at a
bundle of your own that implements the driver contract (README: "Validating your own client"),
and implies ``--client browser``. Checked before anything starts, like every option.
"""

from __future__ import annotations

import os
import shlex

from . import kinds

PYTHON, BROWSER = "python", "browser"
SESSION, BROWSER_KIND = "document-session", "document-session-browser"


class ClientOptionError(ValueError):
    """A --client / --client-bundle the command cannot honour (exit 2)."""


def add_options(sp) -> None:
    sp.add_argument(
        "--client",
        choices=(PYTHON, BROWSER),
        help="which client plays the document session's tabs: python (default), or browser "
        f"(headless Chromium; the same as kind {BROWSER_KIND})",
    )
    sp.add_argument(
        "--client-bundle",
        metavar="FILE",
        help="a JavaScript bundle of your own client implementing the driver contract, checked "
        "in the browser (implies --client browser)",
    )


def apply(args) -> None:
    """Rewrite the kinds of the command for ``--client``; register ``--client-bundle``."""
    client, bundle = getattr(args, "client", None), getattr(args, "client_bundle", None)
    if bundle and client == PYTHON:
        raise ClientOptionError("--client-bundle is a browser client: drop --client python")
    if bundle:
        client = BROWSER
    if client != BROWSER:
        return
    other = [k for k in args.kinds if k not in (SESSION, BROWSER_KIND)]
    if other:
        raise ClientOptionError(
            f"--client browser checks the document session only, not {', '.join(other)}"
        )
    args.kinds = [BROWSER_KIND]
    if bundle:
        if args.command != "verify":
            raise ClientOptionError(
                "--client-bundle checks your own client with verify; the mutant catalogue is "
                "the reference client's (knownstate mutants document-session --client browser)"
            )
        path = os.path.abspath(bundle)
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ClientOptionError(f"--client-bundle {bundle}: no readable file there")
        if getattr(args, "mutant", None):
            raise ClientOptionError("--mutant names a mutant of the reference client: drop it")
        check = kinds.check(BROWSER_KIND)
        check.client_bundle = path
        kinds.set_argument(BROWSER_KIND, f"{BROWSER_KIND} --client-bundle {shlex.quote(path)}")
