"""The scheduler process (the model worker): loads the model, then serves over ZeroMQ.

Loop: drain the input socket (without blocking while there is work; with a short blocking poll
when idle, so an idle worker sleeps instead of spinning), handle each message, run one
`Scheduler.step()`, and send what it produced as one TokenOutputBatch — to the detokenizer
process, which turns ids into text and passes everything on to the engine. It exits on a Shutdown
message, on SIGTERM, or when its parent process is gone, so no orphan outlives the engine.

With tensor parallelism this process is rank 0: every forward it runs is first sent to the other
ranks (`run_tp_worker` processes, which only run forwards), and while idle it sends them a
keepalive, so a dead rank is noticed before the next request. A failed collective is fatal: the
held requests are aborted with the error, a Fatal goes to the engine, and the process exits.

Started with multiprocessing's "spawn" context (a fresh interpreter: torch and its thread pools
are never forked). This module imports nothing heavy at the top, so the parent can import it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import msgspec
import zmq

from ..request import GenerateInput, TokenOutput
from ..server_args import OPENMP_SETTINGS, ServerArgs, set_openmp_defaults
from .ipc import (
    SCHEDULER_IN,
    SCHEDULER_OUT,
    AbortReq,
    Codec,
    Fatal,
    Ready,
    RpcReply,
    RpcReq,
    Shutdown,
    TokenOutputBatch,
    ToScheduler,
    endpoint,
    pull_socket,
    push_socket,
    remove_ipc_dir,
)

logger = logging.getLogger(__name__)

# How long an idle worker sleeps in poll before re-checking its parent and SIGTERM.
IDLE_POLL_MS = 100
# How long the last messages (outputs, a Fatal) may take to leave when the process exits.
SEND_LINGER_MS = 1000
# Tensor parallelism: the longest rank 0 stays silent towards the other ranks while idle.
KEEPALIVE_S = 1.0


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
        # non-streaming requests: their outputs so far, sent as one when the request finishes
        self.quiet: set[str] = set()
        self.held: dict[str, TokenOutput] = {}
        self.stopping = False
        self.fatal: str | None = None  # set when the process cannot go on (a tensor-parallel rank is gone)

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
            if not msg.stream:
                self.quiet.add(msg.rid)
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
            if getattr(e, "fatal", False):  # parallel.RankFailure: the ranks can no longer step together
                self.fatal = str(e)
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
        sending = []
        for out in outputs:
            opts = self.detok_opts.pop(out.rid, None)
            if opts is not None:  # the request's first output: the detokenizer needs these
                out.skip_special_tokens, out.spaces_between_special_tokens = opts
            held = self.held.pop(out.rid, None)
            if held is not None:
                out = held.merged(out)
            if out.finish_reason is not None:
                self.live.discard(out.rid)
                self.quiet.discard(out.rid)
            elif out.rid in self.quiet:  # a non-streaming request: hold until it finishes
                self.held[out.rid] = out
                continue
            sending.append(out)
        if sending:
            self.send(TokenOutputBatch(outputs=sending))

    def _rpc(self, method: str) -> Any:
        s = self.scheduler
        if method == "flush_cache":
            return s.flush_cache()
        if method == "kv_slots_in_use":
            return s.kv_slots_in_use()
        if method == "get_server_info":
            return {
                "num_prompt_tokens": s.num_prompt_tokens,
                "num_cached_tokens": s.num_cached_tokens,
                "num_generated_tokens": s.num_generated_tokens,
                "num_retractions": s.num_retractions,
                "num_jump_forward_tokens": s.num_jump_forward_tokens,
                "max_total_num_tokens": s.num_slots,
                "cache_size": s.cache.total_size(),
                "free_slots": s.allocator.available(),
                "context_length": s.context_len,
                "num_running": len(s.running),
                "num_waiting": len(s.waiting),
                "tp_size": s.args.tp_size,
                **s.speculative_stats(),
            }
        raise ValueError(f"unknown method {method!r}")


def _abort(rid: str, message: str) -> TokenOutput:
    return TokenOutput(rid=rid, new_ids=[], finish_reason={"type": "abort", "message": message})


@contextlib.contextmanager
def openmp_environ(args: ServerArgs) -> Iterator[None]:
    """`set_openmp_defaults(args.omp_spincount)` for the processes started inside (scheduler,
    tensor-parallel ranks: they inherit the environment), then this process's environment back as
    it was. Set around `Process.start()`: a spawned child may load torch before our code runs."""
    saved = {k: os.environ.get(k) for k in OPENMP_SETTINGS}
    set_openmp_defaults(args.omp_spincount)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ready_info(scheduler: Any) -> dict[str, Any]:
    """What the engine process needs to know about the loaded model."""
    runner = scheduler.runner
    return {
        "model_path": runner.model_path,
        "tokenizer_path": runner.model_path,
        "context_len": scheduler.context_len,
        "num_slots": scheduler.num_slots,
        "vocab_size": runner.vocab_size,
        "eos_ids": sorted(scheduler.eos_ids),
        "hidden_size": runner.config.hidden_size,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "pid": os.getpid(),
        "tp_size": scheduler.args.tp_size,
    }


def run_scheduler(args: ServerArgs, ipc_dir: str, parent: int) -> None:
    """Process entry point: load the model from `args` (`args.model` already resolved to a local
    folder by the parent), send Ready (or Fatal), then serve until told to stop or until process
    `parent` (the engine's, passed in: by the time we run it may already be gone) is gone."""
    set_openmp_defaults(args.omp_spincount)  # unless inherited from the parent; before torch loads
    # Ctrl-C reaches the whole process group; the parent decides what happens to us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("plait").setLevel(args.log_level.upper())
    ctx = zmq.Context()
    recv = pull_socket(ctx, endpoint(ipc_dir, SCHEDULER_IN))
    out = push_socket(ctx, endpoint(ipc_dir, SCHEDULER_OUT), linger_ms=SEND_LINGER_MS)
    codec = Codec(ToScheduler)

    def send(msg: msgspec.Struct) -> None:
        out.send(codec.encode(msg))

    orphaned = fatal = False
    loading = threading.Event()
    loading.set()
    threading.Thread(target=_exit_if_orphaned_while, args=(loading, parent, ipc_dir), daemon=True).start()
    try:
        try:
            import torch

            from ..distributed.parallel import threads_per_rank

            torch.set_num_threads(threads_per_rank(args))
            from ..scheduler.scheduler import Scheduler

            scheduler = Scheduler(args)
        except Exception as e:  # reported to the parent, which raises it from Engine()
            send(
                Fatal(
                    message=str(e),
                    kind="value" if isinstance(e, ValueError) else "runtime",
                    traceback=traceback.format_exc(),
                )
            )
            return
        finally:
            loading.clear()
        # Everything loaded so far lives as long as the process: keep the collector from walking it
        # on every full collection while serving and again at exit (seconds with torch loaded).
        gc.freeze()
        send(Ready(info=ready_info(scheduler)))
        worker = SchedulerWorker(scheduler, send)
        try:
            orphaned = _serve(worker, recv, codec, parent)
        finally:
            scheduler.runner.close()  # releases the other tensor-parallel ranks
        if worker.fatal is not None:
            send(Fatal(message=worker.fatal))
            fatal = True
    finally:
        recv.close()
        out.close(linger=0 if orphaned else SEND_LINGER_MS)  # nobody left to read them
        ctx.term()
    if orphaned or os.getppid() != parent:  # a dead parent cannot remove its socket directory
        remove_ipc_dir(ipc_dir)
    if fatal:
        sys.exit(1)


def _exit_if_orphaned_while(loading: threading.Event, parent: int, ipc_dir: str | None) -> None:
    """Loading a large model takes long and cannot be interrupted from the serve loop: if the
    parent dies meanwhile, exit at once."""
    while loading.is_set():
        if os.getppid() != parent:
            if ipc_dir is not None:
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
    parallel = getattr(sched.runner, "channel", None) is not None
    last_sync = time.monotonic()
    while not (worker.stopping or terminated or worker.fatal):
        if os.getppid() != parent:
            logger.warning("the engine process is gone; the scheduler exits")
            return True
        if not sched.has_work():
            poller.poll(IDLE_POLL_MS)
            if parallel and time.monotonic() - last_sync > KEEPALIVE_S:
                last_sync = time.monotonic()
                try:
                    sched.runner.keepalive()
                except RuntimeError as e:  # parallel.RankFailure
                    logger.error("%s", e)
                    worker.fatal = str(e)
                    break
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
            last_sync = time.monotonic()
    return False


# --- tensor parallelism: ranks > 0 -------------------------------------------------------------
def tp_worker_processes(args: ServerArgs, ipc_dir: str | None, parent: int) -> list:
    """This node's tensor-parallel ranks other than rank 0 (all of them on nodes > 0), as spawn
    processes not yet started. `args.dist_init_addr` must be set."""
    import multiprocessing as mp

    from ..distributed.parallel import ranks_on_this_node

    spawn = mp.get_context("spawn")
    return [
        spawn.Process(target=run_tp_worker, args=(args, rank, ipc_dir, parent), name=f"tp rank {rank}", daemon=True)
        for rank in ranks_on_this_node(args)
        if rank != 0
    ]


def free_loopback_addr() -> str:
    """`127.0.0.1:PORT` with a port free now: the single-node default for `dist_init_addr`."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_tp_worker(args: ServerArgs, rank: int, ipc_dir: str | None, parent: int) -> None:
    """Process entry point of tensor-parallel rank `rank` > 0: load this rank's shard, then run the
    forwards rank 0 sends until it says stop. Exits (code 1) when rank 0 is gone or the group
    fails, and at once when process `parent` is gone. A load failure is reported to the engine
    as a Fatal when `ipc_dir` is given (on node 0)."""
    set_openmp_defaults(args.omp_spincount)  # unless inherited from the parent; before torch loads
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("plait").setLevel(args.log_level.upper())
    alive = threading.Event()
    alive.set()  # for the whole life of the process: the main thread blocks in collectives
    threading.Thread(target=_exit_if_orphaned_while, args=(alive, parent, None), daemon=True).start()
    try:
        from ..model_executor.model_runner import ModelRunner

        runner = ModelRunner(args, rank)
    except Exception as e:
        logger.error("tensor-parallel rank %d failed to start: %s", rank, e)
        if ipc_dir is not None:
            _send_fatal(
                ipc_dir,
                Fatal(
                    message=str(e),
                    kind="value" if isinstance(e, ValueError) else "runtime",
                    traceback=traceback.format_exc(),
                    process=f"tp rank {rank}",
                ),
            )
        sys.exit(1)
    gc.freeze()  # as in run_scheduler
    code = 0
    try:
        runner.follow()
    except RuntimeError as e:  # RankFailure: rank 0 is gone; the engine hears of it from rank 0 or its exit
        logger.warning("tensor-parallel rank %d stops: %s", rank, e)
        code = 1
    finally:
        runner.close()
    from ..distributed.parallel import exit_rank

    exit_rank(code)


def _send_fatal(ipc_dir: str, msg: Fatal) -> None:
    ctx = zmq.Context()
    sock = push_socket(ctx, endpoint(ipc_dir, SCHEDULER_OUT), linger_ms=SEND_LINGER_MS)
    try:
        sock.send(Codec(ToScheduler).encode(msg))
    finally:
        sock.close()
        ctx.term()
