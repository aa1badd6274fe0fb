"""Anthropic's Messages API (/v1/messages) driven by the `anthropic` SDK itself against a live server on
loopback over the default model: text, stop sequences, usage with cache reads, a tool call and its
result fed back, streaming (text and a tool call's input_json_delta), count_tokens, and errors in
Anthropic's shape with its own exception classes."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

from conftest import serve  # noqa: E402

pytestmark = pytest.mark.integration

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
GREEDY = {"temperature": 0}  # the SDK dropped `temperature`; the API still takes it


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_create_text_usage_and_cache_reads(client):
    kw = dict(
        model="smollm2",
        max_tokens=24,
        extra_body=GREEDY,
        system="Answer in one short sentence.",
        messages=[{"role": "user", "content": "Name a colour of the sky."}],
    )
    first = client.messages.create(**kw)
    assert first.type == "message" and first.role == "assistant" and first.model == "smollm2"
    assert [b.type for b in first.content] == ["text"] and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens") and first.stop_sequence is None
    assert 1 <= first.usage.output_tokens <= 24
    counted = client.messages.count_tokens(model="smollm2", system=kw["system"], messages=kw["messages"])
    assert counted.input_tokens == first.usage.input_tokens
    again = client.messages.create(**kw)
    assert again.content[0].text == first.content[0].text  # greedy
    assert again.usage.cache_read_input_tokens >= again.usage.input_tokens - 1  # the prompt came from the cache


def test_stop_sequence(client):
    kw = dict(
        model="smollm2", max_tokens=40, extra_body=GREEDY, messages=[{"role": "user", "content": "Count to ten."}]
    )
    text = client.messages.create(**kw).content[0].text
    assert len(text) > 8
    stop = text[4:7]
    out = client.messages.create(**kw, stop_sequences=[stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[: text.index(stop)]


def test_tool_use_and_result_round_trip(client):
    r = client.messages.create(
        model="smollm2",
        max_tokens=80,
        extra_body=GREEDY,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    follow = client.messages.create(
        model="smollm2",
        max_tokens=30,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=ASK
        + [
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "12 degrees and raining"}],
            },
        ],
    )
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content


def test_stream_text_and_a_tool_call(client):
    kw = dict(model="smollm2", max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "Say hello."}])
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == client.messages.create(**kw).content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    with client.messages.stream(
        model="smollm2",
        max_tokens=80,
        extra_body=GREEDY,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK read input_json_delta
    call = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])  # the SDK joined the deltas


def test_output_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population_millions": {"type": "number"}},
        "required": ["city", "population_millions"],
        "additionalProperties": False,
    }
    r = client.messages.create(
        model="smollm2",
        max_tokens=80,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert r.stop_reason == "end_turn"
    import json

    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_errors_in_anthropic_shape(client, url, engine):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model="smollm2",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        )
    raw = httpx.post(url + "/v1/messages", json={"model": "smollm2", "messages": ASK}, timeout=30)
    assert raw.status_code == 400
    assert raw.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: field required"},
    }
    from plait.runtime.server.http_server import create_app

    with serve(create_app(engine, api_key="s3cret", served_model_name="smollm2")) as base:
        good = anthropic.Anthropic(base_url=base, api_key="s3cret", max_retries=0)  # sends x-api-key
        assert good.messages.create(model="smollm2", max_tokens=2, messages=ASK).usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model="smollm2", max_tokens=2, messages=ASK
            )
        assert e.value.body["error"]["type"] == "authentication_error"
