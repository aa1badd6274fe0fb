"""The DSL (plait.frontend): mechanics on the in-process Engine over the tiny random Llama (real
SmolLM2 tokenizer and chat template), concurrency on a fake slow backend, and integration tests on
the real default model behind a real HTTP server (uvicorn in a thread, as in test_http_server.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from typing import Literal

import jsonschema
import pydantic
import pytest
from conftest import SlowBackend, serve

import plait
from plait.frontend import ProgramError

GREEDY = {"temperature": 0}


# --- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    with plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=8192, random_seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def be(tiny):
    return plait.EngineBackend(tiny)


# --- mechanics on the tiny model -------------------------------------------------------------------
def test_import_is_cheap():
    code = "import sys, plait; plait.gen; plait.function; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_gen_max_tokens_and_stop_match_native(tiny, be):
    @plait.function
    def prog(s, q):
        s += "Question: " + q + "\nAnswer:"
        s += plait.gen("a", max_tokens=7, ignore_eos=True)
        s += "\nAgain:" + plait.gen("b", max_tokens=30, stop=[" the", "e", "."])

    st = prog.run(q="why?", backend=be, **GREEDY)
    meta = st.get_meta_info("a")
    assert meta["completion_tokens"] == 7 and meta["finish_reason"] == {"type": "length", "length": 7}
    prompt_a = "Question: why?\nAnswer:"
    assert st["a"] == tiny.generate(prompt_a, {"max_new_tokens": 7, "ignore_eos": True, "temperature": 0})["text"]
    prompt_b = prompt_a + st["a"] + "\nAgain:"
    native = tiny.generate(prompt_b, {"max_new_tokens": 30, "stop": [" the", "e", "."], "temperature": 0})
    assert st["b"] == native["text"] and not any(x in st["b"] for x in (" the", "e", "."))
    assert st.text() == prompt_b + st["b"]
    assert st.get_meta_info("b")["finish_reason"] == native["meta_info"]["finish_reason"]


def test_regex_dtype_and_json_schema(be):
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "string", "pattern": "^[0-9]{2}$"},
            "c": {"enum": ["red", "green"]},
        },
        "required": ["ok", "n", "c"],
        "additionalProperties": False,
    }

    class Item(pydantic.BaseModel):
        color: Literal["red", "blue"]
        flag: bool

    @plait.function
    def prog(s):
        s += "Phone: " + plait.gen("phone", regex=r"\d{3}-\d{4}", max_tokens=16)
        s += "\nAge: " + plait.gen_int("age", max_tokens=3)
        s += "\nOk: " + plait.gen("ok", dtype=bool, max_tokens=4)
        s += "\nName: " + plait.gen_string("name", max_tokens=6)
        s += "\nJSON: " + plait.gen("j", json_schema=schema, max_tokens=64)
        s += "\nItem: " + plait.gen("item", json_schema=Item, max_tokens=48)
        s += "\nRaw: " + plait.gen("raw", json_schema=json.dumps(schema), max_tokens=64)

    st = prog.run(backend=be, **GREEDY)
    assert re.fullmatch(r"\d{3}-\d{4}", st["phone"])
    assert re.fullmatch(r"[-+]?[0-9]+", st["age"]), st["age"]
    assert st["ok"] in ("True", "False")
    assert st["name"].startswith('"')
    jsonschema.validate(json.loads(st["j"]), schema)
    jsonschema.validate(json.loads(st["raw"]), schema)
    Item.model_validate_json(st["item"])


def test_select_scores_and_methods(tiny, be):
    choices = [" London", " Paris", " a potato"]

    @plait.function
    def prog(s, method):
        s += "The capital of France is"
        s += plait.select("city", choices=choices, choices_method=method)

    st = prog.run(method="token_length_normalized", backend=be)
    meta = st.get_meta_info("city")
    scores = meta["normalized_prompt_logprobs"]
    assert st["city"] == choices[max(range(3), key=scores.__getitem__)]
    assert st.text() == "The capital of France is" + st["city"]
    # each score is the mean logprob of the choice's own tokens, as the engine reports them
    for choice, score in zip(choices, scores):
        full = "The capital of France is" + choice
        n_choice = len(tiny.tokenizer(full).input_ids) - len(tiny.tokenizer("The capital of France is").input_ids)
        out = tiny.generate(full, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        lps = [t[0] for t in out["meta_info"]["input_token_logprobs"][-n_choice:]]
        assert math.isclose(score, sum(lps) / len(lps), rel_tol=1e-4, abs_tol=1e-4)
    for method in ("greedy_token", "unconditional_likelihood_normalized"):
        st = prog.run(method=method, backend=be)
        assert st["city"] in choices and st.get_meta_info("city")["choices_method"] == method

    # gen(choices=...) is a select
    @plait.function
    def prog2(s):
        s += "The capital of France is" + plait.gen("c", choices=choices)

    assert prog2.run(backend=be)["c"] == prog.run(method="token_length_normalized", backend=be)["city"]


def test_roles_render_with_model_template(tiny, be):
    @plait.function
    def chat(s, system):
        if system:
            s += plait.system("You are terse.")
        s += plait.user("Hi there")
        s += plait.assistant(plait.gen("a1", max_tokens=5, ignore_eos=True))
        with s.user():
            s += "And now?"
        s += plait.assistant_begin()
        s += plait.gen("a2", max_tokens=5, ignore_eos=True)
        s += plait.assistant_end()

    for system in (True, False):
        st = chat.run(system=system, backend=be, **GREEDY)
        msgs = st.messages()
        assert [m["role"] for m in msgs] == ["system"] * system + ["user", "assistant", "user", "assistant"]
        assert msgs[-1]["content"] == st["a2"]
        # exactly what the tokenizer's own chat template renders (incl. its default system prompt)
        assert st.text() == tiny.tokenizer.apply_chat_template(msgs, tokenize=False)
    named = chat.run(system=True, backend=plait.EngineBackend(tiny, chat_template="default"), **GREEDY)
    assert named.text().startswith("SYSTEM:You are terse.\nUSER:Hi there\nASSISTANT:")
    assert plait.get_chat_template("llama-3").get_prefix_and_suffix("user")[1] == "<|eot_id|>"


def test_fork_join(be):
    @plait.function
    def tips(s, mode):
        s += "Tips for health:\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:"
            f += plait.gen("detail", max_tokens=4, ignore_eos=True)
        forks.join(mode)
        s += "Summary:" + forks[0]["detail"]

    st = tips.run(mode="gather_variable", backend=be, **GREEDY)
    details = st["detail"]
    assert isinstance(details, list) and len(details) == 3 and all(details)
    assert st.text() == "Tips for health:\nSummary:" + details[0]
    st = tips.run(mode="concate_and_append", backend=be, **GREEDY)
    d = st["detail"]
    assert st.text() == "Tips for health:\n" + "".join(f"Tip {i + 1}:{d[i]}" for i in range(3)) + "Summary:" + d[0]


def test_forks_and_batch_run_concurrently():
    slow = SlowBackend(0.3)

    @plait.function
    def prog(s, k):
        forks = s.fork(4)
        for f in forks:
            f += plait.gen("x")
        forks.join()
        s += str(k)

    t = time.monotonic()
    st = prog.run(k=1, backend=slow)
    assert st["x"] == ["x"] * 4 and slow.peak == 4 and time.monotonic() - t < 1.1
    slow.peak = 0
    t = time.monotonic()
    states = prog.run_batch([{"k": i} for i in range(5)], backend=slow, num_threads=5)
    assert [s.text() for s in states] == [str(i) for i in range(5)]
    assert slow.peak == 20 and time.monotonic() - t < 3.0


def test_run_batch_one_failing(be, capsys):
    @plait.function
    def prog(s, q):
        if q == "boom":
            raise ValueError("bad question")
        s += "Q: " + q + "\nA:"
        s += plait.gen("a", max_tokens=4, ignore_eos=True, regex="[" if q == "bad-regex" else None)

    qs = ["one", "boom", "two", "bad-regex", "three"]
    states = prog.run_batch([{"q": q} for q in qs], backend=be, progress_bar=True, num_threads=3, **GREEDY)
    assert "5/5" in capsys.readouterr().err  # tqdm's bar
    for q, st in zip(qs, states):
        if q in ("boom", "bad-regex"):
            assert st.error() is not None
            with pytest.raises((ProgramError, KeyError)):
                st["a"]
        else:
            assert st.error() is None and st.get_meta_info("a")["completion_tokens"] == 4
    assert isinstance(states[1].error(), ValueError)
    assert "regex" in str(states[3].error()).lower()
    with pytest.raises(ProgramError, match="regex"):  # run() raises
        prog.run(q="bad-regex", backend=be)


def test_streaming_and_bind(be):
    @plait.function
    def prog(s, topic):
        s += plait.user("Tell me about " + topic)
        s += plait.assistant(plait.gen("answer", max_tokens=12, ignore_eos=True))
        s += "\nMore:" + plait.gen("more", max_tokens=6, ignore_eos=True)

    whole = prog.run(topic="cats", backend=be, **GREEDY)
    st = prog.run(topic="cats", backend=be, stream=True, **GREEDY)
    chunks = list(st.text_iter())
    assert "".join(chunks) == whole.text() == st.text() and len(chunks) > 3
    st = prog.run(topic="cats", backend=be, stream=True, **GREEDY)
    pieces = list(st.text_iter("answer"))
    assert "".join(pieces) == whole["answer"] and len([p for p in pieces if p]) > 1
    assert st["more"] == whole["more"]
    bound = prog.bind(topic="cats")
    assert bound.run(backend=be, **GREEDY).text() == whole.text()


def test_cache_prefix(tiny, be):
    prefix = "A long constant instruction that every run of this program starts with. " * 4

    @plait.function
    def prog(s, q):
        s += prefix
        s += "Q: " + q + "\nA:" + plait.gen("a", max_tokens=2, ignore_eos=True)

    plait.flush_cache(be)
    assert prog.run(q="x", backend=be).get_meta_info("a")["cached_tokens"] == 0
    plait.flush_cache(be)
    prog.cache(be)  # traces the constant prefix, sends it prefill-only
    n = len(tiny.tokenizer(prefix).input_ids)
    assert prog.run(q="y", backend=be).get_meta_info("a")["cached_tokens"] >= n - 2


def test_default_backend_accepts_engine(tiny):
    @plait.function
    def prog(s):
        s += "Hello" + plait.gen("g", max_tokens=3, ignore_eos=True)

    old = plait.get_default_backend()
    plait.set_default_backend(tiny)
    try:
        assert prog.run(**GREEDY).get_meta_info("g")["completion_tokens"] == 3
        assert isinstance(plait.get_default_backend(), plait.EngineBackend)
    finally:
        plait.frontend.api._default_backend = old


# --- integration: the real model behind a real server -----------------------------------------------
@pytest.fixture(scope="module")
def real_url(smollm2_path):
    from plait.runtime.server.http_server import create_app

    with plait.Engine(model="smollm2", dtype="float32", max_total_tokens=8192, random_seed=0) as eng:
        with serve(create_app(eng)) as url:
            yield url


@pytest.fixture(scope="module")
def endpoint(real_url):
    return plait.RuntimeEndpoint(real_url)


@pytest.mark.integration
def test_sglang_style_program_unchanged(endpoint):
    import plait as sgl

    @sgl.function
    def qa(s, question):
        s += (
            "You are a concise assistant that answers geography questions with a single word or a "
            "short phrase.\n\nQ: " + question + "\nA:"
        )
        s += sgl.gen("answer", max_tokens=12, stop="\n")

    @sgl.function
    def capital(s):
        s += "The capital of France is"
        s += sgl.select("city", choices=[" London", " Paris", " a potato"])
        s += ". It is" + sgl.gen("more", max_tokens=4, ignore_eos=True)

    @sgl.function
    def chat(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("first", max_tokens=16))

    assert endpoint.get_chat_template().name == "chatml"  # SmolLM2's family, matched by name
    sgl.set_default_backend(endpoint)
    try:
        st = qa.run(question="What is the capital of France?", temperature=0)
        assert "Paris" in st["answer"] and "\n" not in st["answer"]
        st = capital.run(temperature=0)
        assert st["city"] == " Paris" and st.text().startswith("The capital of France is Paris. It is")
        scores = st.get_meta_info("city")["normalized_prompt_logprobs"]
        assert max(range(3), key=scores.__getitem__) == 1
        st = chat.run(question="What is the capital of France?", temperature=0)
        assert st.text().startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
        assert "Paris" in st["first"] and "<|im_end|>" not in st["first"]
        states = qa.run_batch(
            [{"question": f"What is the capital of {c}?"} for c in ("France", "Italy")],
            temperature=0,
            progress_bar=False,
        )
        assert "Paris" in states[0]["answer"] and states[1]["answer"].strip()
        sgl.flush_cache()
    finally:
        plait.frontend.api._default_backend = None


@pytest.mark.integration
def test_real_structured_and_stream(endpoint):
    class City(pydantic.BaseModel):
        name: str
        country: str

    @plait.function
    def extract(s):
        s += "Paris is the capital of France. As JSON: "
        s += plait.gen("city", json_schema=City, max_tokens=48)
        s += "\nIts population in millions: " + plait.gen("pop", regex=r"[0-9]{1,2}", max_tokens=4)

    st = extract.run(backend=endpoint, temperature=0)
    City.model_validate_json(st["city"])
    assert re.fullmatch(r"[0-9]{1,2}", st["pop"])
    streamed = extract.run(backend=endpoint, temperature=0, stream=True)
    assert "".join(streamed.text_iter()) == st.text()


@pytest.mark.integration
def test_openai_backend(real_url):
    oa = plait.OpenAIBackend(real_url + "/v1", model="smollm2", api_key="unused")

    @plait.function
    def chat(s):
        s += plait.user("What is the capital of France? One word.")
        s += plait.assistant(plait.gen("a", max_tokens=8))

    st = chat.run(backend=oa, temperature=0)
    assert "Paris" in st["a"] and st.messages()[-1] == {"role": "assistant", "content": st["a"]}

    @plait.function
    def bad(s, kind):
        s += plait.user("Pick.")
        s += plait.assistant(
            plait.select("x", choices=["a", "b"]) if kind == "select" else plait.gen("x", regex="[ab]")
        )

    for kind in ("select", "regex"):
        with pytest.raises(ProgramError, match="cannot"):
            bad.run(kind=kind, backend=oa)
