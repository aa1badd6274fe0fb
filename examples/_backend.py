"""Shared by the DSL examples: the backend to run on.

Without arguments an example starts `plait.Engine` on the default model in process; with
`--url http://127.0.0.1:30000` it uses a running `plait serve` through `plait.RuntimeEndpoint`."""

from __future__ import annotations

import argparse
import contextlib

import plait


@contextlib.contextmanager
def default_backend(description: str = ""):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="a running plait server (default: an in-process Engine)")
    parser.add_argument("--model", default="smollm2", help="model for the in-process Engine")
    args = parser.parse_args()
    if args.url:
        plait.set_default_backend(plait.RuntimeEndpoint(args.url))
        yield
        return
    with plait.Engine(model=args.model) as engine:
        plait.set_default_backend(engine)
        yield
