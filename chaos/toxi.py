"""Toxiproxy: the real server (Shopify's, v2.12.0) and the one module that talks to it.

Every connection the code under test makes — to PostgreSQL or to an external stand-in — goes
through its own proxy, one per (worker, upstream) link, so one worker can be cut off alone.

Toxic values are never left to Toxiproxy's own randomness (it cannot be seeded): the checks
draw every attribute with Hypothesis and pass it here, so a seed replays the same faults.

Every call goes through :class:`Toxiproxy`, over one kept-alive HTTP connection to the server's
JSON API (a check adds and removes toxics hundreds of times a second; a new connection, or
``toxiproxy-python``'s two requests per toxic, cost ten times more). The API used: ``POST
/proxies`` (create), ``POST /proxies/{name}`` (enable / disable), ``POST
/proxies/{name}/toxics``, ``DELETE /proxies/{name}/toxics/{toxic}``, ``POST /reset``, ``GET
/version``.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from knownstate.impl.ports import free_port

from . import timings, tools


class ToxiproxyError(RuntimeError):
    """The Toxiproxy server is not answering: it may have been killed."""


TOXIC_KINDS = (
    "latency",
    "timeout",
    "reset_peer",
    "slicer",
    "limit_data",
    "bandwidth",
    "slow_close",
)


@dataclass(frozen=True)
class Toxic:
    """One toxic with concrete attribute values. ``stream`` is ``downstream`` (server → client)
    or ``upstream`` (client → server)."""

    kind: str
    stream: str = "downstream"
    attributes: dict = field(default_factory=dict)
    label: str = ""  # tells apart two toxics of one kind and stream on one link

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.stream}" + (f"_{self.label}" if self.label else "")

    def describe(self) -> str:
        attrs = " ".join(f"{k}={v}" for k, v in sorted(self.attributes.items()))
        return f"{self.kind}({self.stream}{' ' + attrs if attrs else ''})"


class ToxiproxyServer:
    """The toxiproxy-server process on a free loopback port."""

    def __init__(self):
        self.host = "127.0.0.1"
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> "ToxiproxyServer":
        binary = tools.toxiproxy_server()
        self.port = free_port()
        self._proc = tools.spawn(
            [binary, "-host", self.host, "-port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ToxiproxyError(
                    f"toxiproxy-server exited with code {self._proc.returncode} at start"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/version", timeout=1) as r:
                    r.read()
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.02)
        self.stop()
        raise ToxiproxyError("toxiproxy-server did not answer within 15s")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        from .cluster import process_alive

        return process_alive(self._proc)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def client(self) -> "Toxiproxy":
        return Toxiproxy(self.host, self.port)

    def __enter__(self) -> "ToxiproxyServer":
        return self.start() if self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class Link:
    """One proxy: a single worker's path to a single upstream."""

    def __init__(self, api: "Toxiproxy", name: str, listen_port: int, upstream: str):
        self.api, self.name, self.port, self.upstream = api, name, listen_port, upstream
        self.host = "127.0.0.1"
        self.toxics: list[Toxic] = []
        self.enabled = True

    def add(self, toxic: Toxic) -> None:
        self.api._http(
            "POST",
            f"/proxies/{self.name}/toxics",
            {
                "name": toxic.name,
                "type": toxic.kind,
                "stream": toxic.stream,
                "toxicity": 1.0,
                "attributes": toxic.attributes,
            },
        )
        self.toxics.append(toxic)

    def remove(self, toxic: Toxic) -> None:
        """Remove the toxic of this name, if it is still there (a heal may have removed it
        first)."""
        if any(t.name == toxic.name for t in self.toxics):
            self.api._http("DELETE", f"/proxies/{self.name}/toxics/{toxic.name}")
            self.toxics = [t for t in self.toxics if t.name != toxic.name]

    def down(self) -> None:
        """Disable the proxy: open connections drop, new ones are refused."""
        self.api._http("POST", f"/proxies/{self.name}", {"enabled": False})
        self.enabled = False

    def up(self) -> None:
        self.api._http("POST", f"/proxies/{self.name}", {"enabled": True})
        self.enabled = True

    def clear(self) -> None:
        for t in list(self.toxics):
            self.remove(t)
        if not self.enabled:
            self.up()

    def __repr__(self) -> str:
        return f"Link({self.name} :{self.port} -> {self.upstream})"


class Toxiproxy:
    """The client: one kept-alive HTTP connection to the server's API."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.links: dict[str, Link] = {}
        self._conn: http.client.HTTPConnection | None = None

    def _http(self, method: str, path: str, body: dict | None = None) -> bytes:
        with timings.span("toxiproxy"):
            return self._call(method, path, body)

    def _call(self, method: str, path: str, body: dict | None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
            try:
                self._conn.request(
                    method, path, body=data, headers={"Content-Type": "application/json"}
                )
                r = self._conn.getresponse()
                answer = r.read()
            except (OSError, http.client.HTTPException) as e:
                self._conn.close()
                self._conn = None
                if attempt == 1:  # the server closed an idle kept-alive connection: once more
                    continue
                raise ToxiproxyError(
                    f"toxiproxy-server at {self.host}:{self.port} is not "
                    f"answering ({e}); was it killed?"
                ) from None
            if r.status >= 400:
                raise ToxiproxyError(
                    f"toxiproxy refused {method} {path}: {r.status} {answer[:200]!r}"
                )
            return answer
        raise AssertionError("unreachable")

    def link(self, name: str, upstream_host: str, upstream_port: int) -> Link:
        """Create (or return) the proxy ``name`` in front of ``upstream``."""
        if name in self.links:
            return self.links[name]
        port = free_port()
        upstream = f"{upstream_host}:{upstream_port}"
        self._http(
            "POST",
            "/proxies",
            {"name": name, "listen": f"127.0.0.1:{port}", "upstream": upstream, "enabled": True},
        )
        link = self.links[name] = Link(self, name, port, upstream)
        return link

    def reset(self) -> None:
        """Re-enable every proxy and remove every toxic (between examples)."""
        self._http("POST", "/reset")
        for link in self.links.values():
            link.toxics.clear()
            link.enabled = True

    def version(self) -> str:
        return self._http("GET", "/version").decode().strip()
