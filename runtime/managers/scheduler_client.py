"""The engine's handle on the scheduler and detokenizer processes: start them, send the scheduler
requests and calls, and route what comes back (through the detokenizer, which adds the text) to
each request's sink.

One background thread receives. It also watches both processes: if either dies, every pending
request finishes with an abort naming the process and the cause, pending calls raise, and later
use raises RuntimeError — nothing waits forever on a process that is gone.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

import msgspec
import zmq

from ..request import GenerateInput, TokenOutput
from ..server_args import ServerArgs
from .detokenizer_process import run_detokenizer
from .ipc import (
    DETOKENIZER_OUT,
    SCHEDULER_IN,
    SCHEDULER_OUT,
    AbortReq,
    Codec,
    Fatal,
    FromDetokenizer,
    Ready,
    RpcReply,
    RpcReq,
    Shutdown,
    TokenOutputBatch,
    endpoint,
    make_ipc_dir,
    pull_socket,
    push_socket,
    remove_ipc_dir,
)
from .scheduler_process import free_loopback_addr, openmp_environ, run_scheduler, tp_worker_processes

logger = logging.getLogger(__name__)

Sink = Callable[[TokenOutput], None]

# How often the receiver re-checks shutdown when nothing arrives (death wakes it at once).
RECV_POLL_MS = 200
# How long, once the scheduler has exited during start-up, its Fatal may take to come through the
# detokenizer (which may itself still be loading the tokenizer).
LATE_FATAL_S = 10.0
# Grace periods when stopping a process: after Shutdown, then after SIGTERM.
STOP_TIMEOUT_S = 5.0
TERM_TIMEOUT_S = 2.0

_MAIN_GUARD_HINT = (
    "if a script creates the Engine when it is imported, put that under "
    "`if __name__ == '__main__':` (the scheduler process is started with multiprocessing "
    "'spawn', which imports the main module again)"
)


class SchedulerClient:
    """Starts the scheduler process (`args.model` is replaced by the resolved `model_path`, so the
    child does not resolve or convert it again) and the detokenizer process; `wait_ready()` returns
    the scheduler's Ready info.

    Wiring: this process -> SCHEDULER_IN -> scheduler -> SCHEDULER_OUT -> detokenizer ->
    DETOKENIZER_OUT -> this process (and this process -> SCHEDULER_OUT, for the detokenizer's
    Shutdown)."""

    def __init__(self, args: ServerArgs, model_path: str):
        self.ipc_dir = make_ipc_dir()
        self._ctx = zmq.Context()
        self._recv = pull_socket(self._ctx, endpoint(self.ipc_dir, DETOKENIZER_OUT))
        self._send = push_socket(self._ctx, endpoint(self.ipc_dir, SCHEDULER_IN))
        self._send_detok = push_socket(self._ctx, endpoint(self.ipc_dir, SCHEDULER_OUT))
        self._codec = Codec(FromDetokenizer)  # encode under _lock; decode on the receiver only
        self._lock = threading.Lock()  # guards _send, _sinks, _rpcs, error
        self._sinks: dict[str, Sink] = {}
        # Aborts that arrived before their request was submitted (a client racing its own
        # request); bounded, oldest forgotten first.
        self._early_aborts: dict[str, None] = {}
        self._recently_done: dict[str, None] = {}  # so aborting a finished rid is not "early"
        self._rpcs: dict[int, Future] = {}
        self._ids = itertools.count()
        self.error: str | None = None  # set once the processes can no longer be used
        self._closed = False
        self._thread: threading.Thread | None = None
        child_args = dataclasses.replace(args, model=model_path)
        if args.tp_size > 1 and not args.dist_init_addr:  # single node: rank 0's store on loopback
            child_args.dist_init_addr = free_loopback_addr()
        spawn = mp.get_context("spawn")
        # daemon: multiprocessing terminates them at interpreter exit even if nobody shuts down.
        self.process = spawn.Process(
            target=run_scheduler, args=(child_args, self.ipc_dir, os.getpid()), name="plait-scheduler", daemon=True
        )
        self.detokenizer = spawn.Process(
            target=run_detokenizer,
            args=(model_path, self.ipc_dir, os.getpid(), args.log_level),
            name="plait-detokenizer",
            daemon=True,
        )
        # Tensor parallelism: ranks > 0, which only run the forwards rank 0 (the scheduler) sends.
        self.tp_workers = tp_worker_processes(child_args, self.ipc_dir, os.getpid())
        try:
            with openmp_environ(args):
                self.process.start()
                for proc in self.tp_workers:
                    proc.start()
            self.detokenizer.start()
        except BaseException:
            self.close()
            raise

    def _processes(self) -> list[tuple[str, Any]]:
        return [("scheduler", self.process), ("detokenizer", self.detokenizer)] + [
            (proc.name, proc) for proc in self.tp_workers
        ]

    # --- start-up ------------------------------------------------------------------------------
    def wait_ready(self) -> dict[str, Any]:
        """Block until the model is loaded; raise the child's error (ValueError for bad input such
        as an unusable device, RuntimeError otherwise) if it fails or exits first."""
        poller = zmq.Poller()
        poller.register(self._recv, zmq.POLLIN)
        for _, proc in self._processes():
            poller.register(proc.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(RECV_POLL_MS))
                if self._recv in events:
                    msg = self._codec.decode(self._recv.recv())
                    if isinstance(msg, Ready):
                        self.info = msg.info
                        break
                    if isinstance(msg, Fatal):
                        if msg.kind == "value":
                            raise ValueError(msg.message)
                        raise RuntimeError(f"the {msg.process} process failed to start: {msg.message}\n{msg.traceback}")
                    continue
                for name, proc in self._processes():
                    if proc.is_alive():
                        continue
                    # A Fatal sent just before exiting may still be on its way (the scheduler's
                    # through the detokenizer, which may still be loading).
                    wait = LATE_FATAL_S if name == "scheduler" and self.detokenizer.is_alive() else 0.5
                    if self._recv.poll(int(wait * 1000)):
                        break
                    what = "the tokenizer was loaded" if name == "detokenizer" else "the model was loaded"
                    raise RuntimeError(
                        f"the {name} process exited with code {proc.exitcode} "
                        f"before {what} (its error output is above); {_MAIN_GUARD_HINT}"
                    )
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._receive_loop, name="plait-receiver", daemon=True)
        self._thread.start()
        return self.info

    # --- requests and calls --------------------------------------------------------------------
    def submit(self, inputs: list[GenerateInput], sink: Sink) -> None:
        """Send requests; each of their outputs is passed to `sink` (on the receiver thread)."""
        with self._lock:
            self._check()
            try:
                frames = [self._codec.encode(inp) for inp in inputs]
            except (msgspec.EncodeError, OverflowError, TypeError, NotImplementedError) as e:
                raise ValueError(f"the request cannot be sent to the scheduler: {e}") from None
            for inp in inputs:
                self._sinks[inp.rid] = sink
                self._recently_done.pop(inp.rid, None)
            for frame in frames:
                self._send.send(frame)
            for inp in inputs:
                if self._early_aborts.pop(inp.rid, 1) is None:
                    self._send.send(self._codec.encode(AbortReq(rid=inp.rid)))

    def abort(self, rid: str) -> None:
        """Ask the scheduler to abort `rid`; a no-op once the scheduler is gone."""
        with self._lock:
            if self.error is None:
                if rid not in self._sinks and rid not in self._recently_done:
                    _remember(self._early_aborts, rid)
                self._send.send(self._codec.encode(AbortReq(rid=rid)))

    def call(self, method: str) -> Any:
        """Run a scheduler method by name in the scheduler process (between steps) and return
        its result."""
        fut: Future = Future()
        with self._lock:
            self._check()
            rpc_id = next(self._ids)
            self._rpcs[rpc_id] = fut
            self._send.send(self._codec.encode(RpcReq(id=rpc_id, method=method)))
        return fut.result()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)

    # --- receiving ----------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._recv, zmq.POLLIN)
        sentinels = {proc.sentinel: (name, proc) for name, proc in self._processes()}
        for sentinel in sentinels:
            poller.register(sentinel, zmq.POLLIN)
        cause = "the scheduler's receiver stopped"
        try:
            while not self._closed:
                events = dict(poller.poll(RECV_POLL_MS))
                if self._closed:
                    return
                if self._recv in events:
                    while not self._closed:  # drain before looking at the process again
                        try:
                            data = self._recv.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(self._codec.decode(data))
                else:
                    for sentinel, (name, proc) in sentinels.items():
                        if sentinel in events:
                            proc.join(1.0)  # reap it, for the exit code
                            cause = f"the {name} process died unexpectedly (exit code {proc.exitcode})"
                            return
        except Exception as e:  # a bug here must not leave callers waiting
            if self._closed:
                return
            logger.exception("the scheduler receiver failed")
            cause = f"the scheduler receiver failed: {type(e).__name__}: {e}"
        finally:
            if not self._closed:
                self._fail(cause)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenOutputBatch):
            with self._lock:
                routed = [
                    (self._sinks.get(o.rid) if o.finish_reason is None else self._sinks.pop(o.rid, None), o)
                    for o in msg.outputs
                ]
                for o in msg.outputs:
                    if o.finish_reason is not None:
                        _remember(self._recently_done, o.rid)
            for sink, out in routed:
                if sink is not None:
                    _deliver(sink, out)
        elif isinstance(msg, RpcReply):
            with self._lock:
                fut = self._rpcs.pop(msg.id, None)
            if fut is not None:
                if msg.error is None:
                    fut.set_result(msg.result)
                else:
                    fut.set_exception(RuntimeError(msg.error))
        elif isinstance(msg, Fatal):
            self._fail(f"the {msg.process} process failed: {msg.message}")

    def _fail(self, cause: str) -> None:
        """Mark the scheduler unusable and finish everything that waits on it."""
        with self._lock:
            if self.error is None:
                self.error = cause
            sinks, self._sinks = self._sinks, {}
            rpcs, self._rpcs = self._rpcs, {}
        if sinks:
            logger.warning("%s; finishing %d pending request(s)", cause, len(sinks))
        for rid, sink in sinks.items():
            _deliver(sink, TokenOutput(rid=rid, new_ids=[], finish_reason={"type": "abort", "message": cause}))
        for fut in rpcs.values():
            fut.set_exception(RuntimeError(cause))

    # --- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish pending requests (abort), stop and reap both processes, close the sockets and
        remove the socket directory. Idempotent; safe from any thread."""
        if self._closed:
            return
        self._fail("the engine was shut down")
        self._closed = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=RECV_POLL_MS / 1000 * 5)
        serving = thread is not None
        # tensor-parallel ranks > 0 have no socket: rank 0 stops them when it stops
        socks = (self._send, self._send_detok) + (None,) * len(self.tp_workers)
        procs = [
            (name, proc, sock) for (name, proc), sock in zip(self._processes(), socks) if proc.pid is not None
        ]  # those that were started
        if serving:  # ask both to stop at once; while they load, SIGTERM stops them at once
            for _, proc, sock in procs:
                if sock is None:
                    continue
                try:
                    sock.send(self._codec.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            for _, proc, _ in procs:
                proc.join(STOP_TIMEOUT_S)
        for name, proc, _ in procs:
            if proc.is_alive():
                if serving:
                    logger.warning("the %s process did not stop; terminating it", name)
                proc.terminate()
        for _, proc, _ in procs:
            proc.join(TERM_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._send.close(linger=0)
        self._send_detok.close(linger=0)
        self._recv.close(linger=0)
        self._ctx.term()
        remove_ipc_dir(self.ipc_dir)


def _remember(bounded: dict[str, None], rid: str, limit: int = 4096) -> None:
    """Add rid to an insertion-ordered set that forgets its oldest entries past `limit`."""
    bounded[rid] = None
    if len(bounded) > limit:
        del bounded[next(iter(bounded))]


def _deliver(sink: Sink, out: TokenOutput) -> None:
    try:
        sink(out)
    except Exception:  # e.g. the caller's event loop is closed; other requests go on
        logger.debug("a result sink failed for %s", out.rid, exc_info=True)
