"""Jump-forward decoding: grammar-forced text is appended without sampling one token per step.
Greedy requests verify the forced tokens against the model, so their text equals decoding
without jump-forward; sampled ones take the re-tokenized forced text directly."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import assert_no_leak

import plait

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 20},
        "last_name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Berlin"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["first_name", "last_name", "age", "city", "tags"],
}


def run(disable: bool, params: dict, n: int = 6, **engine_args) -> tuple[list[dict], dict]:
    with plait.Engine(
        model="smollm2", dtype="float32", disable_jump_forward=disable, **{"max_total_tokens": 8192, **engine_args}
    ) as eng:
        tok = eng.tokenizer
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": f"Describe person number {i} as JSON."}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for i in range(n)
        ]
        outs = eng.generate(prompts, params)
        info = eng.get_server_info()
        assert_no_leak(eng)
        return outs, info


def test_greedy_text_equals_without_jump_forward():
    params = {"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMA}
    plain, info_plain = run(True, params)
    jumped, info_jump = run(False, params)
    assert [o["text"] for o in jumped] == [o["text"] for o in plain]
    assert info_plain["num_jump_forward_tokens"] == 0
    assert info_jump["num_jump_forward_tokens"] > 0
    for o in jumped:
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


def test_greedy_jump_forward_under_retraction():
    params = {"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMA}
    plain, _ = run(True, params, n=4)
    squeezed, info = run(False, params, n=4, max_total_tokens=200)
    assert info["num_retractions"] > 0
    assert [o["text"] for o in squeezed] == [o["text"] for o in plain]


def test_sampled_jump_forward_validates():
    outs, info = run(False, {"temperature": 1.0, "max_new_tokens": 128, "json_schema": SCHEMA, "seed": 11})
    assert info["num_jump_forward_tokens"] > 0
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        # protocol: a stop is matched by a str or a token id; a complete grammar ends with EOS
        assert o["meta_info"]["finish_reason"]["matched"] == o["output_ids"][-1]
        assert isinstance(o["output_ids"][-1], int)
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


def test_jump_forward_benchmark_runs(tiny_model_dirs, capsys):
    """`plait bench jump_forward` on a tiny model: jump-forward on and off give identical greedy
    text (its exit code) and the table is printed."""
    from plait.benchmarks import jump_forward

    rc = jump_forward.main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--concurrency",
            "2",
            "--rounds",
            "1",
            "--max-new-tokens",
            "24",
            "--num-threads",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert "| concurrency | jump off req/s | jump on req/s |" in out
    assert rc == 0, out
