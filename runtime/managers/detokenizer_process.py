"""The detokenizer process: turns the scheduler's token ids into text, off the engine's process.

It sits between the scheduler and the engine: it receives everything the scheduler sends
(SCHEDULER_OUT), fills `TokenOutput.text_delta` of each output with the request's new stable text
(one IncrementalDetokenizer per request, dropped when the request finishes), and passes every
message on to the engine (DETOKENIZER_OUT) unchanged otherwise and in order. Stop strings are
trimmed by the engine, which sees the whole text.

It loads only the tokenizer and runs no model. It exits on a Shutdown message (from the engine),
on SIGTERM, or when its parent process is gone. Started with multiprocessing's "spawn" context;
this module imports nothing heavy at the top, so the parent can import it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

import zmq

from ..request import TokenOutput
from .detokenizer import IncrementalDetokenizer
from .ipc import (
    DETOKENIZER_OUT,
    SCHEDULER_OUT,
    Codec,
    Fatal,
    Shutdown,
    ToDetokenizer,
    TokenOutputBatch,
    endpoint,
    pull_socket,
    push_socket,
    remove_ipc_dir,
)

logger = logging.getLogger(__name__)

# How long an idle detokenizer sleeps in poll before re-checking its parent and SIGTERM.
IDLE_POLL_MS = 100
# How long the last messages may take to leave when the process exits.
SEND_LINGER_MS = 1000


class DetokenizerWorker:
    """The detokenization state of every request in flight, apart from sockets (tests drive it
    directly): `handle(msg)` returns the message to pass on."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, TokenOutputBatch):
            for out in msg.outputs:
                self.detokenize(out)
        return msg

    def detokenize(self, out: TokenOutput) -> None:
        """Fill `out.text_delta`; forget the request once it is finished."""
        reason = out.finish_reason
        state = self.states.get(out.rid)
        try:
            if state is None:
                skip = True if out.skip_special_tokens is None else out.skip_special_tokens
                spaces = True if out.spaces_between_special_tokens is None else out.spaces_between_special_tokens
                state = IncrementalDetokenizer(self.tokenizer, skip, spaces)
                if reason is None:
                    self.states[out.rid] = state
            new = out.new_ids
            # EOS / stop-token ids are counted but never shown as text.
            if reason is not None and isinstance(reason.get("matched"), int) and new and new[-1] == reason["matched"]:
                new = new[:-1]
            out.text_delta = state.add(new, final=reason is not None) if (new or reason is not None) else ""
        except Exception as e:  # a bug, or ids the tokenizer cannot decode: the caller still hears
            logger.exception("could not detokenize the output of %s", out.rid)
            out.text_delta = ""
            out.finish_reason = reason = {
                "type": "abort",
                "message": f"internal error: detokenization failed: {type(e).__name__}: {e}",
            }
        # the options have done their work; the engine does not need them
        out.skip_special_tokens = out.spaces_between_special_tokens = None
        if reason is not None:
            self.states.pop(out.rid, None)


def run_detokenizer(model_path: str, ipc_dir: str, parent_pid: int, log_level: str = "info") -> None:
    """Process entry point: load the tokenizer of `model_path` (a resolved local folder), then
    serve until told to stop or until process `parent_pid` is gone. If the tokenizer cannot be
    loaded, the engine hears a Fatal (it does not wait on Ready from the scheduler forever)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch may be imported
    os.environ["OMP_NUM_THREADS"] = "1"
    # Ctrl-C reaches the whole process group; the parent decides what happens to us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("plait").setLevel(log_level.upper())
    ctx = zmq.Context()
    recv = pull_socket(ctx, endpoint(ipc_dir, SCHEDULER_OUT))
    out = push_socket(ctx, endpoint(ipc_dir, DETOKENIZER_OUT), linger_ms=SEND_LINGER_MS)
    codec = Codec(ToDetokenizer)
    orphaned = False
    try:
        try:
            from ..model_executor.model_loader import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        except Exception as e:
            out.send(
                codec.encode(
                    Fatal(
                        message=f"could not load the tokenizer: {e}",
                        process="detokenizer",
                        traceback=traceback.format_exc(),
                    )
                )
            )
            return
        torch = sys.modules.get("torch")  # transformers may import it; no compute here
        if torch is not None:
            torch.set_num_threads(1)
        orphaned = _serve(DetokenizerWorker(tokenizer), recv, out, codec, parent_pid)
    finally:
        recv.close()
        out.close(linger=0 if orphaned else SEND_LINGER_MS)
        ctx.term()
    if orphaned or os.getppid() != parent_pid:  # a dead parent cannot remove its socket directory
        remove_ipc_dir(ipc_dir)


def _serve(worker: DetokenizerWorker, recv: zmq.Socket, out: zmq.Socket, codec: Codec, parent: int) -> bool:
    """Serve until told to stop (False) or until the parent process is gone (True)."""
    terminated: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    stopping = False
    while not (stopping or terminated):
        if os.getppid() != parent:
            logger.warning("the engine process is gone; the detokenizer exits")
            return True
        if not recv.poll(IDLE_POLL_MS):
            continue
        while not stopping:
            try:
                data = recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = codec.decode(data)
                if isinstance(msg, Shutdown):
                    stopping = True
                    break
                out.send(codec.encode(worker.handle(msg)))
            except Exception:  # a bad message or a bug in handling one: keep serving
                logger.exception("could not handle a message")
    return False
