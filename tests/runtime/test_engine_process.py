"""The scheduler and the detokenizer as separate processes: where they run, its private socket directory, clean
shutdown, a scheduler that dies mid-request, a parent that dies, start-up errors, the worker's
message handling, and the wire format (typed msgspec messages, no pickle)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
from conftest import assert_no_leak

import plait
from plait.runtime.managers.ipc import (
    AbortReq,
    Codec,
    Fatal,
    FromScheduler,
    Ready,
    RpcReply,
    RpcReq,
    Shutdown,
    ToDetokenizer,
    TokenOutputBatch,
    ToScheduler,
)
from plait.runtime.managers.scheduler_process import SchedulerWorker, openmp_environ
from plait.runtime.request import GenerateInput, TokenOutput
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.server_args import ServerArgs

LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie left unreaped by a container's init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _engine(path: str, **kw) -> plait.Engine:
    return plait.Engine(model=path, dtype="float32", max_total_tokens=2048, **kw)


def test_scheduler_process_and_clean_shutdown(tiny_model_dirs):
    spin_before = os.environ.get("GOMP_SPINCOUNT")
    eng = _engine(tiny_model_dirs["llama"])
    pid, ipc_dir = eng.scheduler_pid, eng.ipc_dir
    detok = eng.detokenizer_pid
    try:
        assert pid != os.getpid() and _alive(pid)
        assert detok not in (os.getpid(), pid) and _alive(detok)
        assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
        assert all(stat.S_ISSOCK(os.stat(os.path.join(ipc_dir, n)).st_mode) for n in os.listdir(ipc_dir))
        out = eng.generate("hello", {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
        assert eng.get_server_info()["num_generated_tokens"] >= 4
        assert_no_leak(eng)
        with open(f"/proc/{pid}/environ", "rb") as f:
            child_env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert child_env[b"OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE").encode()
        assert child_env[b"GOMP_SPINCOUNT"] == os.environ.get("GOMP_SPINCOUNT", "20000").encode()
        assert os.environ.get("GOMP_SPINCOUNT") == spin_before  # set for the child only
        cpu = _cpu_seconds(pid)
        time.sleep(1.0)
        # A bounded busy-wait after each parallel region, then sleep: no spinning between requests.
        assert _cpu_seconds(pid) - cpu < 0.2, "the idle scheduler should sleep, not spin"
        cpu = _cpu_seconds(detok)
        time.sleep(0.5)
        assert _cpu_seconds(detok) - cpu < 0.1, "the idle detokenizer should sleep, not spin"
    finally:
        eng.shutdown()
    assert not os.path.exists(ipc_dir)
    assert _wait_gone(pid, 1) and _wait_gone(detok, 1)  # shutdown joins them: already gone
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("hello", {"max_new_tokens": 1})
    eng.abort("anything")  # a no-op, never an error
    eng.shutdown()  # idempotent


def test_openmp_environ_is_set_for_the_children_and_restored(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with openmp_environ(ServerArgs(omp_spincount=1234)):
        assert os.environ["GOMP_SPINCOUNT"] == "1234"
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice wins
    assert "GOMP_SPINCOUNT" not in os.environ and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    with openmp_environ(ServerArgs(omp_spincount=0)):
        assert os.environ["GOMP_SPINCOUNT"] == "7"
    assert os.environ["GOMP_SPINCOUNT"] == "7"
    with pytest.raises(ValueError, match="omp_spincount"):
        ServerArgs(omp_spincount=-1)
    from plait.cli import _ENGINE_OPTIONS, build_parser

    assert build_parser().parse_args(["serve", "--omp-spincount", "0"]).omp_spincount == 0
    assert "omp_spincount" in _ENGINE_OPTIONS


def test_killed_scheduler_aborts_pending_requests(tiny_model_dirs):
    eng = _engine(tiny_model_dirs["llama"])
    try:
        results: dict = {}

        def batch():
            results["batch"] = eng.generate(["a", "b", "c"], LONG)

        stream = eng.generate("stream", LONG, stream=True)
        first = next(stream)
        assert first["meta_info"]["finish_reason"] is None
        worker = threading.Thread(target=batch, daemon=True)
        worker.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # all four requests are in the scheduler
            info = eng.get_server_info()
            if info["num_running"] + info["num_waiting"] >= 4:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the requests never reached the scheduler")
        os.kill(eng.scheduler_pid, signal.SIGKILL)
        start = time.monotonic()
        consumer = threading.Thread(target=lambda: results.setdefault("stream", list(stream)), daemon=True)
        consumer.start()
        consumer.join(10)
        worker.join(10)
        assert not consumer.is_alive() and not worker.is_alive(), "a request hung after the scheduler died"
        assert time.monotonic() - start < 5
        last = results["stream"][-1]["meta_info"]["finish_reason"]
        assert last["type"] == "abort" and "died" in last["message"] and "-9" in last["message"]
        for out in results["batch"]:
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
        with pytest.raises(RuntimeError, match="died"):
            eng.generate("after", {"max_new_tokens": 1})
        with pytest.raises(RuntimeError, match="died"):
            eng.kv_slots_in_use()
    finally:
        ipc_dir = eng.ipc_dir
        eng.shutdown()
    assert not os.path.exists(ipc_dir)


def test_killed_detokenizer_aborts_pending_requests(tiny_model_dirs):
    eng = _engine(tiny_model_dirs["llama"])
    try:
        sched = eng.scheduler_pid
        stream = eng.generate("stream", LONG, stream=True)
        first = next(stream)
        assert first["meta_info"]["finish_reason"] is None
        os.kill(eng.detokenizer_pid, signal.SIGKILL)
        results: dict = {}
        consumer = threading.Thread(target=lambda: results.setdefault("stream", list(stream)), daemon=True)
        consumer.start()
        consumer.join(10)
        assert not consumer.is_alive(), "a request hung after the detokenizer died"
        last = results["stream"][-1]["meta_info"]["finish_reason"]
        assert last["type"] == "abort" and "detokenizer" in last["message"] and "died" in last["message"]
        assert "-9" in last["message"]
        assert "detokenizer" in eng.failure
        with pytest.raises(RuntimeError, match="detokenizer process died"):
            eng.generate("after", {"max_new_tokens": 1})
        with pytest.raises(RuntimeError, match="detokenizer process died"):
            eng.kv_slots_in_use()
    finally:
        ipc_dir = eng.ipc_dir
        eng.shutdown()
    assert not os.path.exists(ipc_dir)
    assert _wait_gone(sched, 1)  # the scheduler is stopped too


def test_scheduler_exits_when_parent_dies(tiny_model_dirs):
    script = textwrap.dedent(f"""
        import plait, sys, time
        eng = plait.Engine(model={tiny_model_dirs["llama"]!r}, dtype="float32", max_total_tokens=256)
        print(eng.scheduler_pid, eng.detokenizer_pid, eng.ipc_dir, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    try:
        pid, detok, ipc_dir = proc.stdout.readline().split()
        pid, detok = int(pid), int(detok)
        assert _alive(pid) and _alive(detok)
        proc.kill()  # no atexit, no finalizers: only the children's own checks can act
        proc.wait()
        assert _wait_gone(pid, 5), "the scheduler outlived its parent"
        assert _wait_gone(detok, 5), "the detokenizer outlived its parent"
        assert not os.path.exists(ipc_dir)  # the child removed it on its way out
    finally:
        proc.kill()
        proc.wait()


def _scheduler_children() -> list:
    return [p for p in mp.active_children() if p.name in ("plait-scheduler", "plait-detokenizer")]


def test_unknown_model_and_unsupported_architecture_fail_fast(tmp_path, tiny_model_dirs):
    before = len(_scheduler_children())
    start = time.monotonic()
    with pytest.raises(ValueError, match="does-not-exist"):
        plait.Engine(model="/nonexistent/does-not-exist")
    shutil.copytree(tiny_model_dirs["llama"], tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        plait.Engine(model=str(tmp_path / "m"))
    assert time.monotonic() - start < 10
    assert len(_scheduler_children()) == before  # checked before any process was started


def test_child_start_up_error_is_raised(tiny_model_dirs):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        _engine(tiny_model_dirs["llama"], device="cuda")
    assert not _scheduler_children()


# --- the worker loop, without a process --------------------------------------------------------
class FakeScheduler:
    """Just enough of Scheduler for SchedulerWorker; `step` fails when told to."""

    def __init__(self):
        self.reqs: list[str] = []
        self.fail = False

    def add_request(self, inp):
        if not inp.input_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        self.reqs.append(inp.rid)

    def abort_request(self, rid):
        if rid in self.reqs:
            self.reqs.remove(rid)
            return TokenOutput(rid=rid, new_ids=[], finish_reason={"type": "abort", "message": "aborted"})
        return None

    def has_work(self):
        return bool(self.reqs)

    def step(self):
        if self.fail:
            raise RuntimeError("boom")
        return [TokenOutput(rid=r, new_ids=[7]) for r in self.reqs]

    def flush_cache(self):
        return True

    def kv_slots_in_use(self):
        return 0


def _gen(rid: str, ids=(1, 2, 3)) -> GenerateInput:
    return GenerateInput(rid=rid, input_ids=list(ids), params=SamplingParams(), seed=0)


def test_worker_failed_step_aborts_everything_and_keeps_serving():
    sent: list = []
    sched = FakeScheduler()
    worker = SchedulerWorker(sched, sent.append)
    worker.handle(_gen("a"))
    worker.handle(_gen("b"))
    worker.handle(_gen("bad", ids=()))
    assert sent.pop().outputs[0].finish_reason == {"type": "abort", "message": "the prompt is empty (0 tokens)"}
    worker.step()
    outs = sent.pop().outputs
    assert [o.rid for o in outs] == ["a", "b"]
    # a request's first output carries its detokenization options, later ones do not
    assert all(o.skip_special_tokens is True and o.spaces_between_special_tokens is True for o in outs)
    worker.step()
    assert all(o.skip_special_tokens is None for o in sent.pop().outputs)
    sched.fail = True
    worker.step()  # must not raise
    outs = sent.pop().outputs
    assert sorted(o.rid for o in outs) == ["a", "b"]
    assert all(o.finish_reason["type"] == "abort" and "boom" in o.finish_reason["message"] for o in outs)
    assert not sched.reqs and not worker.live
    sched.fail = False
    worker.handle(_gen("c"))
    worker.step()
    assert [o.rid for o in sent.pop().outputs] == ["c"]
    worker.handle(AbortReq(rid="c"))
    assert sent.pop().outputs[0].finish_reason["message"] == "aborted"
    worker.handle(RpcReq(id=5, method="flush_cache"))
    assert sent.pop() == RpcReply(id=5, result=True)
    worker.handle(RpcReq(id=6, method="no_such_method"))
    reply = sent.pop()
    assert reply.id == 6 and "no_such_method" in reply.error
    worker.handle(Shutdown())
    assert worker.stopping


def test_worker_holds_a_non_streaming_request_until_it_finishes():
    """A caller that waits for the whole result gets one output, with every token and logprob and
    the detokenization options; a streaming request still gets every step's."""
    sent: list = []
    sched = FakeScheduler()
    worker = SchedulerWorker(sched, sent.append)
    quiet = _gen("q")
    quiet.stream = False
    worker.handle(quiet)
    worker.handle(_gen("s"))
    for _ in range(3):
        worker.step()
        assert [o.rid for o in sent.pop().outputs] == ["s"]
    worker.handle(AbortReq(rid="q"))
    (out,) = sent.pop().outputs
    assert out.rid == "q" and out.new_ids == [7, 7, 7] and out.finish_reason["type"] == "abort"
    assert out.skip_special_tokens is True and out.spaces_between_special_tokens is True
    assert not worker.held and not worker.quiet and "q" not in worker.live
    a = TokenOutput(
        rid="x",
        new_ids=[1],
        output_logprobs=[[-0.5, 1]],
        input_logprobs=[[None, 9]],
        skip_special_tokens=False,
        prompt_tokens=4,
    )
    b = TokenOutput(
        rid="x",
        new_ids=[2, 3],
        output_logprobs=[[-1.0, 2], [-2.0, 3]],
        prompt_tokens=4,
        cached_tokens=2,
        finish_reason={"type": "length", "length": 3},
    )
    m = a.merged(b)
    assert m.new_ids == [1, 2, 3] and m.output_logprobs == [[-0.5, 1], [-1.0, 2], [-2.0, 3]]
    assert m.input_logprobs == [[None, 9]] and m.skip_special_tokens is False
    assert m.finish_reason == b.finish_reason and (m.prompt_tokens, m.cached_tokens) == (4, 2)


# --- the wire format ---------------------------------------------------------------------------
def test_every_message_round_trips_through_msgpack():
    import numpy as np

    params = SamplingParams(temperature=0.5, stop=["\n"], stop_token_ids=[3], seed=2**62, json_schema="{}")
    to_sched = [
        GenerateInput(
            rid="r1",
            input_ids=[1, 2, 3],
            params=params,
            seed=2**62 + 3,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        ),
        AbortReq(rid="r1"),
        RpcReq(id=1, method="get_server_info"),
        Shutdown(),
    ]
    from_sched = [
        TokenOutputBatch(
            outputs=[
                TokenOutput(
                    rid="r1",
                    new_ids=[5],
                    output_logprobs=[[-math.inf, 5]],
                    input_logprobs=[[None, 1]],
                    skip_special_tokens=False,
                    spaces_between_special_tokens=True,
                    text_delta="é🙂",
                ),
                TokenOutput(
                    rid="r2", new_ids=[], finish_reason={"type": "stop", "matched": 2}, prompt_tokens=3, cached_tokens=1
                ),
            ]
        ),
        RpcReply(id=1, result={"num_running": 0}),
        RpcReply(id=2, error="ValueError: x"),
        Ready(info={"context_len": 512, "eos_ids": [2]}),
        Fatal(message="bad", kind="value", traceback="tb"),
        Fatal(message="no tokenizer", process="detokenizer"),
    ]
    for union, msgs in (
        (ToScheduler, to_sched),
        (FromScheduler, from_sched),
        (ToDetokenizer, from_sched + [Shutdown()]),
    ):
        codec = Codec(union)
        for msg in msgs:
            data = codec.encode(msg)
            assert not data.startswith(b"\x80")  # not a pickle stream
            assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__  # tagged msgpack map
            assert codec.decode(data) == msg
    # numbers that pass validation (numpy ints) travel as plain ints
    codec = Codec(ToScheduler)
    np_params = SamplingParams(stop_token_ids=[np.int64(4)], max_new_tokens=np.int32(3))
    back = codec.decode(codec.encode(GenerateInput(rid="n", input_ids=[1], params=np_params, seed=0)))
    assert back.params.stop_token_ids == [4] and type(back.params.max_new_tokens) is int
    # a message of the other direction is refused, not guessed
    with pytest.raises(msgspec.ValidationError):
        Codec(ToScheduler).decode(Codec(FromScheduler).encode(Ready(info={})))
