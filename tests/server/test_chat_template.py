"""The chat template as users steer it: `chat_template` (`--chat-template`) replaces the model's,
and a request's `chat_template_kwargs` reach the template's own variables (e.g. enable_thinking)."""

from __future__ import annotations

import httpx
import pytest
from conftest import serve

# A Qwen3-like switch: the generation prompt opens an empty think block unless thinking is enabled.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def base(tiny_model_dirs, tmp_path_factory):
    import plait
    from plait.runtime.server.http_server import create_app

    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    with plait.Engine(model=tiny_model_dirs["llama"], chat_template=str(path), max_total_tokens=2048) as eng:
        with serve(create_app(eng, served_model_name="tiny")) as url:
            yield url


def _prompt(base: str, **extra) -> str:
    r = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, **extra})
    assert r.status_code == 200, r.text
    return httpx.post(f"{base}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_the_servers_template_replaces_the_models(base):
    assert _prompt(base) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_kwargs_reach_the_template(base):
    assert _prompt(base, chat_template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert _prompt(base, chat_template_kwargs={"enable_thinking": True}).endswith("assistant\n")
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    usage = [
        httpx.post(f"{base}/v1/chat/completions", json={**body, **extra}).json()["usage"]["prompt_tokens"]
        for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})
    ]
    assert usage[1] > usage[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ([1], "chat_template_kwargs must be an object"),
        ({"add_generation_prompt": False}, "may not set add_generation_prompt"),
        ({"tools": []}, "may not set tools"),
    ],
)
def test_bad_chat_template_kwargs_are_400(base, kwargs, message):
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs},
    )
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(
    "value, message",
    [
        ("/no/such/template.jinja", "no such file"),
        ("{% for m in messages %}{{ m }}", "does not parse"),
    ],
)
def test_a_bad_chat_template_fails_before_the_engine_starts(tiny_model_dirs, value, message):
    import plait

    with pytest.raises(ValueError, match=message):
        plait.Engine(model=tiny_model_dirs["llama"], chat_template=value)
