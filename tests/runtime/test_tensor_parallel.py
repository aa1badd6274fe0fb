"""Tensor parallelism on the CPU (gloo): TP=2 engines give the same greedy tokens as TP=1 and
logprobs within 1e-4 (float32), for tiny random models and for SmolLM2; every prompt position's
logprob is checked (prefill logits) as well as each generated token's top-k (decode logits).
A killed rank makes requests fail with an error instead of hanging, and the other ranks exit.

The TP=1 reference is the in-process Scheduler (same model code, one rank); the TP=2 side is a
real `plait.Engine(tp_size=2)`: rank 0 scheduling and broadcasting each batch, rank 1 following.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import assert_no_leak, free_port

import plait
from plait.runtime.distributed import parallel
from plait.runtime.request import GenerateInput
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs

TOL = 1e-4
TOP = 5
PROMPTS = [
    [1, 450, 7483, 310, 3444, 338],
    [1, 450, 7483, 310, 3444, 338, 3681, 29889, 450, 7483],  # shares a prefix with the first
    [(i * 7919) % 40000 + 5 for i in range(70)],  # longer than one prefill chunk
]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _reference(path: str, prompts: list[list[int]], n: int) -> dict[str, dict]:
    """TP=1, in this process: per request the output ids and every logprob the engine reports."""
    s = Scheduler(ServerArgs(model=path, dtype="float32", max_total_tokens=4096, chunked_prefill_size=32))
    for i, ids in enumerate(prompts):
        s.add_request(
            GenerateInput(
                rid=str(i),
                input_ids=list(ids),
                params=_params(n),
                seed=0,
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=TOP,
            )
        )
    out: dict[str, dict] = {str(i): {"ids": [], "input": [], "output": [], "top": []} for i in range(len(prompts))}
    while s.has_work():
        for o in s.step():
            r = out[o.rid]
            r["ids"] += o.new_ids
            r["input"] += o.input_logprobs or []
            r["output"] += o.output_logprobs or []
            r["top"] += o.output_top_logprobs or []
    return out


def _run_tp(path: str, prompts: list[list[int]], n: int) -> tuple[list[dict], list[int]]:
    with plait.Engine(model=path, dtype="float32", max_total_tokens=4096, chunked_prefill_size=32, tp_size=2) as eng:
        info = eng.get_server_info()
        assert info["tp_size"] == 2
        assert [(r["rank"], r["alive"]) for r in info["tp_ranks"]] == [(0, True), (1, True)]
        assert info["tp_ranks"][1]["pid"] == eng.tp_worker_pids[0]
        pids = eng.tp_worker_pids
        assert len(pids) == 1
        results = eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=TOP,
        )
        assert_no_leak(eng)
    return results, [eng.scheduler_pid, *pids]


def _assert_close(ref: dict[str, dict], results: list[dict]) -> None:
    for i, res in enumerate(results):
        want, meta = ref[str(i)], res["meta_info"]
        assert res["output_ids"] == want["ids"]  # same greedy tokens
        got_in = meta["input_token_logprobs"]
        assert [t for _, t, _ in got_in] == [t for _, t in want["input"]]
        for (lp, _, _), (ref_lp, _) in zip(got_in, want["input"], strict=True):  # prefill: every position
            assert (lp is None) == (ref_lp is None)
            if lp is not None:
                assert abs(lp - ref_lp) <= TOL
        for (lp, tok, _), (ref_lp, ref_tok) in zip(meta["output_token_logprobs"], want["output"], strict=True):
            assert tok == ref_tok and abs(lp - ref_lp) <= TOL
        for got_top, ref_top in zip(meta["output_top_logprobs"], want["top"], strict=True):  # decode: top-k per step
            assert [t for _, t, _ in got_top] == [t for _, t in ref_top]
            assert max(abs(a[0] - b[0]) for a, b in zip(got_top, ref_top, strict=True)) <= TOL
        assert len(meta["output_top_logprobs"]) == len(want["top"]) == len(want["ids"])


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


# --- sharding arithmetic ------------------------------------------------------------------------
@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 2), (4, 2, 2), (4, 1, 2), (8, 2, 4), (12, 12, 4), (6, 2, 4)])
def test_head_split_covers_every_head_once_with_its_kv_head(monkeypatch, heads, kv, tp):
    q_seen, group = [], heads // kv
    for rank in range(tp):
        monkeypatch.setattr(parallel, "_tp", parallel._TPState(rank=rank, size=tp))
        (qf, qn), (kf, kn) = parallel.head_split(heads, kv)
        assert qn >= 1 and kn >= 1
        q_seen += range(qf, qf + qn)
        # every local query head's KV head is held locally, in the same GQA order
        assert all(kf <= h // group < kf + kn for h in range(qf, qf + qn))
        assert qn // kn * kn == qn and (qn // kn == group or kn == 1)
    assert sorted(q_seen) == list(range(heads))


def test_unsplittable_heads_are_rejected(monkeypatch):
    monkeypatch.setattr(parallel, "_tp", parallel._TPState(rank=0, size=4))
    with pytest.raises(ValueError, match="tp_size 4"):
        parallel.head_split(2, 1)  # 2 query heads cannot feed 4 ranks
    with pytest.raises(ValueError, match="tp_size 4"):
        parallel.head_split(6, 3)  # 3 KV heads: 4 ranks neither divide nor multiply them


def test_server_args_validate_multi_node():
    with pytest.raises(ValueError, match="multiple of nnodes"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="dist_init_addr"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerArgs(tp_size=2, dist_init_addr="10.0.0.1")
    args = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500")
    assert parallel.ranks_on_this_node(args) == [2, 3]


# --- TP=2 vs TP=1 -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied embeddings; untied with q/k/v biases
def test_tp2_matches_tp1_tiny(arch, tiny_model_dirs):
    path = tiny_model_dirs[arch]
    ref = _reference(path, PROMPTS, 12)
    results, pids = _run_tp(path, PROMPTS, 12)
    _assert_close(ref, results)
    assert _wait_gone(pids, 10) == []  # a clean shutdown stops every rank


@pytest.mark.integration
def test_tp2_matches_tp1_smollm2(smollm2_path):
    """SmolLM2-135M: 9 query heads over 3 KV heads split unevenly (2 groups on rank 0, 1 on rank 1)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [
        tok("The capital of France is").input_ids,
        tok("def fibonacci(n):").input_ids,
        tok("The capital of France is Paris, and the capital of Italy is").input_ids,
    ]
    ref = _reference(smollm2_path, prompts, 16)
    results, _ = _run_tp(smollm2_path, prompts, 16)
    _assert_close(ref, results)


def test_two_nodes_on_loopback(tiny_model_dirs):
    """`--nnodes 2`: node 1 is `plait serve --node-rank 1` (ranks only, no HTTP), node 0 an engine
    whose rank 0 hosts the store at --dist-init-addr; together they match TP=1."""
    path = tiny_model_dirs["qwen3"]
    addr = f"127.0.0.1:{free_port()}"
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "serve",
            "--model",
            path,
            "--dtype",
            "float32",
            "--tp-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            addr,
            "--log-level",
            "warning",
        ]
    )
    try:
        with plait.Engine(
            model=path,
            dtype="float32",
            max_total_tokens=4096,
            chunked_prefill_size=32,
            tp_size=2,
            nnodes=2,
            node_rank=0,
            dist_init_addr=addr,
        ) as eng:
            assert eng.tp_worker_pids == []  # rank 1 runs on the other "node"
            results = eng.generate(
                input_ids=PROMPTS[:2],
                sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=TOP,
            )
        _assert_close(_reference(path, PROMPTS[:2], 8), results)
        assert node1.wait(timeout=30) == 0  # rank 0's stop reached the other node
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def _recording_scheduler(args: ServerArgs, runner=None) -> tuple[Scheduler, list]:
    """A Scheduler whose every step's logits are kept (as numpy arrays)."""
    s = Scheduler(args, runner)
    seen, forward = [], s.runner.forward
    s.runner.forward = lambda batch: seen.append(forward(batch)) or seen[-1]
    return s, seen


def _step_logits(s: Scheduler, seen: list, n: int) -> list:
    for i, ids in enumerate(PROMPTS):
        s.add_request(GenerateInput(rid=str(i), input_ids=list(ids), params=_params(n), seed=0))
    while s.has_work():
        s.step()
    return [t.numpy().copy() for t in seen]


def _rank_main(args: ServerArgs, rank: int, results) -> None:
    """One tensor-parallel rank, as the engine's processes run it: rank 0 schedules and records
    the logits of every step; rank 1 follows."""
    from plait.runtime.distributed.parallel import exit_rank
    from plait.runtime.model_executor.model_runner import ModelRunner

    try:
        runner = ModelRunner(args, rank)
        if rank == 0:
            s, seen = _recording_scheduler(args, runner)
            results.put(_step_logits(s, seen, 10))
        else:
            runner.follow()
        runner.close()
    except BaseException as e:
        results.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    results.close()
    results.join_thread()  # the logits reach the parent before the process ends
    exit_rank(0)  # as the engine's ranks end


def tp2_and_tp1_step_logits(model: str) -> tuple[list, list]:
    """Every step's logits (chunked prefills and decodes of PROMPTS) at tp_size 2, then 1."""
    import multiprocessing as mp

    common = {"model": model, "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 32}
    ref = _step_logits(*_recording_scheduler(ServerArgs(**common)), 10)
    args = ServerArgs(**common, tp_size=2, dist_init_addr=f"127.0.0.1:{free_port()}", dist_timeout=60)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(args, r, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = results.get(timeout=120)
        assert not isinstance(got, str), got
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert len(got) == len(ref) > len(PROMPTS)
    return got, ref


@pytest.mark.parametrize("arch", ["llama3-rope", "qwen3", "qwen2-moe"])  # + experts split, shared expert
def test_tp2_step_logits_match_tp1(arch, tiny_model_dirs):
    """The raw float32 logits of every step (chunked prefills and decodes) agree within 1e-4."""
    import numpy as np

    got, ref = tp2_and_tp1_step_logits(tiny_model_dirs[arch])
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.shape[1] == 49152
        assert np.abs(a - b).max() <= TOL


# --- failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["tp rank 1", "scheduler"])
def test_killed_rank_fails_requests_instead_of_hanging(tiny_model_dirs, victim):
    """Either rank dies mid-decode: the request ends with an abort naming it, later calls raise,
    and the surviving rank exits on its own (no rank waits forever on a dead peer)."""
    eng = plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=2048, tp_size=2)
    try:
        ranks = {"scheduler": eng.scheduler_pid, "tp rank 1": eng.tp_worker_pids[0]}
        stream = eng.generate(
            input_ids=PROMPTS[0],
            stream=True,
            sampling_params={"max_new_tokens": 5000, "temperature": 0, "ignore_eos": True},
        )
        next(stream)  # decoding has started
        os.kill(ranks[victim], signal.SIGKILL)
        last: list[dict] = []
        t = threading.Thread(target=lambda: last.extend(stream), daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "the request hung after a rank died"
        reason = last[-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert victim in reason["message"] or "tensor-parallel" in reason["message"], reason
        assert eng.failure is not None
        with pytest.raises(RuntimeError, match="cannot serve"):
            eng.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2})
        survivor = [pid for name, pid in ranks.items() if name != victim]
        assert _wait_gone(survivor, 15) == []  # it noticed its peer is gone and exited
    finally:
        eng.shutdown()


def test_metrics_report_each_rank():
    from plait.runtime.server.metrics import ServerMetrics

    text = (
        ServerMetrics()
        .render({"tp_ranks": [{"rank": 0, "pid": 1, "alive": True}, {"rank": 1, "pid": 2, "alive": False}]}, 0)
        .decode()
    )
    assert 'plait_tp_rank_alive{rank="0"} 1.0' in text
    assert 'plait_tp_rank_alive{rank="1"} 0.0' in text
