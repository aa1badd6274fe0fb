"""Builds one outlines-core Index in a child process, under an address-space limit.

Run as a script (`python _outlines_worker.py`), it reads a pickled request from stdin:
    {"kind": "regex" | "json_schema", "text": str, "whitespace": str | None, "vocab": Vocabulary,
     "mem_limit": bytes of address space it may add, 0 for none}
and writes a pickled reply to stdout: ("ok", regex, Index) or ("error", message). Going over the
memory limit makes the Rust allocator abort (the parent sees SIGABRT) or raises MemoryError.
Only the standard library and outlines_core are imported here: this runs per compile.
"""

import os
import pickle
import resource
import sys


def _limit_memory(extra: int) -> None:
    if extra <= 0:
        return
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    limit = vm + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def build(req: dict):
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    if req["kind"] == "json_schema":
        try:
            regex = build_regex_from_schema(req["text"], req.get("whitespace"))
        except Exception as e:  # noqa: BLE001
            return ("error", f"invalid json_schema: {e}")
    else:
        regex = req["text"]
    try:
        index = Index(regex, req["vocab"])
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001
        return ("error", f"invalid {req['kind']} (regex {_short(regex)}): {e}")
    return ("ok", regex, index)


def _short(s: str, n: int = 120) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def main() -> int:
    req = pickle.load(sys.stdin.buffer)
    _limit_memory(int(req.get("mem_limit") or 0))
    try:
        reply = build(req)
    except MemoryError:
        os.write(2, b"outlines worker: MemoryError\n")
        return 3
    data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
