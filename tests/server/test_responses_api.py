"""OpenAI's Responses API (/v1/responses) driven by the openai SDK and the openai Agents SDK against a
live server on loopback over the default model: text, instructions, previous_response_id, stored
responses, a function call and its output fed back, streamed events (text and function-call
arguments), `responses.parse` into a pydantic model, errors, and a one-tool agent run to its end."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Oslo?"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_create_retrieve_and_continue(client):
    first = client.responses.create(
        model="smollm2",
        instructions="Answer in one short sentence.",
        input="Name a colour of the sky.",
        max_output_tokens=24,
        temperature=0,
    )
    assert first.object == "response" and first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.output[0].content[0].type == "output_text"
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model="smollm2", input="And at night?", previous_response_id=first.id, max_output_tokens=16, temperature=0
    )
    # the follow-up carries the first exchange: a longer prompt whose start came from the cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert second.previous_response_id == first.id


def test_function_call_and_output_round_trip(client):
    r = client.responses.create(
        model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model="smollm2",
        previous_response_id=r.id,
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "12 degrees, raining"}],
    )
    assert follow.status in ("completed", "incomplete") and follow.output


def test_stream_text_and_function_call(client):
    kw = dict(model="smollm2", input="Say hello.", max_output_tokens=20, temperature=0)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == client.responses.create(**kw).output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    events = list(
        client.responses.create(
            model="smollm2",
            input=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = next(o for o in events[-1].response.output if o.type == "function_call")
    assert args == final.arguments
    jsonschema.validate(json.loads(args), WEATHER["parameters"])


def test_parse_into_a_pydantic_model(client):
    r = client.responses.parse(
        model="smollm2",
        input="Tell me about Paris: its name and country.",
        text_format=City,
        max_output_tokens=80,
        temperature=0,
    )
    assert isinstance(r.output_parsed, City)


def test_errors(client):
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="smollm2", input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32)


def test_agents_sdk_runs_a_one_tool_agent(url):
    """The openai Agents SDK (Responses API by default) runs an agent whose tool must be called once:
    the run ends with a final answer after the tool's result went back to the model."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 12 degrees and raining in {city}."

    model = agents.OpenAIResponsesModel(
        model="smollm2", openai_client=openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    )
    agent = agents.Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        model=model,
        tool_use_behavior="run_llm_again",
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=60, tool_choice="required", reset_tool_choice=True
        ),
    )
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=4))
    assert len(calls) >= 1 and isinstance(result.final_output, str) and result.final_output
