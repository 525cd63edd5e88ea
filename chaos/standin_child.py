"""The child of a stand-in process (:mod:`.standin`): ``python -m
knownstate.chaos.standin_child module:Class [ARG ...]`` builds ``Class(*ARGS)``, starts it, and
answers its parent's frames (one pickled frame each way: a call, its answer or what it raised)
until its stdin closes. It imports nothing of knownstate but the stand-in it runs, so a stand-in
starts in the time its own module takes to import."""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        part = stream.read(n - len(data))
        if not part:
            return None
        data += part
    return data


def receive(stream: BinaryIO) -> Any:
    """The next frame, or raises EOFError when the other side is gone."""
    header = read_exactly(stream, _HEADER.size)
    data = header and read_exactly(stream, _HEADER.unpack(header)[0])
    if data is None:
        raise EOFError
    return pickle.loads(data)


def serve(target: str, *args: str) -> None:
    """Run ``module:Class`` (built with ``args``) and answer the parent's frames until its stdin
    closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it; a Ctrl-C is the parent's
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the stand-in prints goes to the log, never into a frame
    frames_in = os.fdopen(0, "rb")
    module, _, qualname = target.partition(":")
    part = getattr(importlib.import_module(module), qualname)(*args).start()
    try:
        send(frames_out, ("ready", part.host, part.port))
        while True:
            try:
                op, name, args, kwargs = receive(frames_in)
            except EOFError:
                return
            send(frames_out, _answer(part, op, name, args, kwargs))
    finally:
        part.stop()


def _answer(part: Any, op: str, name: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
    try:
        if name.startswith("_"):
            raise AttributeError(f"{type(part).__name__} keeps {name} to itself")
        value = getattr(part, name)
        if op == "get":
            return ("method", None) if callable(value) else ("value", value)
        answer = ("value", value(*args, **kwargs))
    except Exception as e:  # raised again in the parent
        answer = ("raise", e)
    try:
        pickle.dumps(answer)
    except Exception as e:
        return "raise", RuntimeError(f"{type(part).__name__}.{name}: {type(e).__name__}: {e}")
    return answer


if __name__ == "__main__":
    serve(*sys.argv[1:])
