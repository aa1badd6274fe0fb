"""One prepared GPU check for plait: run it once on a machine with a CUDA device.

    .venv/bin/python scripts/gpu_check.py [--model smollm2] [--skip-pytest]

1. float32 greedy outputs on CUDA: CUDA-graph decode equals eager decode and the graph runner's
   uncaptured mode ("eager replay": same static kernels, no capture), and agrees with the CPU
   float32 run (a shared prefix of at least MIN_CPU_PREFIX tokens per prompt: the two devices sum
   in different orders, so a late near-tie may flip);
2. bf16 CUDA graphs vs bf16 eager: agreement, printed;
3. int8 and fp8 weights on CUDA (graphs on): the text is sane and the graphs captured;
4. decode tokens/s at batch 1 / 8 / 32 (bf16), with and without CUDA graphs;
5. unless --skip-pytest: the CUDA test of tests/runtime/test_cuda_graph.py (tiny models).

Prints one PASS / FAIL line per check. Exit status: 0 all passed, 1 a check failed, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Here is a list of three fruits:",
    "Once upon a time, in a small village,",
]
MIN_CPU_PREFIX = 16
MAX_TOKENS = 16384  # KV pool per runner: small, several runners share the GPU
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

results: list[tuple[bool, str]] = []


def check(ok: bool, name: str, detail: str = "") -> bool:
    results.append((ok, name))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def make_runner(model: str, device: str, dtype: str, **kw):
    from plait.runtime.model_executor.model_runner import ModelRunner
    from plait.runtime.server_args import ServerArgs

    return ModelRunner(ServerArgs(model=model, device=device, dtype=dtype, max_total_tokens=MAX_TOKENS, **kw))


@contextlib.contextmanager
def mode(runner, how: str):
    """Run `runner` eagerly ("eager"), from captured graphs ("graph", its own runner) or through
    the graph runner without capture ("replay")."""
    from plait.runtime.model_executor.cuda_graph import DecodeGraphRunner

    saved = runner.graphs
    if how == "eager":
        runner.graphs = None
    elif how == "replay":
        runner.graphs = DecodeGraphRunner(runner, max_bs=saved.max_bs, max_kv=saved.max_kv, capture=False)
    try:
        yield
    finally:
        runner.graphs = saved


def generate(runner, prompts: list[list[int]], max_new: int, ignore_eos: bool = False) -> list[list[int]]:
    """Greedy continuations of all prompts, batched in one scheduler."""
    from plait.runtime.request import GenerateInput
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.scheduler import Scheduler

    s = Scheduler(runner.args, runner)
    for i, ids in enumerate(prompts):
        s.add_request(
            GenerateInput(
                rid=str(i),
                input_ids=ids,
                seed=0,
                params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=ignore_eos),
            )
        )
    out: dict[str, list[int]] = {}
    while s.has_work():
        for o in s.step():
            out.setdefault(o.rid, []).extend(o.new_ids)
    assert s.kv_slots_in_use() == 0, "KV slots leaked"
    return [out[str(i)] for i in range(len(prompts))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def sane(text: str, ids: list[int]) -> bool:
    printable = sum(c.isprintable() or c.isspace() for c in text)
    return bool(text.strip()) and "\ufffd" not in text and printable >= 0.95 * len(text) and len(set(ids)) >= 4


def check_float32(model: str, prompts: list[list[int]], tok) -> None:
    runner = make_runner(model, "cuda", "float32")
    check(runner.graphs is not None and runner.graphs.capture, "graphs on by default on CUDA")
    with mode(runner, "eager"):
        eager = generate(runner, prompts, 48)
    graph = generate(runner, prompts, 48)
    with mode(runner, "replay"):
        replay = generate(runner, prompts, 48)
    captured = sum(e.graph is not None for e in runner.graphs.entries.values())
    check(captured > 0 and not runner.graphs.failed, "float32 graphs captured", f"{captured} buckets")
    check(
        graph == eager,
        "float32 greedy: CUDA graphs == eager",
        ", ".join(f"{common_prefix(g, e)}/{len(e)}" for g, e in zip(graph, eager)),
    )
    check(graph == replay, "float32 greedy: CUDA graphs == uncaptured replay")
    cpu = generate(make_runner(model, "cpu", "float32"), prompts, 48)
    shared = [common_prefix(g, c) for g, c in zip(graph, cpu)]
    check(
        all(n >= min(MIN_CPU_PREFIX, len(c)) for n, c in zip(shared, cpu)),
        "float32 greedy: CUDA graphs vs CPU",
        f"shared prefixes {shared} of {[len(c) for c in cpu]}",
    )
    print("   sample:", repr(tok.decode(graph[0])))
    del runner


def check_bf16_and_quantized(model: str, prompts: list[list[int]], tok) -> None:
    runner = make_runner(model, "cuda", "bfloat16")
    graph = generate(runner, prompts, 48)
    with mode(runner, "eager"):
        eager = generate(runner, prompts, 48)
    check(
        not runner.graphs.failed,
        "bfloat16 graphs captured",
        "greedy agreement with eager (shared prefix): "
        + ", ".join(f"{common_prefix(g, e)}/{len(e)}" for g, e in zip(graph, eager)),
    )
    del runner
    for method in ("int8", "fp8"):
        try:
            q = make_runner(model, "cuda", "bfloat16", quantization=method)
            outs = generate(q, prompts[:2], 32)
        except Exception as e:  # noqa: BLE001 - report and go on with the other checks
            check(False, f"{method} on CUDA", f"{type(e).__name__}: {e}")
            continue
        texts = [tok.decode(o) for o in outs]
        check(
            all(sane(t, o) for t, o in zip(texts, outs)) and not q.graphs.failed,
            f"{method} on CUDA (graphs)",
            f"graphs {'failed' if q.graphs.failed else 'ok'}; agreement with bf16 "
            f"{[common_prefix(o, g) for o, g in zip(outs, graph)]}; {texts[0][:60]!r}",
        )
        del q


def throughput(model: str, tok) -> None:
    runner = make_runner(model, "cuda", "bfloat16", max_running_requests=64)
    print(f"\ndecode tokens/s ({model}, bfloat16, 128 new tokens per request)")
    print(f"{'batch':>6} {'eager':>10} {'graphs':>10} {'speedup':>8}")
    for bs in (1, 8, 32):
        prompts = [tok.encode(f"Request {i}: write a short story about the number {i}.") for i in range(bs)]
        rates = {}
        for how in ("eager", "graph"):
            with mode(runner, how):
                generate(runner, prompts, 16, ignore_eos=True)  # warm-up (and captures)
                rates[how] = decode_rate(runner, prompts, 128)
        print(
            f"{bs:>6} {rates['eager']:>10.0f} {rates['graph']:>10.0f} {rates['graph'] / rates['eager']:>7.2f}x",
            flush=True,
        )
    check(not runner.graphs.failed, "throughput run (graphs stayed on)")


def decode_rate(runner, prompts: list[list[int]], max_new: int) -> float:
    """Tokens/s over the steps after the first (the prefill)."""
    from plait.runtime.request import GenerateInput
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.scheduler import Scheduler

    s = Scheduler(runner.args, runner)
    for i, ids in enumerate(prompts):
        s.add_request(
            GenerateInput(
                rid=str(i),
                input_ids=ids,
                seed=0,
                params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
            )
        )
    s.step()
    tokens, t0 = 0, time.perf_counter()
    while s.has_work():
        tokens += sum(len(o.new_ids) for o in s.step())
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--skip-pytest", action="store_true", help="do not run the CUDA tests of tests/runtime/test_cuda_graph.py"
    )
    ns = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run this on a machine with a GPU",
            file=sys.stderr,
        )
        return 2
    try:
        import flash_attn  # noqa: F401

        backend = "FlashAttnVarlen"
    except ImportError:
        backend = "TorchNativeAttention (no flash_attn)"
    print(
        f"device {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}; eager decode attention: {backend}",
        flush=True,
    )
    from plait.runtime.model_executor.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(ns.model))
    prompts = [tok.encode(t) for t in PROMPTS]
    for step in (check_float32, check_bf16_and_quantized):
        try:
            step(ns.model, prompts, tok)
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            check(False, step.__name__, f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    try:
        throughput(ns.model, tok)
    except Exception as e:  # noqa: BLE001
        check(False, "throughput", f"{type(e).__name__}: {e}")
    if not ns.skip_pytest:
        rc = subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-x", "tests/runtime/test_cuda_graph.py", "-k", "capture_replay"],
            cwd=ROOT,
        )
        check(rc == 0, "pytest tests/runtime/test_cuda_graph.py -k capture_replay", f"exit {rc}")
    failed = [name for ok, name in results if not ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
