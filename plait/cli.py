"""The `plait` command: `plait serve ...` runs the HTTP server, `plait bench NAME ...` a benchmark."""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys

# Before torch is imported (see plait/__init__.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default, bundled), a .gguf file, a HF folder or a hub id")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route except /health")
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: --model)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="generate requests the server holds at once; more get 503 with Retry-After")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--kv-memory-fraction", type=float, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--schedule-policy", default=None, choices=["lpm", "fcfs"])
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


# CLI option -> ServerArgs field; None means "the engine's default".
_ENGINE_OPTIONS = ("model", "dtype", "device", "context_length", "max_total_tokens", "kv_memory_fraction",
                   "chunked_prefill_size", "max_running_requests", "schedule_policy", "disable_radix_cache",
                   "num_threads", "random_seed", "log_level")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `plait`."""
    parser = argparse.ArgumentParser(prog="plait", description="plait: structured-generation runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server (native + OpenAI-compatible API)")
    _add_serve_args(serve)
    bench = sub.add_parser("bench", help="run a benchmark: plait bench NAME [ARGS...] (e.g. offline)")
    bench.add_argument("name", help="benchmark name, e.g. offline")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    return parser


def _fail(message: str, code: int = 1) -> int:
    print(f"plait: error: {message}", file=sys.stderr)
    return code


def serve(ns: argparse.Namespace) -> int:
    """`plait serve`: validate, bind the port (fail fast), load the model, serve until signalled."""
    from plait.runtime.http_server import bind_socket, run_server
    from plait.runtime.server_args import ServerArgs
    if not 0 < ns.port < 65536:
        return _fail(f"--port must be in 1..65535, got {ns.port}", 2)
    if ns.max_queued_requests < 0:
        return _fail(f"--max-queued-requests must be >= 0, got {ns.max_queued_requests}", 2)
    try:
        args = ServerArgs.from_kwargs(**{k: getattr(ns, k) for k in _ENGINE_OPTIONS if getattr(ns, k) is not None})
    except ValueError as e:
        return _fail(str(e), 2)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return _fail(f"port {ns.port} on {ns.host} is already in use (choose another with --port)")
        return _fail(f"cannot listen on {ns.host}:{ns.port}: {e.strerror or e}")
    try:
        run_server(args, ns.host, ns.port, ns.api_key, ns.max_queued_requests, ns.served_model_name, sock=sock)
    except KeyboardInterrupt:
        pass
    except Exception as e:   # e.g. a model that does not load: one line, not a traceback
        logging.getLogger("plait").debug("serve failed", exc_info=True)
        return _fail(f"{type(e).__name__}: {e}")
    return 0


def bench(name: str, argv: list[str]) -> int:
    """`plait bench NAME ...`: call `plait.benchmarks.NAME.main(argv)` (the repository's benchmarks/)."""
    if not name.isidentifier():
        return _fail(f"unknown benchmark {name!r}", 2)
    try:
        module = importlib.import_module(f"plait.benchmarks.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("plait.benchmarks", f"plait.benchmarks.{name}"):
            raise
        return _fail(f"benchmark {name!r} is not available (no benchmarks/{name}.py)", 2)
    result = module.main(argv)
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `plait` console script."""
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        return serve(ns)
    return bench(ns.name, ns.args)


if __name__ == "__main__":
    sys.exit(main())
