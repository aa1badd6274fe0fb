"""Model load time and memory: one fresh process per setting builds the model runner (weights,
quantized layers, KV pool) and reports the wall time and resident memory.

    plait bench load                                   # the default GGUF: float32, int4, gguf
    plait bench load --model DIR --quantization int8

Each setting runs twice in its own process: `cold` after the conversion cache of a GGUF is cleared
(the first start on a machine), `warm` with it in place (every later start). RSS is read after the
runner is built (`rss_mib`) and at its peak (`peak_mib`, the process' maxrss); the KV pool is
sized by --max-total-tokens so that it does not dominate the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, resource, sys, time
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
t0 = time.perf_counter()
from plait.runtime.model_executor.model_runner import ModelRunner
from plait.runtime.server_args import ServerArgs
t1 = time.perf_counter()
args = ServerArgs(**json.loads(sys.argv[1]))
runner = ModelRunner(args)
t2 = time.perf_counter()
rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_mib": rss / 2**20, "peak_mib": peak / 2**20}))
"""


def measure(kw: dict, cache_dir: str) -> dict:
    """Build a runner with ServerArgs(**kw) in a fresh process; its timings and memory."""
    env = dict(os.environ, PLAIT_CACHE_DIR=cache_dir)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(kw)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"load failed for {kw}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", action="append", help="none | int8 | int4 | gguf; repeatable")
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    rows = []
    cache = tempfile.mkdtemp(prefix="plait-load-")
    try:
        for q in args.quantization or ["none", "int4", "gguf"]:
            kw = {
                "model": args.model,
                "quantization": None if q == "none" else q,
                "max_total_tokens": args.max_total_tokens,
                "num_threads": args.num_threads,
            }
            shutil.rmtree(os.path.join(cache, "gguf"), ignore_errors=True)
            for phase in ("cold", "warm"):
                r = {"quantization": q, "phase": phase, **measure(kw, cache)}
                rows.append(r)
                print(
                    f"{q:>5} {phase}: load {r['load_s']:6.2f} s (imports {r['import_s']:.2f} s), "
                    f"RSS {r['rss_mib']:7.1f} MiB, peak {r['peak_mib']:7.1f} MiB",
                    flush=True,
                )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"(load avg {os.getloadavg()[0]:.2f})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load_avg": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
