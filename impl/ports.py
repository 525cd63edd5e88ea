"""A free TCP port on loopback, for a server about to listen: the document server here, and
every real part the harness starts (``knownstate.chaos``)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
