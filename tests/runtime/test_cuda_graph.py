"""The decode graph runner (runtime/model_executor/cuda_graph.py). On the CPU it runs in eager-replay mode (the
static, padded tensors without capture), which tests the bucketing, padding and static inputs
against the ordinary eager path; on CUDA (when present) the real capture and replay."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import assert_no_leak

from plait.runtime.mem_cache.memory_pool import PAD_SLOT
from plait.runtime.model_executor.cuda_graph import DecodeGraphRunner, bs_buckets, kv_buckets
from plait.runtime.model_executor.model_runner import ModelRunner
from plait.runtime.request import GenerateInput
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

# The static path sums the same float32 terms as the eager one in other orders: SDPA over a longer
# (masked) row instead of the decode-attention kernel, and its projections at the padded row count,
# where oneDNN (or cuBLAS) may pick another kernel and blocking by shape and CPU. A float32 sum of n
# terms moves by at most ~n * 2^-24 of its terms' magnitudes, which in these models are of the order
# of the logits'; the tiny models chain ~11 such sums (2 layers of qkv, attention, o, gate_up and
# down, then the head) of up to 128 terms (the MLP's width; attention's keys, fewer here). So the
# logits agree within 11 * 128 * 2^-24 (~8.4e-5) of their largest magnitude whatever the machine's
# kernels. (Seen: 1.7e-6 of it on AMD Zen 4; Intel Sapphire Rapids' oneDNN ~1e-5, which a fixed 2e-5
# absolute bound, tuned on AMD, failed.) Real faults (a wrong mask, position or slot) move them by
# tenths; the greedy outputs are compared exactly besides.
SUM_BOUND = 11 * 128 * 2.0**-24


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, atol=SUM_BOUND * ref.abs().max().item(), rtol=0)


def runner_args(path: str, **kw) -> ServerArgs:
    return ServerArgs(**{"model": path, "dtype": "float32", "max_total_tokens": 4096, **kw})


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # qwen3: q/k norms, head_dim != hidden / heads
def path(tiny_model_dirs, request):
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="module")
def eager_runner(path):
    return ModelRunner(runner_args(path))


@pytest.fixture(scope="module")
def graph_runner(path):
    """Forced on (no capture) with small buckets: bs 1, 2, 4; KV 16, 32, 64, 128 — so that short
    runs cross bucket boundaries and also exceed both limits."""
    runner = ModelRunner(runner_args(path, cuda_graph_eager=True))
    assert runner.graphs is not None and not runner.graphs.capture
    runner.graphs = DecodeGraphRunner(runner, max_bs=4, max_kv=128, capture=False, min_kv=16)
    return runner


class Recorder:
    """Wraps `runner.forward`: per step, whether the graph runner took it, the logits, and the
    checks every step must pass (the padding slot is never a request's)."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.steps = runner, []
        self._forward = runner.forward
        runner.forward = self

    def __call__(self, batch):
        assert not bool((batch.out_cache_loc == PAD_SLOT).any())
        for g in batch.groups:
            live = torch.arange(g.max_kv, device=g.seq_lens.device)[None, :] < g.seq_lens[:, None]
            assert not bool((g.kv_indices.view(g.bsz, g.max_kv)[live] == PAD_SLOT).any())
        graphs = self.runner.graphs
        before = graphs.num_replays if graphs is not None else 0
        logits = self._forward(batch)
        took = graphs is not None and graphs.num_replays > before
        mirror = getattr(self.runner.backend, "mirror", None)
        if took and mirror is not None:  # the CPU decode mirror saw this step's pool writes
            assert bool((mirror.slot_stamp[batch.out_cache_loc.cpu()] == mirror.clock).all())
        if took:  # padded rows see exactly one key, the padding slot (no fully masked row: no NaN)
            n, static = batch.groups[0].bsz, graphs.entries[graphs.bucket(batch)].batch
            sg = static.groups[0]
            seen = sg.attn_mask.view(sg.bsz, sg.max_kv) == 0
            assert bool((seen.sum(1)[n:] == 1).all()) and bool(seen[n:, 0].all())
            assert bool((sg.kv_indices.view(sg.bsz, sg.max_kv)[n:, 0] == PAD_SLOT).all())
            assert bool((static.out_cache_loc[n:] == PAD_SLOT).all())
        eligible = graphs.bucket(batch) if graphs is not None else None
        pool, loc = self.runner.pool, batch.out_cache_loc
        written = torch.stack([t[loc] for t in pool.k + pool.v]).cpu()  # this step's K/V, every layer
        self.steps.append(
            {
                "graph": took,
                "eligible": eligible,
                "bsz": sum(g.bsz for g in batch.groups),
                "max_q": max(g.max_q for g in batch.groups),
                "logits": logits.clone(),
                "written": written,
            }
        )
        return logits

    def close(self):
        del self.runner.forward


def req(rid: str, ids: list[int], n: int) -> GenerateInput:
    return GenerateInput(
        rid=rid, input_ids=ids, params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), seed=0
    )


def drive(s: Scheduler, arrivals: dict[int, list[GenerateInput]], oracle: dict | None = None) -> dict[str, list[int]]:
    """Step until idle, adding `arrivals[k]` before step k; rid -> output ids."""
    out: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or s.has_work():
        for inp in arrivals.get(step, []):
            s.add_request(inp)
            if oracle and inp.rid in oracle:
                s.waiting[-1].ngram = OracleDrafts(len(inp.input_ids), oracle[inp.rid])
        for o in s.step():
            out.setdefault(o.rid, []).extend(o.new_ids)
        step += 1
        assert step < 5000
    assert_no_leak(s)
    assert s.allocator.available() + s.cache.total_size() == s.num_slots
    return out


def workload(tokenizer) -> dict[int, list[GenerateInput]]:
    """Requests joining and finishing mid-run: batch sizes 1..5 (5 is above the largest bucket),
    contexts from a few tokens to past 128 (the largest KV bucket)."""
    text = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "1, 2, 3, 4,",
        "Hello",
    ]
    ids = [tokenizer.encode(t) for t in text]
    long = tokenizer.encode(" ".join(["a long prompt that keeps going"] * 20))[:112]
    return {
        0: [req("a", ids[0], 44)],
        2: [req("b", ids[1], 12)],
        14: [req("c", ids[2] * 3, 30), req("d", ids[3], 14), req("e", ids[4], 6), req("h", ids[4], 3)],
        24: [req("f", long, 26)],
        30: [req("g", ids[0] + ids[1], 9)],
    }


def compare(ref: Recorder, got: Recorder) -> None:
    assert len(ref.steps) == len(got.steps)
    for a, b in zip(ref.steps, got.steps):
        assert a["bsz"] == b["bsz"]
        assert_logits_close(b["logits"], a["logits"])


def test_buckets():
    assert bs_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bs_buckets(3) == [1, 2, 3] and bs_buckets(1) == [1] and bs_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert kv_buckets(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert kv_buckets(3000) == [256, 512, 1024, 2048, 3008]  # the context length, aligned
    assert kv_buckets(100) == [256] and kv_buckets(128, min_kv=16) == [16, 32, 64, 128]


def test_guards(path, eager_runner):
    assert eager_runner.graphs is None  # CPU: off by default
    assert ModelRunner(runner_args(path, cuda_graph_eager=True, disable_cuda_graph=True)).graphs is None
    forced = ModelRunner(runner_args(path, cuda_graph_eager=True, max_running_requests=20))
    assert forced.graphs.bs_buckets == [1, 2, 4, 8, 16, 20] and forced.graphs.kv_buckets == [256, 512]
    forced = ModelRunner(runner_args(path, cuda_graph_eager=True, cuda_graph_max_bs=8))
    assert forced.graphs.max_bs == 8
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)
    from plait.cli import build_parser

    ns = build_parser().parse_args(["serve", "--disable-cuda-graph", "--cuda-graph-max-bs", "16"])
    assert ns.disable_cuda_graph and ns.cuda_graph_max_bs == 16


def test_static_decode_equals_eager(path, eager_runner, graph_runner):
    """Greedy outputs identical and every step's logits within the summation bound (SUM_BOUND); the
    graph runner takes exactly the pure-decode steps that fit a bucket, across bs and KV buckets,
    with padded rows."""
    recs = []
    outs = []
    for runner in (eager_runner, graph_runner):
        rec = Recorder(runner)
        try:
            s = Scheduler(runner_args(path, chunked_prefill_size=64), runner)
            outs.append(drive(s, workload(runner.tokenizer)))
        finally:
            rec.close()
        recs.append(rec)
    assert outs[1] == outs[0]
    assert {len(v) for v in outs[0].values()} == {44, 12, 30, 14, 6, 3, 26, 9}
    compare(*recs)
    steps, g = recs[1].steps, graph_runner.graphs
    assert all(st["graph"] == (st["eligible"] is not None) for st in steps)
    assert all(st["max_q"] == 1 and st["bsz"] <= 4 for st in steps if st["graph"])
    # eager: prefill / mixed steps, 5 running requests (> 4), "f" past 128 tokens of context
    eager = [st for st in steps if not st["graph"]]
    assert any(st["max_q"] > 1 for st in eager)
    assert any(st["max_q"] == 1 and st["bsz"] == 5 for st in eager)
    assert any(st["max_q"] == 1 and st["bsz"] <= 4 for st in eager)  # context > 128
    used = {st["eligible"] for st in steps if st["graph"]}
    assert {b for b, _ in used} == {1, 2, 4} and {k for _, k in used} >= {16, 32, 64, 128}
    assert any(st["bsz"] == 3 for st in steps if st["graph"]) and g.num_padded_rows > 0


def e4m3_neighbours(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether fp8 e4m3 values a and b are equal or one rounding step apart: |a - b| is at most the
    e4m3 spacing at the larger magnitude (3 mantissa bits: 2^(e-3); subnormals 2^-9)."""
    x, y = a.float(), b.float()
    big = torch.maximum(x.abs(), y.abs())
    step = torch.exp2(torch.floor(torch.log2(big.clamp_min(2.0**-6))) - 3)
    return bool(((x - y).abs() <= step).all())


def test_static_decode_over_an_fp8_cache(path):
    """An fp8 (e4m3) KV cache on the static path: its pool writes as bytes, its gather widened to
    the attention dtype (float32 on the CPU, bfloat16 on a GPU); the same greedy outputs as the
    eager path over the same cache, and the same logits while both caches hold the same bytes.

    Why not every step's logits: each path rounds its float32 K/V to e4m3 after sums taken in other
    orders (SUM_BOUND), and a value that lies within that much of a rounding midpoint lands on the
    neighbouring e4m3 value on one path only, a 6-12% change of that element that no summation
    bound covers and which every later step inherits. So the logits are held to SUM_BOUND up to
    the first step whose writes differ (its own writes feed its attention), and that step's bytes
    must be e4m3 neighbours (a rounding flip, not a wrong value or slot). Which step flips first
    depends on the machine's kernels (none on AMD Zen 4's AVX-512 build; one with the scalar one)."""
    recs, outs = [], []
    for extra in ({}, {"cuda_graph_eager": True}):
        runner = ModelRunner(runner_args(path, kv_cache_dtype="fp8_e4m3", **extra))
        assert runner.pool.k[0].dtype == torch.float8_e4m3fn
        if extra:
            runner.graphs = DecodeGraphRunner(runner, max_bs=4, max_kv=128, capture=False, min_kv=16)
            assert runner.graphs.mask.dtype == torch.float32
        rec = Recorder(runner)
        try:
            outs.append(
                drive(Scheduler(runner_args(path, chunked_prefill_size=64), runner), workload(runner.tokenizer))
            )
        finally:
            rec.close()
        recs.append(rec)
    assert outs[1] == outs[0]
    ref, got = recs[0].steps, recs[1].steps
    assert len(ref) == len(got)
    graph_steps_compared = 0
    for a, b in zip(ref, got):
        assert a["bsz"] == b["bsz"]
        same = torch.equal(a["written"].view(torch.uint8), b["written"].view(torch.uint8))
        if not same:
            assert e4m3_neighbours(a["written"], b["written"])
            break
        assert_logits_close(b["logits"], a["logits"])
        graph_steps_compared += b["graph"]
    assert any(st["graph"] for st in got)
    assert graph_steps_compared > 0  # the static path's own fp8 writes and reads were compared


class OracleDrafts:
    """Drafts for the tiny random model (whose output never repeats its prompt): the reference
    continuation with every third token wrong, so verification accepts some and rejects some."""

    def __init__(self, prompt_len: int, ref: list[int]):
        self.prompt_len, self.ref = prompt_len, ref

    def propose(self, ids: list[int], k: int) -> list[int]:
        pos = len(ids) - self.prompt_len
        return [t if (pos + i) % 3 else (t + 1) % 1000 for i, t in enumerate(self.ref[pos : pos + k])]


def test_draft_steps_fall_back_and_outputs_match(path, eager_runner, graph_runner):
    """With speculation, draft-verification steps run eagerly, plain decodes through the runner;
    the output equals the plain eager run (drafts rejected and accepted, slots reused)."""
    # three requests, speculating while at most two run: plain decode steps before, drafts after
    arrivals = {
        0: [req(f"r{i}", [(7 * i + j % 5) * 13 + 100 for j in range(10 + 3 * i)], 8 + 12 * i) for i in range(3)]
    }
    ref = drive(Scheduler(runner_args(path), eager_runner), arrivals)
    rec = Recorder(graph_runner)
    try:
        s = Scheduler(runner_args(path, speculative_algorithm="ngram", speculative_max_batch=2), graph_runner)
        got = drive(s, arrivals, oracle=ref)
    finally:
        rec.close()
    assert got == ref
    assert s.num_spec_accepted_tokens > 0 and s.num_spec_proposed_tokens > s.num_spec_accepted_tokens
    assert any(st["max_q"] > 1 and not st["graph"] for st in rec.steps)  # drafts verified eagerly
    assert any(st["graph"] for st in rec.steps)


def test_padding_slot_is_never_allocated(graph_runner):
    s = Scheduler(runner_args(graph_runner.model_path), graph_runner)
    slots = s.allocator.alloc(s.num_slots)
    assert slots.numel() == s.num_slots and PAD_SLOT not in set(slots.tolist())
    assert s.allocator.alloc(1) is None
    s.allocator.free(slots)


class FakeGraphs:
    """Stands in for torch.cuda's graph API on the CPU, to test the capture bookkeeping: a "graph"
    replays by recomputing its bucket from the static inputs into the output it captured."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.captures, self.replays, self.fail, self.runner = [], 0, fail, None
        fake = self

        class Graph:
            def replay(self):
                fake.replays += 1
                graphs = fake.runner.graphs
                entry = next(e for e in graphs.entries.values() if e.graph is self)
                entry.logits.copy_(graphs._step(entry))

        class Stream:
            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def graph(g, pool=None, capture_error_mode="global"):
            assert pool is not None and capture_error_mode == "thread_local"
            if fake.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            fake.captures.append(g)
            yield

        for name, value in {
            "CUDAGraph": Graph,
            "Stream": lambda *a: Stream(),
            "current_stream": lambda *a: Stream(),
            "stream": lambda s: contextlib.nullcontext(),
            "device": lambda d: contextlib.nullcontext(),
            "graph_pool_handle": object,
            "graph": graph,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.mark.parametrize("fail", [False, True])
def test_capture_bookkeeping(path, eager_runner, monkeypatch, fail):
    """The capture path (faked on the CPU): one capture per bucket on first use, replays after,
    outputs as eager; a failing capture turns graphs off and the step runs eagerly."""
    runner = ModelRunner(runner_args(path, cuda_graph_eager=True))
    fake = FakeGraphs(monkeypatch, fail)
    fake.runner = runner
    runner.graphs = DecodeGraphRunner(runner, max_bs=4, max_kv=128, capture=True, min_kv=16)
    rec_ref, rec = Recorder(eager_runner), Recorder(runner)
    try:
        ref = drive(Scheduler(runner_args(path, chunked_prefill_size=64), eager_runner), workload(runner.tokenizer))
        got = drive(Scheduler(runner_args(path, chunked_prefill_size=64), runner), workload(runner.tokenizer))
    finally:
        rec_ref.close()
        rec.close()
    assert got == ref
    compare(rec_ref, rec)
    graphs = runner.graphs
    if fail:
        assert graphs.failed and not graphs.entries and graphs.num_replays == 0 and not fake.captures
        return
    assert len(fake.captures) == len(graphs.entries) >= 4
    assert all(e.graph is not None for e in graphs.entries.values())
    assert fake.replays == graphs.num_replays == sum(st["graph"] for st in rec.steps) > len(fake.captures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capture_replay_equals_eager(path):
    """Real capture and replay on CUDA: the same greedy outputs and logits as eager decode and as
    the runner's uncaptured (eager-replay) mode."""
    base = {"model": path, "dtype": "float32", "max_total_tokens": 4096, "device": "cuda"}
    runs = []
    for extra in ({"disable_cuda_graph": True}, {}, {"cuda_graph_eager": True}):
        runner = ModelRunner(ServerArgs(**base, **extra))
        assert (runner.graphs is None) == ("disable_cuda_graph" in extra)
        if runner.graphs is not None:  # small buckets, as on the CPU: several captures, both limits hit
            assert runner.graphs.capture == ("cuda_graph_eager" not in extra)
            runner.graphs = DecodeGraphRunner(runner, max_bs=4, max_kv=128, capture=runner.graphs.capture, min_kv=16)
        rec = Recorder(runner)
        try:
            out = drive(
                Scheduler(ServerArgs(**base, **extra, chunked_prefill_size=64), runner), workload(runner.tokenizer)
            )
        finally:
            rec.close()
        runs.append((out, rec, runner))
    (ref, ref_rec, _), (got, got_rec, captured), (_, replay_rec, _) = runs
    assert got == ref
    compare(ref_rec, got_rec)
    assert any(e.graph is not None for e in captured.graphs.entries.values()) and not captured.graphs.failed
    for a, b in zip(replay_rec.steps, got_rec.steps):
        assert a["graph"] == b["graph"]
        assert_logits_close(b["logits"], a["logits"])
