"""The operations-API stand-in for branch reset: a real HTTP server on loopback.

It plays the role of the Neon API behind dbops. The implementation reaches it over HTTP,
through its own Toxiproxy link, so the check can cut it off, slow it or drop its answers.

HTTP (JSON bodies)::

    POST /operations        {"run_id", "branch", "idempotency_key"}
        201 {"id", "run_id", "branch", "status"}   a new operation (status "in_progress")
        200 (same body)                            the key was seen: the existing operation,
                                                   and no new creation is counted
    GET  /operations/{id}   200 {"id", "run_id", "branch", "status"}, or 404

Control (Python, for the check, never over HTTP):

- :meth:`OpsApi.finish` ``(op_id, ok)``: the operation succeeds or fails; the check decides when.
- :meth:`OpsApi.fail_next` ``(n)``: the next ``n`` requests get 503, and the API does not act
  on them (:attr:`OpsApi.pending_failures`: how many are still armed).
- :meth:`OpsApi.creations`, :meth:`OpsApi.create_requests`, :meth:`OpsApi.polls`: what it counted.
- :meth:`OpsApi.snapshot`: its state in the model's shape
  (:class:`knownstate.model.branch_reset.ExternalState`).
- :meth:`OpsApi.reset`: forget everything between examples (operation ids restart at ``op-1``).

Like the other chaos parts it has start/stop and a context manager; it listens on a port the
kernel picks. The check runs it in a process of its own (:mod:`.standin`).
Nothing is left running after a run: the server thread is a daemon, and ``stop`` closes the socket.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import BaseModel, ValidationError

from knownstate.model.branch_reset import ExternalOp, ExternalState, ExternalStatus, KIND
from knownstate.model.contract import IllegalTransition

from .sink import JsonHandler, QuietServer


class CreateOperation(BaseModel):
    """The body of ``POST /operations``."""

    run_id: str
    branch: str
    idempotency_key: str


_OP_PATH = re.compile(r"^/operations/([^/]+)$")


class OpsApi:
    """The stand-in server. ``url`` is its base URL; callers normally reach it through a proxy."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None):
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._clear()

    def _clear(self) -> None:
        self._ops: dict[str, ExternalOp] = {}
        self._by_key: dict[str, str] = {}
        self._create_requests: dict[str, int] = {}
        self._polls: dict[str, int] = {}
        self._fail_next = 0
        self.refused = 0  # requests answered 503 by fail_next

    # -- life cycle -------------------------------------------------------------
    def start(self) -> "OpsApi":
        if self._server is not None:
            return self
        self._server = QuietServer((self.host, self.port or 0), _handler_for(self))
        self.port = self._server.server_address[1]  # the kernel's pick, when none was asked
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            name=f"opsapi:{self.port}",
            kwargs={"poll_interval": 0.05},
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "OpsApi":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- control (the check's side) ----------------------------------------------
    def finish(self, op_id: str, ok: bool) -> None:
        """The operation succeeded (ok) or failed. Only an operation in progress finishes:
        otherwise IllegalTransition, like the model's ``external_finish``."""
        with self._lock:
            op = self._ops[op_id]
            if op.status is not ExternalStatus.IN_PROGRESS:
                raise IllegalTransition(f"{KIND} operations API", op.status.value, "finish")
            self._ops[op_id] = ExternalOp(
                op.op_id,
                op.run_id,
                op.branch,
                op.idempotency_key,
                ExternalStatus.SUCCEEDED if ok else ExternalStatus.FAILED,
            )

    def fail_next(self, n: int) -> None:
        """Answer the next ``n`` requests (any method) with 503, without acting on them."""
        with self._lock:
            self._fail_next = n

    @property
    def pending_failures(self) -> int:
        """Requests still to be answered 503 (what ``fail_next`` armed and no request consumed
        yet)."""
        with self._lock:
            return self._fail_next

    def creations(self, run_id: str) -> int:
        """Operations created for the run (a deduplicated create is not one)."""
        with self._lock:
            return sum(1 for op in self._ops.values() if op.run_id == run_id)

    def create_requests(self, run_id: str) -> int:
        """Create requests for the run the API acted on (deduplicated ones included)."""
        with self._lock:
            return self._create_requests.get(run_id, 0)

    def polls(self, op_id: str) -> int:
        """Status reads of the operation the API answered."""
        with self._lock:
            return self._polls.get(op_id, 0)

    def snapshot(self) -> ExternalState:
        with self._lock:
            return ExternalState(ops=dict(self._ops), create_requests=dict(self._create_requests))

    def reset(self) -> None:
        with self._lock:
            self._clear()

    # -- the API (the implementation's side) ---------------------------------------
    def _refuse(self) -> bool:
        with self._lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                self.refused += 1
                return True
            return False

    def _create(self, body: CreateOperation) -> tuple[int, ExternalOp]:
        with self._lock:
            self._create_requests[body.run_id] = self._create_requests.get(body.run_id, 0) + 1
            existing = self._by_key.get(body.idempotency_key)
            if existing is not None:
                return 200, self._ops[existing]
            op = ExternalOp(
                op_id=f"op-{len(self._ops) + 1}",
                run_id=body.run_id,
                branch=body.branch,
                idempotency_key=body.idempotency_key,
                status=ExternalStatus.IN_PROGRESS,
            )
            self._ops[op.op_id] = op
            self._by_key[body.idempotency_key] = op.op_id
            return 201, op

    def _get(self, op_id: str) -> ExternalOp | None:
        with self._lock:
            op = self._ops.get(op_id)
            if op is not None:
                self._polls[op_id] = self._polls.get(op_id, 0) + 1
            return op


def _op_json(op: ExternalOp) -> dict:
    return {"id": op.op_id, "run_id": op.run_id, "branch": op.branch, "status": op.status.value}


def _handler_for(api: OpsApi) -> type[BaseHTTPRequestHandler]:
    class Handler(JsonHandler):
        server_version = "knownstate-opsapi/1"

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def do_POST(self) -> None:
            raw = self._body()
            if api._refuse():
                return self._answer(503, {"error": "unavailable"})
            if self.path != "/operations":
                return self._answer(404, {"error": "not found"})
            try:
                body = CreateOperation.model_validate_json(raw)
            except ValidationError as e:
                return self._answer(400, {"error": str(e).splitlines()[0]})
            code, op = api._create(body)
            self._answer(code, _op_json(op))

        def do_GET(self) -> None:
            if api._refuse():
                return self._answer(503, {"error": "unavailable"})
            m = _OP_PATH.match(self.path)
            op = api._get(m.group(1)) if m else None
            if op is None:
                return self._answer(404, {"error": "no such operation"})
            self._answer(200, _op_json(op))

    return Handler
