"""The Engine (scheduler in its own process) on the real scheduler: protocol shapes, sampling features, caching,
retraction, concurrency and bad input. Tiny random Llama with the real tokenizer unless marked."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from conftest import assert_no_leak

import plait


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    with plait.Engine(
        model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=4096, chunked_prefill_size=64, random_seed=0
    ) as eng:
        yield eng
        assert_no_leak(eng)


GREEDY = {"temperature": 0, "max_new_tokens": 12}


def test_result_shape(engine):
    out = engine.generate("Hello, my name is", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["prompt_tokens"] == len(engine.tokenizer("Hello, my name is").input_ids)
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert isinstance(meta["e2e_latency"], float)
    assert out["text"] == engine.tokenizer.decode(
        [t for t in out["output_ids"] if t not in engine.eos_token_ids], skip_special_tokens=True
    )
    assert_no_leak(engine)


def test_repeat_prompt_hits_cache(engine):
    prompt = "A repeated prompt that should come back from the radix cache " * 2
    first = engine.generate(prompt, GREEDY)
    second = engine.generate(prompt, GREEDY)
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"] - 1
    assert second["output_ids"] == first["output_ids"]
    assert_no_leak(engine)


def test_batch_and_n(engine):
    prompts = ["one " * 40, "two two " * 20 + "three"]
    outs = engine.generate(prompts, {"temperature": 0.8, "max_new_tokens": 6, "n": 3, "seed": 7})
    assert len(outs) == 6
    # same seed => same outputs; n copies use seed, seed+1, ...
    engine.flush_cache()
    again = engine.generate(prompts, {"temperature": 0.8, "max_new_tokens": 6, "n": 3, "seed": 7})
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1
    # the n copies share the prompt through the cache: one computes it, the others reuse it
    for item in (again[:3], again[3:]):
        cached = sorted(o["meta_info"]["cached_tokens"] for o in item)
        assert cached[0] == 0 and cached[1] >= item[0]["meta_info"]["prompt_tokens"] - 1
    assert_no_leak(engine)


def test_seed_determinism_across_batches(engine):
    p = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 10, "seed": 123}
    alone = engine.generate("seeded sampling", p)
    mixed = engine.generate(["other prompt", "seeded sampling", "x"], [GREEDY, p, GREEDY])
    assert mixed[1]["output_ids"] == alone["output_ids"]


def test_stop_strings_and_tokens(engine):
    base = engine.generate("Count: one, two,", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    text = base["text"]
    assert len(text) > 4
    stop = text[2:4]
    out = engine.generate(
        "Count: one, two,", {"temperature": 0, "max_new_tokens": 16, "stop": stop, "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    kept = engine.generate(
        "Count: one, two,",
        {"temperature": 0, "max_new_tokens": 16, "stop": stop, "ignore_eos": True, "no_stop_trim": True},
    )
    assert kept["text"].endswith(stop) or stop in kept["text"]
    tok = base["output_ids"][3]
    out = engine.generate(
        "Count: one, two,", {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [tok], "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    assert out["output_ids"] == base["output_ids"][: base["output_ids"].index(tok) + 1]
    assert_no_leak(engine)


def test_stop_regex_stops_at_the_completing_token(engine):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    base = engine.generate("Count: one, two,", params)
    ids, text = base["output_ids"], base["text"]
    assert len(text) > 6
    pattern = re.escape(text[3:6])
    # the first prefix of the greedy output whose text matches: the scheduler must stop right there
    k = next(i for i in range(1, len(ids) + 1) if re.search(pattern, engine.tokenizer.decode(ids[:i])))
    out = engine.generate("Count: one, two,", {**params, "stop_regex": [pattern]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["output_ids"] == ids[:k]
    assert out["text"] == engine.tokenizer.decode(ids[:k])  # SGLang keeps a regex's match
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate("x", {"max_new_tokens": 2, "stop_regex": "("})
    assert_no_leak(engine)


def test_encode_is_the_normalized_last_hidden_state(engine, tiny_model_dirs):
    """Embeddings equal HF transformers' final hidden state (after the last norm) of the last prompt
    token, L2-normalized: a short prompt, one longer than a prefill chunk (64 tokens here), and the
    same two again once cached (two one-token prefills: a batch that looks like a decode step)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()
    prompts = ["An embedding of this sentence", "A longer text to embed, " * 12]
    outs = engine.encode(prompts)
    again = engine.encode(prompts)
    assert all(a["meta_info"]["cached_tokens"] > 0 and "text" not in a for a in again)
    for prompt, out in zip(prompts + prompts, outs + again):
        ids = engine.tokenizer(prompt).input_ids
        with torch.no_grad():
            h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        emb = torch.tensor(out["embedding"])
        assert out["meta_info"]["prompt_tokens"] == len(ids) and emb.shape == h.shape
        assert abs(float(emb.norm()) - 1) < 1e-5
        assert torch.allclose(emb, torch.nn.functional.normalize(h, dim=-1), atol=1e-4)
    assert_no_leak(engine)


def test_min_new_tokens_and_ignore_eos(engine):
    eos = sorted(engine.eos_token_ids)
    out = engine.generate("x", {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8, "stop_token_ids": eos})
    assert len(out["output_ids"]) == 8
    out = engine.generate("x", {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_logprobs(engine):
    prompt = "Logprobs are log probabilities of tokens"
    ids = engine.tokenizer(prompt).input_ids
    out = engine.generate(
        prompt,
        {"temperature": 0, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[2:]
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in inp)
    assert all(isinstance(txt, str) for _, _, txt in inp)
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    # greedy: the chosen token is the top-1 of each output position
    for (lp, t, _), top in zip(outp, meta["output_top_logprobs"]):
        assert top[0][1] == t and abs(top[0][0] - lp) < 1e-5 and len(top) == 3
    # prefill-only: input logprobs from position 0 (null there), and they agree with the above
    pre = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True)
    pin = pre["meta_info"]["input_token_logprobs"]
    assert pre["text"] == "" and pre["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert pin[0][0] is None and len(pin) == len(ids)
    for (a, _, _), (b, _, _) in zip(pin[2:], inp):
        assert abs(a - b) < 1e-4
    # without logprob_start_len, no input logprobs when generating
    plain = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 2}, return_logprob=True)
    assert "input_token_logprobs" not in plain["meta_info"]
    assert_no_leak(engine)


def test_streaming_is_cumulative(engine):
    full = engine.generate("Stream this please", {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})
    chunks = list(
        engine.generate("Stream this please", {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}, stream=True)
    )
    assert len(chunks) == 10
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert_no_leak(engine)


def test_stream_abandoned_is_aborted(engine):
    it = engine.generate("abandon me", {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}, stream=True)
    next(it)
    it.close()
    engine.generate("sync point", {"max_new_tokens": 1})
    assert_no_leak(engine)


def test_async_generate(engine):
    async def main():
        outs = await asyncio.gather(*[engine.async_generate(f"async {i}", GREEDY) for i in range(4)])
        chunks = [c async for c in await engine.async_generate("async stream", GREEDY, stream=True)]
        return outs, chunks

    outs, chunks = asyncio.run(main())
    assert len(outs) == 4 and all(o["meta_info"]["completion_tokens"] > 0 for o in outs)
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_concurrent_requests_equal_alone(engine):
    prompts = [("word " * (1 + (i * 7) % 40)) + str(i) for i in range(64)]
    params = [{"temperature": 0, "max_new_tokens": 4 + i % 9, "ignore_eos": True} for i in range(64)]
    engine.flush_cache()
    together = engine.generate(prompts, params)
    for i in range(0, 64, 9):
        engine.flush_cache()
        alone = engine.generate(prompts[i], params[i])
        assert together[i]["output_ids"] == alone["output_ids"], i
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"bogus_key": 1}, "bogus_key"),
    ],
)
def test_bad_sampling_params(engine, bad, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("hi", bad)


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * 600, sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[], sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate("a", input_ids=[1, 2])
    with pytest.raises(ValueError, match="unknown engine argument"):
        plait.Engine(model="smollm2", not_an_arg=3)


def test_unknown_model_names_what_was_tried():
    with pytest.raises(ValueError, match="does-not-exist"):
        plait.Engine(model="/nonexistent/does-not-exist")


def test_retraction_under_small_pool(tiny_model_dirs):
    prompts = [f"Request number {i} asks for a fairly long answer about" for i in range(8)]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=4096) as big:
        expected = [big.generate(p, params)["output_ids"] for p in prompts]
    with plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=160) as small:
        got = small.generate(prompts, params)
        assert small.get_server_info()["num_retractions"] > 0
        assert [g["output_ids"] for g in got] == expected
        assert_no_leak(small)


def test_fcfs_and_no_radix_cache(tiny_model_dirs):
    with plait.Engine(
        model=tiny_model_dirs["qwen3"],
        dtype="float32",
        max_total_tokens=2048,
        schedule_policy="fcfs",
        disable_radix_cache=True,
    ) as eng:
        a = eng.generate("same prompt twice", GREEDY)
        b = eng.generate("same prompt twice", GREEDY)
        assert b["meta_info"]["cached_tokens"] == 0
        assert a["output_ids"] == b["output_ids"]
        assert eng.get_server_info()["cache_size"] == 0
        assert_no_leak(eng)


def test_single_prompt_with_n_returns_list(engine):
    outs = engine.generate("n copies", {"temperature": 0.7, "max_new_tokens": 3, "n": 3, "seed": 2})
    assert isinstance(outs, list) and len(outs) == 3
    with pytest.raises(ValueError, match="token ids"):
        engine.generate(input_ids=[1, 10**7], sampling_params={"max_new_tokens": 1})


def test_abort_before_submit_and_rid_reuse(engine):
    engine.abort("early-bird")  # a client racing its own request
    out = engine.generate("early", {"max_new_tokens": 50, "ignore_eos": True}, rid="early-bird")
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    done = engine.generate("reuse", {"max_new_tokens": 2}, rid="reused")
    engine.abort("reused")  # aborting a finished request does nothing...
    again = engine.generate("reuse", {"max_new_tokens": 2}, rid="reused")
    assert again["meta_info"]["finish_reason"]["type"] == done["meta_info"]["finish_reason"]["type"] != "abort"
    assert_no_leak(engine)


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "mistral-window", "qwen3-moe", "qwen2-moe", "mixtral"])
def test_new_families_serve_greedy_as_hf(arch, tiny_model_dirs):
    """Each newer family through the whole engine (scheduler, batching, prepacked linears): greedy
    ids equal HF `generate`'s, for two prompts batched together."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # (longer than the tiny Phi-3's original context of 8: HF then uses the long RoPE factors, as
    # plait does throughout)
    prompts = [[1, 450, 4996, 17354, 1701, 432, 9810, 975, 278], [1, 3439, 338, 263, 1243, 310, 278, 4333, 29889, 13]]
    with plait.Engine(model=path, dtype="float32", max_total_tokens=2048) as eng:
        outs = eng.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
        )
        assert_no_leak(eng)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0]
        assert out["output_ids"] == ref[len(ids) :].tolist()
