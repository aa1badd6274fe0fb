"""The `plait` command: `plait serve ...` runs the HTTP server, `plait bench NAME ...` a benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import logging
import os
import sys

from plait.runtime.server_args import PYTHON_ONLY, ServerArgs

# Before torch is imported (see plait/__init__.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """`plait serve`'s flags: the server's own, then one per ServerArgs field (help and choices from
    its definition in runtime/server_args.py)."""
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PLAIT_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route except /health (default: $PLAIT_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: --model)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="generate requests the server holds at once; more get 503 with Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a generate request may run; past it the request is aborted with a 504 error",
    )
    p.add_argument(
        "--log-requests", action="store_true", help="log each request body (prompts included); off by default"
    )
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="data parallelism: N engine replicas (child servers on loopback) behind a cache-aware router",
    )
    for f in dataclasses.fields(ServerArgs):
        if f.name in PYTHON_ONLY:
            continue
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if f.type == "bool":
            p.add_argument(flag, action="store_true", help=meta["help"])
        else:  # None: the engine's default (ServerArgs fills it in)
            p.add_argument(
                flag,
                type=_FIELD_TYPES[f.type.removesuffix(" | None")],
                default=None,
                choices=meta["choices"],
                help=meta["help"],
            )
    p.set_defaults(log_level="info")  # a server logs more than an in-process Engine


_FIELD_TYPES = {"str": str, "int": int, "float": float}  # ServerArgs' annotations (strings: PEP 563)
# The ServerArgs fields `plait serve` takes, each as --field-name; None means "the engine's default".
_ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(ServerArgs) if f.name not in PYTHON_ONLY)


def serve_flags_markdown() -> str:
    """docs/server_args.md: every `plait serve` flag with its default and meaning, from the parser
    and ServerArgs (tests/test_cli_docs.py checks the file is this)."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    rows = []
    for a in serve._actions:
        if not a.option_strings or a.dest == "help":
            continue
        default = a.default if a.default is not None else defaults.get(a.dest)
        shown = "" if default is None or default is False else f"`{default}`"
        if a.dest == "api_key":
            shown = "`$PLAIT_API_KEY`"
        choices = f" ({' / '.join(map(str, a.choices))})" if a.choices else ""
        text = " ".join((a.help or "").split()).replace("|", "\\|")
        rows.append(f"| `{a.option_strings[0]}` | {shown} | {text}{choices} |")
    return (
        "# `plait serve` flags\n\nGenerated from the parser (`plait/cli.py`) and `ServerArgs` "
        "(`runtime/server_args.py`); `plait.Engine(...)` takes the engine's flags as keyword arguments "
        "(`--max-total-tokens` is `max_total_tokens`). Regenerate with\n"
        "`python -c \"from plait.cli import serve_flags_markdown as m; print(m(), end='')\" > docs/server_args.md`.\n\n"
        "| flag | default | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `plait`."""
    parser = argparse.ArgumentParser(prog="plait", description="plait: structured-generation runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server (native + OpenAI-compatible API)")
    _add_serve_args(serve)
    _add_router_args(sub.add_parser("router", help="route requests over separately started plait servers"))
    bench = sub.add_parser("bench", help="run a benchmark: plait bench NAME [ARGS...] (e.g. offline)")
    bench.add_argument("name", help="benchmark name, e.g. offline")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    return parser


def _listen(host: str, port: int):
    """(the bound listening socket, None), or (None, exit code) after saying why it cannot be had."""
    from plait.runtime.server.http_common import bind_socket  # imports the server stack: only when serving

    try:
        return bind_socket(host, port), None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return None, _fail(f"port {port} on {host} is already in use (choose another with --port)")
        return None, _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def _fail(message: str, code: int = 1) -> int:
    print(f"plait: error: {message}", file=sys.stderr)
    return code


def serve(ns: argparse.Namespace) -> int:
    """`plait serve`: validate, bind the port (fail fast), load the model, serve until signalled."""
    from plait.runtime.server.http_server import run_server
    from plait.runtime.server_args import ServerArgs

    if not 0 < ns.port < 65536:
        return _fail(f"--port must be in 1..65535, got {ns.port}", 2)
    if ns.max_queued_requests < 0:
        return _fail(f"--max-queued-requests must be >= 0, got {ns.max_queued_requests}", 2)
    if ns.request_timeout is not None and not ns.request_timeout > 0:
        return _fail(f"--request-timeout must be > 0 seconds, got {ns.request_timeout}", 2)
    if ns.dp_size < 1:
        return _fail(f"--dp-size must be >= 1, got {ns.dp_size}", 2)
    try:
        args = ServerArgs.from_kwargs(**{k: getattr(ns, k) for k in _ENGINE_OPTIONS if getattr(ns, k) is not None})
    except ValueError as e:
        return _fail(str(e), 2)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:  # a worker node: no HTTP; its tensor-parallel ranks follow node 0's
        from plait.runtime.engine import run_worker_node

        return run_worker_node(args)
    sock, rc = _listen(ns.host, ns.port)
    if sock is None:
        return rc
    try:
        if ns.dp_size > 1:
            from plait.runtime.router.replicas import serve_data_parallel

            serve_data_parallel(
                {k: getattr(ns, k) for k in _ENGINE_OPTIONS if getattr(ns, k) is not None},
                ns.dp_size,
                ns.host,
                ns.port,
                ns.api_key,
                sock,
                _replica_flags(ns),
                log_level=ns.log_level,
            )
        else:
            run_server(
                args,
                ns.host,
                ns.port,
                ns.api_key,
                ns.max_queued_requests,
                ns.served_model_name,
                sock=sock,
                request_timeout=ns.request_timeout,
                log_requests=ns.log_requests,
            )
    except KeyboardInterrupt:
        pass
    except Exception as e:  # e.g. a model that does not load: one line, not a traceback
        logging.getLogger("plait").debug("serve failed", exc_info=True)
        return _fail(f"{type(e).__name__}: {e}")
    return 0


def _replica_flags(ns: argparse.Namespace) -> list[str]:
    """`plait serve` flags, besides the engine's, that each --dp-size replica gets."""
    flags = ["--max-queued-requests", str(ns.max_queued_requests)]
    flags += ["--request-timeout", str(ns.request_timeout)] if ns.request_timeout else []
    flags += ["--log-requests"] if ns.log_requests else []
    return flags + (["--served-model-name", ns.served_model_name] if ns.served_model_name else [])


def _add_router_args(p: argparse.ArgumentParser) -> None:
    from plait.runtime.router.policy import (
        DEFAULT_BALANCE_ABS_THRESHOLD,
        DEFAULT_BALANCE_REL_THRESHOLD,
        DEFAULT_CACHE_THRESHOLD,
        POLICIES,
    )

    p.add_argument("--worker-urls", nargs="+", required=True, metavar="URL", help="the plait servers to route to")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--policy", default="cache_aware", choices=POLICIES)
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=DEFAULT_CACHE_THRESHOLD,
        help="cache_aware: least prefix match (fraction of the text) that routes to the matching replica",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=DEFAULT_BALANCE_ABS_THRESHOLD,
        help="cache_aware: a replica is overloaded when its load exceeds the least-loaded one's by "
        "more than this many requests and ...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=DEFAULT_BALANCE_REL_THRESHOLD,
        help="... is more than this many times it",
    )
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between replica health checks")
    p.add_argument("--api-key", default=None, help="the router's own key (every route except /health)")
    p.add_argument(
        "--worker-api-key",
        default=None,
        help="key sent to the replicas (default: the client's Authorization header as is)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def router(ns: argparse.Namespace) -> int:
    """`plait router`: route over running plait servers until signalled."""
    from plait.runtime.router.app import run_router
    from plait.runtime.router.policy import make_policy
    from plait.runtime.router.router import Router

    if not 0 < ns.port < 65536:
        return _fail(f"--port must be in 1..65535, got {ns.port}", 2)
    if ns.health_interval <= 0:
        return _fail(f"--health-interval must be > 0, got {ns.health_interval}", 2)
    try:
        policy = make_policy(ns.policy, ns.cache_threshold, ns.balance_abs_threshold, ns.balance_rel_threshold)
        rt = Router(ns.worker_urls, policy, ns.worker_api_key, health_interval=ns.health_interval)
    except ValueError as e:
        return _fail(str(e), 2)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock, rc = _listen(ns.host, ns.port)
    if sock is None:
        return rc
    try:
        run_router(rt, ns.host, ns.port, ns.api_key, sock=sock, log_level=ns.log_level)
    except KeyboardInterrupt:
        pass
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
    if ns.command == "router":
        return router(ns)
    return bench(ns.name, ns.args)


if __name__ == "__main__":
    sys.exit(main())
