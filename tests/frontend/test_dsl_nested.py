"""The DSL's nested program calls and asyncio API, on the in-process Engine and on a real HTTP
server (RuntimeEndpoint) over the same tiny random Llama (real SmolLM2 tokenizer), plus
concurrency checks on a fake slow backend and a smoke run of `benchmarks/programs.py`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import SlowBackend, assert_no_leak, serve

import plait
from plait.frontend import ProgramError

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    with plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=8192, random_seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def tiny_url(tiny):
    from plait.runtime.server.http_server import create_app

    with serve(create_app(tiny)) as url:
        yield url


@pytest.fixture(params=["engine", "http"])
def be(request, tiny):
    """The same engine, in process and behind a real HTTP server."""
    if request.param == "engine":
        return plait.EngineBackend(tiny)
    return plait.RuntimeEndpoint(request.getfixturevalue("tiny_url"))


def native(tiny, prompt: str, max_new_tokens: int) -> str:
    return tiny.generate(prompt, {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0})["text"]


# --- programs used below ------------------------------------------------------------------------------
@plait.function
def answer(s, q, var):
    s += "Q: " + q + "\nA:" + plait.gen(var, max_tokens=3, ignore_eos=True)


@plait.function
def free(s):
    s += " More:" + plait.gen("free")  # no max_tokens: the call's (or the run's) setting


@plait.function
def quiz(s):
    s += "Quiz.\n"
    s += answer("one?", "a1")  # appended: runs here, inline
    s += "\n" + answer("two?", "a2") + "\n"  # inside a list
    answer(s, "three?", "a3")  # the state passed explicitly
    s += free(max_tokens=2)  # its own setting, for its own gens only
    s += " Last:" + plait.gen("last") + " Echo:" + s["a1"]


@plait.function
def quiz_flat(s):
    s += "Quiz.\n"
    s += "Q: one?\nA:" + plait.gen("a1", max_tokens=3, ignore_eos=True)
    s += "\nQ: two?\nA:" + plait.gen("a2", max_tokens=3, ignore_eos=True) + "\n"
    s += "Q: three?\nA:" + plait.gen("a3", max_tokens=3, ignore_eos=True)
    s += " More:" + plait.gen("free", max_tokens=2)
    s += " Last:" + plait.gen("last") + " Echo:" + s["a1"]


# --- nested calls ---------------------------------------------------------------------------------------
def test_nested_inline_matches_flat_program(tiny, be):
    st = quiz.run(backend=be, max_tokens=4, ignore_eos=True, **GREEDY)
    flat = quiz_flat.run(backend=be, max_tokens=4, ignore_eos=True, **GREEDY)
    assert st.text() == flat.text()
    for var in ("a1", "a2", "a3", "free", "last"):
        assert st[var] == flat[var]
    # inner's gens continue the outer text (not a fresh program) ...
    assert st["a1"] == native(tiny, "Quiz.\nQ: one?\nA:", 3)
    # ... inner's own max_tokens=2 applied to its gen, and the run's 4 again after it
    assert st.get_meta_info("free")["completion_tokens"] == 2
    assert st.get_meta_info("last")["completion_tokens"] == 4
    assert_no_leak(tiny)


@plait.function
def expand(s, tip):
    s += "Expand: " + tip + "\n" + plait.gen("detail", max_tokens=3, ignore_eos=True)


@plait.function
def tips(s, splice):
    s += "Tips:\n1." + plait.gen("tip_1", max_tokens=3, ignore_eos=True)
    s += "\n2." + plait.gen("tip_2", max_tokens=3, ignore_eos=True) + "\n"
    b1 = expand(tip=s["tip_1"])  # SGLang's multi-function program
    b2 = expand(tip=s["tip_2"])
    if splice:
        s += b1  # its text, and its variables, appended
    else:
        s += "Tip 1:" + b1["detail"] + "\nTip 2:" + b2["detail"]
    s["b2_text"] = b2.text()


def test_nested_call_as_own_program(tiny, be):
    st = tips.run(splice=False, backend=be, **GREEDY)
    t1, t2 = st["tip_1"], st["tip_2"]
    d1, d2 = native(tiny, "Expand: " + t1 + "\n", 3), native(tiny, "Expand: " + t2 + "\n", 3)
    assert st.text() == f"Tips:\n1.{t1}\n2.{t2}\nTip 1:{d1}\nTip 2:{d2}"
    assert st["b2_text"] == "Expand: " + t2 + "\n" + d2
    assert "detail" not in st  # its own state, not the caller's
    st = tips.run(splice=True, backend=be, **GREEDY)
    assert st.text() == f"Tips:\n1.{t1}\n2.{t2}\nExpand: {t1}\n{d1}" and st["detail"] == d1


@plait.function
def branchy(s):
    s += "Three ways:\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += answer(f"way {i}?", "way")  # a nested call on each fork
    forks.join()
    s += "Best:" + plait.gen("best", max_tokens=2, ignore_eos=True)


def test_nested_call_in_forks_and_streaming(tiny, be):
    st = branchy.run(backend=be, **GREEDY)
    assert st["way"] == [native(tiny, f"Three ways:\nQ: way {i}?\nA:", 3) for i in range(3)]
    assert st.text() == "Three ways:\nBest:" + st["best"]
    streamed = quiz.run(backend=be, max_tokens=4, ignore_eos=True, stream=True, **GREEDY)
    pieces = list(streamed.text_iter())
    whole = quiz.run(backend=be, max_tokens=4, ignore_eos=True, **GREEDY)
    assert "".join(pieces) == whole.text() == streamed.text() and len(pieces) > 8
    streamed = quiz.run(backend=be, max_tokens=4, ignore_eos=True, stream=True, **GREEDY)
    assert "".join(streamed.text_iter("a2")) == whole["a2"]  # a variable set by a nested call


def test_nested_errors_and_batch(be):
    @plait.function
    def broken(s):
        s += "x" + plait.gen("g", max_tokens=1)
        raise ValueError("inner failed")

    @plait.function
    def outer(s, fail):
        s += "Start."
        s += broken() if fail else answer("q?", "a")

    with pytest.raises(ValueError, match="inner failed"):
        outer.run(fail=True, backend=be)
    states = outer.run_batch([{"fail": f} for f in (False, True, False)], backend=be, **GREEDY)
    assert [type(st.error()) for st in states] == [type(None), ValueError, type(None)]
    assert states[0]["a"] == states[2]["a"] and states[0].text() == "Start.Q: q?\nA:" + states[0]["a"]


def test_own_program_calls_run_concurrently():
    slow = SlowBackend(0.4)

    @plait.function
    def outer(s):
        s += "a" + plait.gen("first")
        calls = [expand(tip=s["first"]) for _ in range(4)]  # started when the first is read
        s += "".join(c["detail"] for c in calls)

    st = outer.run(backend=slow)
    assert st.text() == "ax" + "x" * 4 and slow.peak == 4


@plait.function
def bad_regex(s):
    s += "x" + plait.gen("g", regex="[", max_tokens=2)


# --- asyncio --------------------------------------------------------------------------------------------
def test_run_async_and_async_streaming(be):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        start = time.perf_counter()
        states = await asyncio.gather(
            *(quiz.run_async(backend=be, max_tokens=4, ignore_eos=True, **GREEDY) for _ in range(3))
        )
        streamed = await quiz.run_async(backend=be, max_tokens=4, ignore_eos=True, stream=True, **GREEDY)
        pieces = [p async for p in streamed.text_async_iter()]
        streamed = await quiz.run_async(backend=be, max_tokens=4, ignore_eos=True, stream=True, **GREEDY)
        with_meta = [x async for x in streamed.text_async_iter("last", return_meta_data=True)]
        whole = [p async for p in states[0].text_async_iter()]  # not streamed: all at once
        with pytest.raises(ProgramError, match="regex"):
            await bad_regex.run_async(backend=be)
        tick_task.cancel()
        return states, pieces, with_meta, whole, ticks, time.perf_counter() - start

    states, pieces, with_meta, whole, ticks, elapsed = asyncio.run(main())
    ref = quiz.run(backend=be, max_tokens=4, ignore_eos=True, **GREEDY)
    assert [st.text() for st in states] == [ref.text()] * 3 and whole == [ref.text()]
    assert "".join(pieces) == ref.text() and len(pieces) > 8
    assert "".join(p for p, _ in with_meta) == ref["last"]
    assert with_meta[-1][1]["completion_tokens"] == 4
    # The loop kept running while the programs ran. A blocked loop ticks about never; a free one
    # every 5 ms, or far less often when client threads hold the GIL on a loaded CPU, so the bar
    # is a few ticks per second, not the free rate.
    assert ticks >= max(3, 4 * elapsed), (ticks, elapsed)


def test_run_async_does_not_block_the_loop():
    slow = SlowBackend(0.3)

    @plait.function
    def prog(s, k):
        s += str(k) + plait.gen("g")
        s += plait.gen("h")

    async def main():
        t = time.monotonic()
        states = await asyncio.gather(*(prog.run_async(k, backend=slow) for k in range(20)))
        return states, time.monotonic() - t

    states, dt = asyncio.run(main())
    assert [st.text() for st in states] == [f"{k}xx" for k in range(20)]
    assert slow.peak == 20  # all twenty at once, none waiting for a thread pool slot
    assert dt < 3.0  # sequential would be 12 s


# --- the benchmark --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_programs_benchmark_smoke(tiny_model_dirs, tmp_path):
    out = tmp_path / "programs.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.benchmarks.programs",
            "--model",
            tiny_model_dirs["llama"],
            "--dtype",
            "float32",
            "--num-programs",
            "4",
            "--max-tokens",
            "2",
            "--num-shots",
            "2",
            "--max-total-tokens",
            "16384",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "programs/s" in proc.stdout and "hit rate" in proc.stdout and "speedup" in proc.stdout
    r = json.loads(out.read_text())
    assert r["plait"]["calls"] == r["sequential"]["calls"] == 1 + 4 + 1 + 3  # qa, tot, json, chat
    assert r["plait"]["hit_rate"] > 0.3 and r["sequential"]["seconds"] > 0
    assert r["sequential"]["cached_tokens"] == 0
    assert r["plait"]["prompt_tokens"] >= r["sequential"]["prompt_tokens"]  # the same calls (+ any warm-up)
