"""ZeroMQ plumbing between the engine (server) process, the scheduler process and the
detokenizer process: engine -> scheduler -> detokenizer -> engine.

Sockets live in a private 0700 temp dir as `ipc://` paths. Every message is a msgspec Struct
of a tagged union, encoded with msgpack: typed, versionable, and never pickle (a peer that can
write to the socket cannot make us run code).

Wiring: each direction is one PUSH -> PULL pair; the receiver binds and the sender connects,
so a sender may send before its peer is up (ZeroMQ queues on a connecting socket).
"""

from __future__ import annotations

import numbers
import os
import shutil
import tempfile
from typing import Any, Union

import msgspec
import zmq

from ..request import GenerateInput, TokenOutput

# Where the scheduler receives (GenerateInput, AbortReq, ...) and where it sends results (the
# detokenizer binds SCHEDULER_OUT; the engine also connects to it, to send Shutdown), and where
# the detokenizer sends everything on to the engine.
SCHEDULER_IN = "scheduler_in"
SCHEDULER_OUT = "scheduler_out"
DETOKENIZER_OUT = "detokenizer_out"
# sun_path is 108 bytes on Linux; leave room for the socket name.
_MAX_DIR_LEN = 90


# --- messages to the scheduler --------------------------------------------------------------
class AbortReq(msgspec.Struct, tag=True):
    """Abort one request; its KV is released and it finishes with reason `abort`."""

    rid: str


class RpcReq(msgspec.Struct, tag=True):
    """Call a scheduler method by name (`flush_cache`, `kv_slots_in_use`, `get_server_info`)."""

    id: int
    method: str


class Shutdown(msgspec.Struct, tag=True):
    """Stop serving and exit."""


# --- messages from the scheduler ------------------------------------------------------------
class RpcReply(msgspec.Struct, tag=True):
    """The answer to RpcReq `id`: a JSON-able result, or an error message."""

    id: int
    result: Any = None
    error: str | None = None


class TokenOutputBatch(msgspec.Struct, tag=True):
    """Everything one scheduler step produced (one message per step, not per request)."""

    outputs: list[TokenOutput]


class Ready(msgspec.Struct, tag=True):
    """The model is loaded; `info` holds the facts the server side validates against."""

    info: dict[str, Any]


class Fatal(msgspec.Struct, tag=True):
    """The scheduler (or the detokenizer: `process`) cannot go on (or could not start). `kind` is
    `value` for bad input (raised as ValueError by the engine) and `runtime` for anything else."""

    message: str
    kind: str = "runtime"
    traceback: str = ""
    process: str = "scheduler"


ToScheduler = Union[GenerateInput, AbortReq, RpcReq, Shutdown]
FromScheduler = Union[TokenOutputBatch, RpcReply, Ready, Fatal]
# The detokenizer receives what the scheduler sends, and Shutdown from the engine; it sends the
# engine the same messages as the scheduler (FromScheduler), with TokenOutput.text_delta filled.
ToDetokenizer = Union[TokenOutputBatch, RpcReply, Ready, Fatal, Shutdown]
FromDetokenizer = FromScheduler


def _enc_hook(obj: Any) -> Any:
    # numpy scalars and other number types pass validation (numbers.Integral / Real); send them
    # as plain numbers.
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    raise NotImplementedError(f"cannot send objects of type {type(obj).__name__}")


class Codec:
    """msgpack encoder plus a decoder for one direction's union (not thread-safe: one per user)."""

    def __init__(self, incoming: Any):
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._dec = msgspec.msgpack.Decoder(incoming)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes) -> Any:
        return self._dec.decode(data)


# --- the private directory and sockets ------------------------------------------------------
def make_ipc_dir() -> str:
    """A fresh directory only this user can enter (mode 0700), short enough for socket paths."""
    base = None if len(tempfile.gettempdir()) < _MAX_DIR_LEN - 20 else "/tmp"
    path = tempfile.mkdtemp(prefix="plait-", dir=base)  # mkdtemp creates it 0700
    os.chmod(path, 0o700)
    return path


def remove_ipc_dir(path: str) -> None:
    """Remove the directory and its socket files (no error if already gone)."""
    shutil.rmtree(path, ignore_errors=True)


def endpoint(ipc_dir: str, name: str) -> str:
    """The `ipc://` address of socket `name` in `ipc_dir`."""
    return f"ipc://{os.path.join(ipc_dir, name)}"


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    """A bound PULL socket with an unbounded queue (senders never block on us)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str, linger_ms: int = 0) -> zmq.Socket:
    """A connected PUSH socket with an unbounded queue: `send` never blocks, even before the
    peer has bound or after it has gone (liveness is checked elsewhere)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.connect(addr)
    return sock
