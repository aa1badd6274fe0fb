"""`plait serve --dp-size N`: starting N replica servers (`plait serve` children on loopback
ports, the CPU threads split between them), waiting until they are healthy, the router in front,
and stopping the replicas with it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from .app import run_router
from .policy import make_policy
from .router import Router

REPLICA_START_TIMEOUT_S = 600.0


# --- plait serve --dp-size N --------------------------------------------------------------------
def _die_with_parent() -> None:
    """In a child, before exec: get SIGTERM when the parent dies, so replicas never outlive it."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def replica_command(engine_args: dict[str, Any], port: int, extra: Sequence[str] = ()) -> list[str]:
    """`plait serve` for one replica on loopback `port` with these engine arguments (its API key
    goes in the environment, PLAIT_API_KEY, where other users cannot read it)."""
    cmd = [sys.executable, "-m", "plait.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    for key, value in engine_args.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    return cmd


def replica_engine_args(engine_args: dict[str, Any], dp_size: int, index: int) -> dict[str, Any]:
    """One replica's engine arguments: the CPU threads split between replicas, and on CUDA one
    device each when no index was given."""
    args = dict(engine_args)
    threads = args.get("num_threads") or os.cpu_count() or 1
    args["num_threads"] = max(1, threads // dp_size)
    if args.get("device") == "cuda" and (args.get("tp_size") or 1) == 1:
        args["device"] = f"cuda:{index}"
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(zip(urls, procs))
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"replica {url} exited with code {proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    del pending[url]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {', '.join(pending)} did not become healthy in {timeout:.0f} s")
        time.sleep(0.2)


def _exit_quietly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _stop(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve_data_parallel(
    engine_args: dict[str, Any],
    dp_size: int,
    host: str,
    port: int,
    api_key: str | None,
    sock: socket.socket,
    replica_flags: Sequence[str] = (),
    policy: str = "cache_aware",
    log_level: str = "warning",
) -> None:
    """`plait serve --dp-size N`: N replica servers (`plait serve` children on loopback ports,
    the same engine arguments, the CPU threads split) and the router in front on host:port.
    The replicas are stopped with the router; they also die with this process."""
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises SIGTERM once it has stopped; exit through `finally` then, so that the
        # replicas are stopped and waited for rather than left to their parent-death signal.
        signal.signal(signal.SIGTERM, _exit_quietly)
    worker_key = secrets.token_urlsafe(24)  # the replicas answer only the router
    ports = [_free_port() for _ in range(dp_size)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PLAIT_API_KEY": worker_key}
    procs: list[subprocess.Popen] = []
    try:
        for i, p in enumerate(ports):
            cmd = replica_command(replica_engine_args(engine_args, dp_size, i), p, replica_flags)
            # preexec_fn: no thread of ours runs yet (the router starts after the replicas)
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    preexec_fn=_die_with_parent  # noqa: PLW1509
                    if sys.platform == "linux"
                    else None,
                )
            )
        _wait_healthy(procs, urls, REPLICA_START_TIMEOUT_S)
        router = Router(urls, make_policy(policy), worker_api_key=worker_key, pids=[p.pid for p in procs])
        shown = f"[{host}]" if ":" in host else host
        run_router(
            router,
            host,
            port,
            api_key,
            sock=sock,
            log_level=log_level,
            ready_message=f"plait: ready, serving {engine_args.get('model')} with {dp_size} replicas "
            f"at http://{shown}:{port}",
        )
    finally:
        _stop(procs)
