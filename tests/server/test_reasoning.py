"""--reasoning-parser: a chat answer's <think> section goes to reasoning_content, whole and
streamed (the parser alone, every split of the text; and through the server with outputs forced by
a regex on a tiny Qwen3)."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import one_track_model, serve

from plait.runtime.server.reasoning import ReasoningStream, split_reasoning

CASES = [  # parser, output, (reasoning, content)
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
    ("qwen3", "Paris.", (None, "Paris.")),
    ("qwen3", "  <think>cut before the end", ("cut before the end", "")),
    ("qwen3", "<think></think>Paris.", (None, "Paris.")),
    ("qwen3", "<thinking is fun", (None, "<thinking is fun")),
    ("deepseek-r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek-r1", "<think>Let me see.\n</think>\nParis.", ("Let me see.", "Paris.")),
    ("deepseek-r1", "Still thinking </thi", ("Still thinking </thi", "")),
]


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_split(parser, text, expected):
    assert split_reasoning(parser, text) == expected


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_streamed_in_any_pieces_equals_the_whole(parser, text, expected):
    """Deltas joined give the whole split's reasoning, and the content seen while streaming only
    ever grows into the final content, for every two cut points of the text."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream, thought, contents = ReasoningStream(parser), "", []
            for k, cut in enumerate((i, j, len(text))):
                delta, content = stream.update(text[:cut], final=k == 2)
                thought += delta
                contents.append(content or "")
            assert (thought or None, contents[-1]) == expected, (i, j)
            assert all(expected[1].startswith(c) or not c for c in contents), (i, j, contents)


def test_unknown_parser_is_refused():
    import plait

    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek-r1"):
        plait.Engine(model="smollm2", reasoning_parser="nope")


FORCED = "<think>\nThe user greets me.\n</think>\n\nHello!"


@pytest.fixture(scope="module")
def base(tiny_model_dirs):
    import plait
    from plait.runtime.server.http_server import create_app

    with plait.Engine(model=tiny_model_dirs["qwen3"], reasoning_parser="qwen3", max_total_tokens=2048) as eng:
        with serve(create_app(eng, served_model_name="tiny")) as url:
            yield url


def _body(**extra):
    import re

    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 64,
        "temperature": 0,
        "regex": re.escape(FORCED),
        **extra,
    }


def test_chat_answer_has_reasoning_content(base):
    r = httpx.post(f"{base}/v1/chat/completions", json=_body())
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("The user greets me.", "Hello!")
    msg = httpx.post(f"{base}/v1/chat/completions", json=_body(separate_reasoning=False)).json()["choices"][0][
        "message"
    ]
    assert msg["content"] == FORCED and "reasoning_content" not in msg


def test_streamed_reasoning_deltas(base):
    thought, content = "", ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=_body(stream=True)) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                assert not (delta.get("reasoning_content") and delta.get("content"))
                thought += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    assert (thought, content) == ("The user greets me.", "Hello!")


def test_separate_reasoning_must_be_a_bool(base):
    r = httpx.post(f"{base}/v1/chat/completions", json=_body(separate_reasoning="no"))
    assert r.status_code == 400 and "separate_reasoning" in r.text


# --- the format binds after the reasoning section ----------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TEMPLATE = (  # Qwen3's shape: no thinking writes an empty section into the generation prompt
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, smollm2_path):
    """A tiny Qwen3 whose greedy choice is always `</think>`, else `<think>`, else what its random
    weights say."""
    return one_track_model(
        str(tmp_path_factory.mktemp("tiny-thinker")), smollm2_path, {"</think>": 10.0, "<think>": 8.0}
    )


def _thinker_answer(folder, parser, **body):
    import plait
    from plait.runtime.server.http_server import create_app

    with plait.Engine(model=folder, reasoning_parser=parser, chat_template=TEMPLATE, max_total_tokens=2048) as eng:
        with serve(create_app(eng, served_model_name="tiny")) as url:
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 48,
                    "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                    **body,
                },
                timeout=120,
            )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_format_binds_after_the_reasoning_section(thinker, parser):
    """The model writes its section (`</think>` is its greedy pick; qwen3 opens it with `<think>`,
    the one marker the format's first mask adds), then the document under the schema."""
    import jsonschema

    choice = _thinker_answer(thinker, parser, separate_reasoning=False)
    text = choice["message"]["content"]
    head = "<think></think>" if parser == "qwen3" else "</think>"
    assert text.startswith(head), text
    jsonschema.validate(json.loads(text[len(head) :]), SCHEMA)
    assert choice["finish_reason"] == "stop"


def test_no_gate_when_the_prompt_closed_the_section(thinker):
    """enable_thinking false: the template wrote an empty section, so the schema binds at once."""
    import jsonschema

    choice = _thinker_answer(thinker, "qwen3", chat_template_kwargs={"enable_thinking": False})
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert "reasoning_content" not in choice["message"]


def test_forced_tool_call_after_the_reasoning_section(thinker):
    """tool_choice "required" on a reasoning model: the section first, then the call its grammar holds."""
    import jsonschema

    tool = {"type": "function", "function": {"name": "set_a", "parameters": SCHEMA}}
    choice = _thinker_answer(thinker, "qwen3", response_format=None, tools=[tool], tool_choice="required")
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["set_a"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA)
