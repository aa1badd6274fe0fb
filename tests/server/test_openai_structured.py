"""Structured output and tool calling on the OpenAI-compatible API: the official `openai` client
against a real server on loopback over the real default model (SmolLM2-135M-Instruct), plus the
tool-call parsing and schema helpers on their own."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import reassemble_tool_calls, serve

import plait
from plait.runtime.server.http_server import create_app
from plait.runtime.server.openai_tools import ToolPlan, parse_tools, tool_call_schema
from plait.runtime.server.tool_calls import ToolStream, parse_tool_calls

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000}, "b": {"$ref": "#/$defs/small"}},
            "required": ["a", "b"],
            "additionalProperties": False,
            "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 99}},
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


# --- helpers (no model) -----------------------------------------------------------------------
def test_parse_tool_calls_formats():
    names = ["add", "get_weather"]
    assert parse_tool_calls("just text", names) == ("just text", [])
    content, calls = parse_tool_calls(
        'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}</tool_call>',
        names,
    )
    assert content == "Sure." and [c["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"a": 1, "b": 2}
    assert parse_tool_calls(' {"name": "add", "arguments": {"a": 3}}', names)[1][0]["arguments"] == '{"a": 3}'
    assert parse_tool_calls('[{"name": "add", "parameters": {}}]', names) == (
        None,
        [{"name": "add", "arguments": "{}"}],
    )
    # unknown function, malformed or cut-off calls stay text
    for text in ('{"name": "rm", "arguments": {}}', '<tool_call>{"name": "add", "argu', '{"a": 1}'):
        assert parse_tool_calls(text, names) == (text, [])


def test_tool_stream_holds_back_call_syntax():
    from plait.runtime.server.tool_parsers import PLAIN_JSON

    plan = ToolPlan(TOOLS, "auto", fmt=PLAIN_JSON)  # calls read from free text, not held by a grammar
    stream, text, deltas = ToolStream(plan), "", []
    for piece in ["Let me", " check <", "tool_", 'call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>']:
        text += piece
        deltas += stream.update(text)
    assert "".join(d["content"] for d in deltas) == "Let me check "
    last, reason = stream.finish(text, "stop")
    assert reason == "tool_calls" and last[0]["tool_calls"][0]["function"]["name"] == "get_time"
    plain = ToolStream(plan)
    assert plain.update("a <") == [{"content": "a "}] and plain.finish("a <b", "stop") == ([{"content": "<b"}], "stop")


@pytest.mark.parametrize(
    "choice, text",
    [
        (
            "required",
            '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]',
        ),
        ("auto", 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "JST"}}\n</tool_call>'),
    ],
)
def test_tool_calls_stream_as_written(choice, text):
    """Grammar-held calls stream as OpenAI sends them: each call's id and name as soon as the name
    is written, then its arguments in pieces that add up to the final JSON."""
    plan = parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": True})
    stream, deltas, name_seen_at = ToolStream(plan), [], None
    for end in range(1, len(text) + 1):
        step = stream.update(text[:end])
        if name_seen_at is None and any(c.get("id") for d in step for c in d.get("tool_calls", [])):
            name_seen_at = end
        deltas += step
    last, reason = stream.finish(text, "stop")
    deltas += last
    calls = reassemble_tool_calls(deltas)
    assert reason == "tool_calls" and name_seen_at is not None and name_seen_at < len(text) - 10
    assert sum(1 for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]) > 3  # in pieces
    want = (
        [("add", {"a": 1, "b": 2}), ("get_time", {"tz": "UTC"})]
        if choice == "required"
        else [("get_time", {"tz": "JST"})]
    )
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want
    assert "".join(d.get("content", "") for d in deltas) == ("" if choice == "required" else "Sure. ")


def test_required_schema_accepts_exactly_the_calls():
    schema = tool_call_schema(parse_tools({"tools": TOOLS, "tool_choice": "required"}))
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    for bad in (
        {"name": "add", "arguments": {"a": 1, "b": 200}},
        {"name": "nope", "arguments": {}},
        {"name": "get_time", "arguments": {"tz": "UTC"}, "extra": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    parallel = tool_call_schema(parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True}))
    jsonschema.validate([{"name": "get_time", "arguments": {"tz": "JST"}}], parallel)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], parallel)


def _tag_matcher(tokenizer, fmt):
    from plait.grammar import GrammarSpec, make_backend

    backend = make_backend("auto", tokenizer, 49152)
    return backend.compile(GrammarSpec.from_structural_tag(fmt)).matcher()


def _walk(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_auto_mode_constrains_calls_once_opened(smollm2_path):
    """Auto mode's structural tag: free text passes; after `<tool_call>` only a call of an offered
    tool with valid arguments; `parallel_tool_calls: false` ends the output after one call."""
    from transformers import AutoTokenizer

    from plait.runtime.server.openai_tools import tool_call_tags

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    fmt = {"type": "structural_tag", "format": tool_call_tags(parse_tools({"tools": TOOLS}))}
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    m = _tag_matcher(tok, fmt)
    assert _walk(m, tok, "Let me add them. " + call + " And again: " + call) and m.can_end()
    for bad in (
        '<tool_call>\n{"name": "rm", ',
        '<tool_call>\n{"name": "add", "arguments": {"a": "x"',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 200}',
    ):
        assert not _walk(_tag_matcher(tok, fmt), tok, bad), bad
    one = {
        "type": "structural_tag",
        "format": tool_call_tags(parse_tools({"tools": TOOLS, "parallel_tool_calls": False})),
    }
    m = _tag_matcher(tok, one)
    assert _walk(m, tok, "Sure. " + call) and m.can_end() and not _walk(m, tok, " more")


NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}<{{ m.tool_call_id }} {{ m.name }}>{% endif %}{{ '\\n' }}{% endfor %}"
)
HISTORY = [
    *ASK_WEATHER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 21, "sky": "sunny"}'},
]


def test_render_tools_with_and_without_template_support(smollm2_path):
    from transformers import AutoTokenizer

    from plait.runtime.server.openai_tools import render_chat

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    # SmolLM2's template knows no tools: a system block, calls as <tool_call> text, results as a user turn
    text = tok.decode(render_chat(tok, HISTORY, TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "add"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call><|im_end|>'
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in text
    # a template that renders tools gets them, the calls (arguments parsed) and the results natively
    tok.chat_template = NATIVE_TEMPLATE
    text = tok.decode(render_chat(tok, HISTORY, TOOLS))
    assert text.splitlines() == [
        "TOOLS:get_weather,add,get_time",
        "user:What is the weather like in Paris today?",
        "assistant:[call_abc get_weather Paris]",
        'tool:{"temperature": 21, "sky": "sunny"}<call_abc get_weather>',
    ]


# --- server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oai():
    with plait.Engine(model="smollm2", dtype="float32", max_total_tokens=8192, random_seed=0) as engine:
        with serve(create_app(engine, served_model_name="smollm2")) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(oai, messages=ASK_WEATHER, **kw):
    return oai.chat.completions.create(model="smollm2", messages=messages, **kw)


def bad_request(fn, *words: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    assert e.value.status_code == 400
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    for w in words:
        assert w in message, message
    return message


def assert_call(call, names=PARAMS) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_malformed_schema_is_refused_naming_the_keyword():
    """A pattern that is no regex: the 400 says where. One Python's `re` cannot read but ECMA-262
    can (`\\p{Cc}`, as every JSON Schema validator of the field reads it) is a schema like any other."""
    from plait.runtime.server.http_common import ApiError
    from plait.runtime.server.openai_fields import require_schema

    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": "^[a-z"}}}
    with pytest.raises(ApiError, match="at 'properties/v/pattern'") as e:
        require_schema(schema, "response_format.json_schema.schema")
    assert e.value.status == 400
    require_schema({"type": "object", "properties": {"v": {"type": "string", "pattern": "^[^\\p{Cc}]+$"}}}, "s")


def test_a_ref_to_nothing_is_refused_by_name():
    """A pointer that names nothing, read within the resource that holds it (saucectl's bundled
    sub-schemas point past their own `$id`): 400. A fragment-only `$id` (localazy's `"#/properties/x"`)
    names a place, not a new resource, so the pointers under it are the document's."""
    from plait.runtime.server.http_common import ApiError
    from plait.runtime.server.openai_fields import require_schema

    nested = {"$defs": {"n": {"$id": "https://example.com/n.json", "properties": {"x": {"$ref": "#/$defs/m"}}}}}
    with pytest.raises(ApiError, match="'#/\\$defs/m' points at nothing") as e:
        require_schema({**nested, "$defs": {**nested["$defs"], "m": {}}}, "s")
    assert e.value.status == 400
    fragment_id = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "properties": {"a": {"$id": "#/properties/a", "items": {"$ref": "#/definitions/d"}}},
        "definitions": {"d": {"type": "integer"}},
    }
    require_schema(fragment_id, "s")


def test_a_remote_ref_is_refused_by_name():
    """A $ref into another document cannot be followed by a grammar or checked by a validator: 400."""
    from plait.runtime.server.http_common import ApiError
    from plait.runtime.server.openai_fields import remote_ref, require_schema

    k8s = "https://json.schemastore.org/kubernetes-definitions.json#/definitions/ObjectMeta"
    schema = {"type": "object", "properties": {"meta": {"$ref": k8s}, "n": {"$ref": "#/$defs/n"}}, "$defs": {"n": {}}}
    with pytest.raises(ApiError, match="ObjectMeta' points outside the schema") as e:
        require_schema(schema, "response_format.json_schema.schema")
    assert e.value.status == 400
    # refs inside the schema, by pointer or by an $id it holds, are its own
    inner = {"$id": "https://example.com/root.json", "$defs": {"a": {"$id": "a.json", "type": "string"}}}
    assert remote_ref({**inner, "properties": {"x": {"$ref": "a.json"}, "y": {"$ref": "#/$defs/a"}}}) is None
    assert remote_ref({**inner, "properties": {"x": {"$ref": "b.json"}}}) == "b.json"
    assert remote_ref({"enum": [{"$ref": "https://x"}]}) is None  # data, not a schema


# --- structured output ------------------------------------------------------------------------
@pytest.mark.integration
def test_response_format_json_schema(oai):
    out = chat(
        oai,
        [{"role": "user", "content": "Describe a person as JSON with name, age and city."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        temperature=1.0,
        seed=7,
        n=2,
        max_tokens=120,
    )
    assert len(out.choices) == 2
    for c in out.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)


@pytest.mark.integration
def test_response_format_json_object(oai):
    out = chat(
        oai,
        [{"role": "user", "content": "Give me a JSON object with a field 'answer' set to 42."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.integration
def test_json_object_with_a_schema(oai):
    """llama.cpp's form (what instructor's JSON_SCHEMA mode sends): the schema binds, not just "an
    object"; and json_object without one still gives an object."""
    out = chat(
        oai,
        [{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_object", "schema": PERSON},
        temperature=1.0,
        seed=5,
        max_tokens=120,
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


@pytest.mark.integration
def test_an_approximated_schema_never_returns_an_invalid_document(oai):
    """`oneOf` compiles as `anyOf` (llguidance's lenient mode). With two identical branches every
    integer breaks `oneOf` (valid under both): the document is withheld with a 500 naming the
    keyword, streamed or not, instead of coming back as "stop" — sampled again first where that
    can help (json_resample: not streamed, temperature > 0)."""
    twice = {"oneOf": [{"type": "integer", "maximum": 9}, {"type": "integer", "maximum": 9}]}
    ask = [{"role": "user", "content": "Pick a number."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": twice}}
    with pytest.raises(openai.InternalServerError, match="invalid output.*'oneOf'"):
        chat(oai, ask, response_format=fmt, temperature=0, max_tokens=16)
    with pytest.raises(openai.APIError, match="invalid output.*'oneOf'"):
        list(chat(oai, ask, response_format=fmt, temperature=0, max_tokens=16, stream=True))
    with pytest.raises(openai.InternalServerError, match=r"'oneOf'.*\(3 documents sampled, none valid\)"):
        chat(oai, ask, response_format=fmt, temperature=1.0, seed=3, max_tokens=16)
    ok = {"oneOf": [{"type": "integer", "maximum": -1}, {"type": "integer", "minimum": 0}]}  # disjoint
    out = chat(
        oai,
        ask,
        temperature=0,
        max_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": ok}},
    )
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), int)


@pytest.mark.integration
def test_documents_finish_within_max_tokens(oai):
    """A free string and a free number at temperature 0.8 with a tight max_tokens: the length
    guards close the document in budget ("stop", valid), and json_max_string_length binds per
    request."""
    notes = {
        "type": "object",
        "properties": {"notes": {"type": "string"}, "score": {"type": "number"}},
        "required": ["notes", "score"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "notes", "schema": notes}}
    ask = [{"role": "user", "content": "Write long notes about Paris, then score it."}]
    for seed in range(3):
        out = chat(oai, ask, response_format=fmt, temperature=0.8, seed=seed, max_tokens=24)
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), notes)
    out = chat(
        oai, ask, response_format=fmt, temperature=0.8, seed=0, max_tokens=200, extra_body={"json_max_string_length": 6}
    )
    doc = json.loads(out.choices[0].message.content)
    assert len(doc["notes"]) <= 6 + 16  # the bound, plus at most the closing token's characters


@pytest.mark.integration
def test_vllm_structured_outputs(oai):
    """vLLM's `structured_outputs` object: json, choice, regex, grammar each bind the output."""
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    out = chat(oai, ask, temperature=1.0, seed=2, max_tokens=120, extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = chat(
        oai,
        ask,
        temperature=1.0,
        seed=2,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"], "disable_fallback": True}},
    )
    assert out.choices[0].message.content in ("alpha", "beta")
    out = chat(
        oai, ask, temperature=1.0, seed=2, max_tokens=12, extra_body={"structured_outputs": {"regex": "[a-c]{3}"}}
    )
    assert re.fullmatch("[a-c]{3}", out.choices[0].message.content)
    out = chat(
        oai,
        ask,
        temperature=1.0,
        seed=2,
        max_tokens=12,
        extra_body={"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}},
    )
    assert out.choices[0].message.content in ("xy", "xz")


@pytest.mark.integration
def test_regex_and_choice(oai):
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    out = oai.completions.create(
        model="smollm2", prompt="A product code:", max_tokens=16, temperature=1.0, seed=3, extra_body={"regex": pattern}
    )
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    options = ["yes", "no", "maybe"]
    out = chat(
        oai,
        [{"role": "user", "content": "Is Paris in France?"}],
        temperature=1.0,
        seed=1,
        n=2,
        max_tokens=8,
        extra_body={"choice": options},
    )
    assert all(c.message.content in options for c in out.choices)


@pytest.mark.integration
def test_stream_response_format(oai):
    stream = chat(
        oai,
        [{"role": "user", "content": "Describe a person as JSON."}],
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=1.0,
        seed=11,
        max_tokens=120,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


# --- tools ------------------------------------------------------------------------------------
@pytest.mark.integration
def test_tool_choice_required(oai):
    out = chat(oai, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5, n=2, max_tokens=120)
    for c in out.choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        assert_call(c.message.tool_calls[0])


@pytest.mark.integration
def test_tool_choice_named(oai):
    out = chat(
        oai,
        [{"role": "user", "content": "What is 2 plus 3?"}],
        tools=TOOLS,
        temperature=1.0,
        seed=2,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=60,
    )
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["add"]
    assert_call(c.message.tool_calls[0])


@pytest.mark.integration
def test_tool_choice_auto(oai):
    out = chat(oai, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=40)
    msg = out.choices[0].message
    if msg.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:  # held to the tool's schema once <tool_call> opens
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    else:
        assert isinstance(msg.content, str) and out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.integration
def test_auto_tools_with_a_response_format(oai):
    """tools on auto plus a JSON-schema response_format: either a document in the format or a call,
    never free text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(3):
        out = chat(
            oai,
            ASK_WEATHER,
            tools=TOOLS,
            tool_choice="auto",
            response_format=fmt,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        msg = out.choices[0].message
        if msg.tool_calls:
            for call in msg.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        else:
            jsonschema.validate(json.loads(msg.content), PERSON)


@pytest.mark.integration
def test_structural_tag_response_format(oai):
    """response_format structural_tag (xgrammar's format, as vLLM and SGLang take it) and the older
    structures / triggers form."""
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<city>"],
            "at_least_one": True,
            "stop_after_first": True,
            "tags": [
                {
                    "type": "tag",
                    "begin": "<city>",
                    "end": "</city>",
                    "content": {"type": "json_schema", "json_schema": PERSON},
                }
            ],
        },
    }
    legacy = {
        "type": "structural_tag",
        "triggers": ["<city>"],
        "structures": [{"begin": "<city>", "schema": PERSON, "end": "</city>"}],
    }
    for fmt in (tag, legacy):
        out = chat(
            oai, [{"role": "user", "content": "Describe a person."}], response_format=fmt, temperature=0, max_tokens=150
        )
        text = out.choices[0].message.content
        if fmt is tag or "<city>" in text:
            inner = text.split("<city>", 1)[1].split("</city>", 1)[0]
            jsonschema.validate(json.loads(inner), PERSON)


@pytest.mark.integration
def test_stream_tool_calls(oai):
    def reassemble(stream):
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in stream:
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                assert not c.delta.content
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = call["id"] or d.id
                    call["name"] += (d.function.name or "") if d.function else ""
                    call["arguments"] += (d.function.arguments or "") if d.function else ""
        assert reasons[-1] == "tool_calls"
        return list(calls.values())

    named = reassemble(
        chat(
            oai,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
            temperature=1.0,
            seed=4,
            max_tokens=100,
        )
    )
    required = reassemble(
        chat(oai, tools=TOOLS, tool_choice="required", stream=True, temperature=1.0, seed=9, max_tokens=120)
    )
    assert [c["name"] for c in named] == ["get_weather"] and len(required) == 1
    for call in named + required:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


@pytest.mark.integration
def test_tool_history_accepted(oai):
    messages = HISTORY
    out = chat(oai, messages, tools=TOOLS, temperature=0, max_tokens=12)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # and without tools offered this turn
    out = chat(oai, messages, temperature=0, max_tokens=4)
    assert isinstance(out.choices[0].message.content, str)


# --- errors -----------------------------------------------------------------------------------
@pytest.mark.integration
def test_errors(oai):
    bad_request(lambda: chat(oai, max_tokens=4, extra_body={"regex": "(unclosed"}), "invalid grammar")
    bad_request(lambda: list(chat(oai, max_tokens=4, stream=True, extra_body={"regex": "[z-a]"})), "invalid grammar")
    bad_request(
        lambda: oai.completions.create(
            model="smollm2", prompt="x", max_tokens=4, extra_body={"ebnf": "root ::= nothing_defined"}
        ),
        "invalid grammar",
    )
    bad_request(lambda: chat(oai, max_tokens=4, extra_body={"json_schema": "{not json"}), "json_schema")
    bad_request(
        lambda: chat(
            oai,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}},
        ),
        "schema",
    )
    bad_request(lambda: chat(oai, max_tokens=4, response_format={"type": "yaml"}), "response_format")
    bad_request(
        lambda: chat(oai, max_tokens=4, response_format={"type": "json_object"}, extra_body={"regex": "a+"}),
        "response_format",
        "regex",
    )
    bad_request(lambda: chat(oai, max_tokens=4, extra_body={"regex": "a+", "choice": ["a"]}), "at most one")
    # constraint-like fields plait does not enforce: named, never silently ignored
    bad_request(
        lambda: chat(oai, max_tokens=4, extra_body={"structured_outputs": {"structural_tag": "{}"}}),
        "structured_outputs.structural_tag",
    )
    bad_request(lambda: chat(oai, max_tokens=4, extra_body={"structural_tag": {"structures": []}}), "structural_tag")
    bad_request(
        lambda: chat(oai, max_tokens=4, extra_body={"guided_whitespace_pattern": " "}), "guided_whitespace_pattern"
    )
    bad_request(
        lambda: chat(oai, max_tokens=4, extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
        "at most one",
    )
    bad_request(
        lambda: chat(oai, max_tokens=4, response_format={"type": "json_object", "schema": {"type": 12}}),
        "response_format.schema",
    )
    bad_request(
        lambda: chat(oai, max_tokens=4, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        "at most one",
    )
    bad_request(
        lambda: chat(oai, max_tokens=4, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}),
        "launch",
    )
    bad_request(lambda: chat(oai, max_tokens=4, tool_choice="required"), "tools")
    bad_request(
        lambda: chat(oai, max_tokens=4, tools=[{"type": "function", "function": {"name": "bad name!"}}]), "name"
    )
    bad_request(
        lambda: chat(
            oai,
            max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
        ),
        "parameters",
    )
    bad_request(lambda: chat(oai, max_tokens=4, tools=[WEATHER, WEATHER]), "unique")
    bad_request(lambda: chat(oai, max_tokens=4, tool_choice="sometimes", tools=TOOLS), "tool_choice")
    bad_request(
        lambda: chat(oai, [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}], max_tokens=4),
        "tool_calls",
    )
    bad_request(
        lambda: oai.completions.create(model="smollm2", prompt="x", max_tokens=4, extra_body={"tools": TOOLS}),
        "chat/completions",
    )
    # the server is still fine
    assert chat(oai, max_tokens=2, temperature=0).choices[0].finish_reason in ("stop", "length")
