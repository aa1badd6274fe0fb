"""The scheduler process (the model worker): loads the model, then serves over ZeroMQ.

Loop: drain the input socket (without blocking while there is work; with a short blocking poll
when idle, so an idle worker sleeps instead of spinning), handle each message, run one
`Scheduler.step()`, and send what it produced as one TokenOutputBatch — to the detokenizer
process, which turns ids into text and passes everything on to the engine. It exits on a Shutdown
message, on SIGTERM, or when its parent process is gone, so no orphan outlives the engine.

Started with multiprocessing's "spawn" context (a fresh interpreter: torch and its thread pools
are never forked). This module imports nothing heavy at the top, so the parent can import it.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable

import msgspec
import zmq

from .ipc import (SCHEDULER_IN, SCHEDULER_OUT, AbortReq, Codec, Fatal, Ready, RpcReply, RpcReq, Shutdown,
                  ToScheduler, TokenOutputBatch, endpoint, pull_socket, push_socket, remove_ipc_dir)
from .request import GenerateInput, TokenOutput
from .server_args import ServerArgs

logger = logging.getLogger(__name__)

# How long an idle worker sleeps in poll before re-checking its parent and SIGTERM.
IDLE_POLL_MS = 100
# How long the last messages (outputs, a Fatal) may take to leave when the process exits.
SEND_LINGER_MS = 1000


class SchedulerWorker:
    """Message handling of the scheduler process, apart from sockets (tests drive it directly).

    `send` is called with each outgoing message. `live` tracks the requests the scheduler holds,
    so that a failed step can finish every one of them instead of leaving callers waiting.
    """

    def __init__(self, scheduler: Any, send: Callable[[msgspec.Struct], None]):
        self.scheduler = scheduler
        self.send = send
        self.live: set[str] = set()
        # rid -> detokenization options, attached to the request's first output (then dropped)
        self.detok_opts: dict[str, tuple[bool, bool]] = {}
        self.stopping = False

    def handle(self, msg: Any) -> None:
        """Act on one incoming message."""
        if isinstance(msg, GenerateInput):
            try:
                self.scheduler.add_request(msg)
            except Exception as e:  # ValueError: a request that can never run; else a bug
                self._emit([_abort(msg.rid, str(e))])
                return
            self.live.add(msg.rid)
            self.detok_opts[msg.rid] = (msg.params.skip_special_tokens, msg.params.spaces_between_special_tokens)
        elif isinstance(msg, AbortReq):
            out = self.scheduler.abort_request(msg.rid)
            if out is not None:
                self._emit([out])
        elif isinstance(msg, RpcReq):
            try:
                self.send(RpcReply(id=msg.id, result=self._rpc(msg.method)))
            except Exception as e:
                self.send(RpcReply(id=msg.id, error=f"{type(e).__name__}: {e}"))
        elif isinstance(msg, Shutdown):
            self.stopping = True

    def step(self) -> None:
        """Run one scheduler step and send its outputs; a failing step finishes every request it
        holds with an abort naming the error, and the worker keeps serving."""
        try:
            outputs = self.scheduler.step()
        except Exception as e:
            logger.exception("scheduler step failed")
            outputs = self._abort_all(f"internal error: {type(e).__name__}: {e}")
        self._emit(outputs)

    def _abort_all(self, message: str) -> list[TokenOutput]:
        outputs = []
        for rid in sorted(self.live):
            try:
                out = self.scheduler.abort_request(rid) or TokenOutput(rid=rid, new_ids=[])
            except Exception:  # state may be broken after a failed step; the caller still hears
                logger.exception("could not release request %s", rid)
                out = TokenOutput(rid=rid, new_ids=[])
            out.finish_reason = {"type": "abort", "message": message}
            outputs.append(out)
        return outputs

    def _emit(self, outputs: list[TokenOutput]) -> None:
        if not outputs:
            return
        for out in outputs:
            opts = self.detok_opts.pop(out.rid, None)
            if opts is not None:   # the request's first output: the detokenizer needs these
                out.skip_special_tokens, out.spaces_between_special_tokens = opts
            if out.finish_reason is not None:
                self.live.discard(out.rid)
        self.send(TokenOutputBatch(outputs=outputs))

    def _rpc(self, method: str) -> Any:
        s = self.scheduler
        if method == "flush_cache":
            return s.flush_cache()
        if method == "kv_slots_in_use":
            return s.kv_slots_in_use()
        if method == "get_server_info":
            return {"num_prompt_tokens": s.num_prompt_tokens, "num_cached_tokens": s.num_cached_tokens,
                    "num_generated_tokens": s.num_generated_tokens, "num_retractions": s.num_retractions, "num_jump_forward_tokens": s.num_jump_forward_tokens,
                    "max_total_num_tokens": s.num_slots, "cache_size": s.cache.total_size(),
                    "free_slots": s.allocator.available(), "context_length": s.context_len,
                    "num_running": len(s.running), "num_waiting": len(s.waiting)}
        raise ValueError(f"unknown method {method!r}")


def _abort(rid: str, message: str) -> TokenOutput:
    return TokenOutput(rid=rid, new_ids=[], finish_reason={"type": "abort", "message": message})


def ready_info(scheduler: Any) -> dict[str, Any]:
    """What the engine process needs to know about the loaded model."""
    runner = scheduler.runner
    return {"model_path": runner.model_path, "tokenizer_path": runner.model_path,
            "context_len": scheduler.context_len, "num_slots": scheduler.num_slots,
            "vocab_size": runner.vocab_size, "eos_ids": sorted(scheduler.eos_ids),
            "dtype": str(runner.dtype).removeprefix("torch."), "device": str(runner.device), "pid": os.getpid()}


def run_scheduler(args: ServerArgs, ipc_dir: str, parent: int) -> None:
    """Process entry point: load the model from `args` (`args.model` already resolved to a local
    folder by the parent), send Ready (or Fatal), then serve until told to stop or until process
    `parent` (the engine's, passed in: by the time we run it may already be gone) is gone."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch is imported
    # Ctrl-C reaches the whole process group; the parent decides what happens to us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("plait").setLevel(args.log_level.upper())
    ctx = zmq.Context()
    recv = pull_socket(ctx, endpoint(ipc_dir, SCHEDULER_IN))
    out = push_socket(ctx, endpoint(ipc_dir, SCHEDULER_OUT), linger_ms=SEND_LINGER_MS)
    codec = Codec(ToScheduler)

    def send(msg: msgspec.Struct) -> None:
        out.send(codec.encode(msg))

    orphaned = False
    loading = threading.Event()
    loading.set()
    threading.Thread(target=_exit_if_orphaned_while, args=(loading, parent, ipc_dir), daemon=True).start()
    try:
        try:
            import torch
            torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
            from .scheduler import Scheduler
            scheduler = Scheduler(args)
        except Exception as e:  # reported to the parent, which raises it from Engine()
            send(Fatal(message=str(e), kind="value" if isinstance(e, ValueError) else "runtime",
                       traceback=traceback.format_exc()))
            return
        finally:
            loading.clear()
        send(Ready(info=ready_info(scheduler)))
        orphaned = _serve(SchedulerWorker(scheduler, send), recv, codec, parent)
    finally:
        recv.close()
        out.close(linger=0 if orphaned else SEND_LINGER_MS)   # nobody left to read them
        ctx.term()
    if orphaned or os.getppid() != parent:   # a dead parent cannot remove its socket directory
        remove_ipc_dir(ipc_dir)


def _exit_if_orphaned_while(loading: threading.Event, parent: int, ipc_dir: str) -> None:
    """Loading a large model takes long and cannot be interrupted from the serve loop: if the
    parent dies meanwhile, exit at once."""
    while loading.is_set():
        if os.getppid() != parent:
            remove_ipc_dir(ipc_dir)
            os._exit(1)
        time.sleep(0.5)


def _serve(worker: SchedulerWorker, recv: zmq.Socket, codec: Codec, parent: int) -> bool:
    """Serve until told to stop (False) or until the parent process is gone (True)."""
    terminated = []
    # Only once serving: while loading, SIGTERM keeps its default (die now).
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    sched = worker.scheduler
    while not (worker.stopping or terminated):
        if os.getppid() != parent:
            logger.warning("the engine process is gone; the scheduler exits")
            return True
        if not sched.has_work():
            poller.poll(IDLE_POLL_MS)
        while True:
            try:
                data = recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                worker.handle(codec.decode(data))
            except Exception:  # a bad message or a bug in handling one: keep serving
                logger.exception("could not handle a message")
        if sched.has_work() and not worker.stopping:
            worker.step()
    return False
