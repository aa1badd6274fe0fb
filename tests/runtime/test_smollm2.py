"""Integration: the real default model (SmolLM2-135M-Instruct) through plait.Engine."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak
from transformers import AutoModelForCausalLM

import plait

pytestmark = pytest.mark.integration

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [{"role": "user", "content": "List three uses of a paperclip."}],
]


@pytest.fixture(scope="module")
def engine():
    with plait.Engine(model="smollm2", dtype="float32", max_total_tokens=8192) as eng:
        yield eng


def test_greedy_equals_hf_generate(engine, smollm2_path):
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    ours = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 32, "min_new_tokens": 32})
    for prompt, out in zip(prompts, ours):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
        assert out["output_ids"] == ref.tolist()
        assert out["meta_info"]["prompt_tokens"] == ids.shape[1]
    assert_no_leak(engine)


def test_answers_and_caches(engine):
    chat = engine.tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    out = engine.generate(chat, {"temperature": 0, "max_new_tokens": 16})
    assert "Paris" in out["text"]
    again = engine.generate(chat, {"temperature": 0, "max_new_tokens": 16})
    assert again["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 1
    assert again["text"] == out["text"]
    assert_no_leak(engine)


def test_concurrent_mixed_lengths_equal_alone(engine):
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": "Tell me about " + "the number %d " % i * (1 + i % 5)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(16)
    ]
    params = [{"temperature": 0, "max_new_tokens": 6 + i % 7, "ignore_eos": True} for i in range(16)]
    engine.flush_cache()
    together = engine.generate(prompts, params)
    for i in (0, 5, 11):
        engine.flush_cache()
        assert engine.generate(prompts[i], params[i])["output_ids"] == together[i]["output_ids"]
    assert_no_leak(engine)
