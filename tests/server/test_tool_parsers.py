"""--tool-call-parser: each family's calls are told from its chat template, held to the tools'
schemas as the model opens them, read back whole and streamed (the parsers alone, on every split of
the text; and through the server with a tiny model whose greedy pick is the family's call opener)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from conftest import one_track_model, reassemble_tool_calls, serve

from plait.runtime.server.openai_tools import ToolPlan, parse_tools, tool_call_tags
from plait.runtime.server.tool_calls import ToolStream, parse_tool_calls
from plait.runtime.server.tool_parsers import (
    HERMES,
    LLAMA3,
    MISTRAL,
    PLAIN_JSON,
    detect_format,
    tool_call_format,
)

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "maximum": 100}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [TIME, ADD]
NAMES = ["get_time", "add"]
WANT = [("add", {"a": 1, "b": 2}), ("get_time", {"tz": "JST"})]
# each family writing WANT, after some text where the family allows it
WRITTEN = {
    "hermes": 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "JST"}}\n</tool_call>',
    "mistral": 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "get_time", "arguments": {"tz": "JST"}}]',
    "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_time", "parameters": {"tz": "JST"}}',
}
FORMATS = {"hermes": HERMES, "mistral": MISTRAL, "llama3": LLAMA3}


def _template(marker: str) -> str:
    """A chat template that renders tools and whose source names a family's call syntax."""
    return (
        "{# calls: " + marker + " #}{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def test_format_told_from_the_template():
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is HERMES  # our tools block
    assert detect_format(_template("<tool_call>")) is HERMES
    assert detect_format(_template("[TOOL_CALLS]")) is MISTRAL
    assert detect_format(_template("<|python_tag|>")) is LLAMA3
    assert detect_format(_template('{"name": function name, "parameters": dictionary}')) is LLAMA3
    assert detect_format(_template("call the tools")) is PLAIN_JSON
    # the flag overrides a template that renders tools, never our block's Hermes
    assert tool_call_format("mistral", _template("call the tools")) is MISTRAL
    assert tool_call_format("llama3_json", "{{ messages }}") is HERMES


@pytest.mark.parametrize("family", list(WRITTEN))
def test_calls_read_back(family):
    fmt = FORMATS[family]
    content, calls = parse_tool_calls(WRITTEN[family], NAMES, fmt)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == WANT
    assert content == (None if family == "llama3" else "Sure.")
    # Llama 3 at times writes its call after <|python_tag|>; a cut-off call stays text
    if family == "llama3":
        assert parse_tool_calls("<|python_tag|>" + WRITTEN[family], NAMES, fmt)[1] == calls
    cut = WRITTEN[family][: WRITTEN[family].rindex('"JST"')]
    assert parse_tool_calls(cut, NAMES, fmt) == (cut, [])
    assert parse_tool_calls("no call here", NAMES, fmt) == ("no call here", [])


@pytest.mark.parametrize("live", [True, False])
@pytest.mark.parametrize("family", list(WRITTEN))
def test_calls_stream_on_every_split(family, live):
    """Streamed one character at a time, the deltas add up to the parsed calls and the content."""
    fmt = FORMATS[family] if live else PLAIN_JSON
    text = WRITTEN[family] if live or family != "mistral" else WRITTEN["hermes"]
    plan = ToolPlan(TOOLS, "auto", fmt=fmt)
    stream, deltas = ToolStream(plan), []
    for end in range(1, len(text) + 1):
        deltas += stream.update(text[:end])
    last, reason = stream.finish(text, "stop")
    deltas += last
    calls = reassemble_tool_calls(deltas)
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == WANT
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == ("" if family == "llama3" else "Sure.")


@pytest.mark.parametrize("family", list(WRITTEN))
def test_auto_mode_holds_each_family_s_calls(family, smollm2_path):
    """Auto mode's structural tag in each family's syntax: free text passes, an opened call is held
    to an offered tool's schema."""
    from transformers import AutoTokenizer

    from plait.grammar import GrammarSpec, make_backend

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    plan = parse_tools({"tools": TOOLS, "parallel_tool_calls": False})
    plan.fmt = FORMATS[family]
    spec = GrammarSpec.from_structural_tag({"type": "structural_tag", "format": tool_call_tags(plan)})
    backend = make_backend("auto", tok, 49152)

    def walk(text: str):
        m = backend.compile(spec).matcher()
        return m, all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))

    fmt = FORMATS[family]
    good = "I will look. " + fmt.begin("get_time") + '{"tz": "UTC"}' + fmt.end
    m, ok = walk(good)
    assert ok and m.can_end()
    for bad in (fmt.begin("get_time") + '{"tz": "PST"', fmt.begin("add") + '{"a": 1, "b": 200', fmt.trigger + '"rm"'):
        assert not walk(bad)[1], bad


OPENERS = {"mistral": "[TOOL_CALLS]", "llama3": '{"name": ', "hermes": "<tool_call>"}
MARKERS = {"mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>", "hermes": "<tool_call>"}  # in the template


@pytest.fixture(scope="module")
def opener_model(tmp_path_factory, smollm2_path):
    """family -> a tiny model whose greedy pick is that family's call opener (an added token)."""
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            folder = str(tmp_path_factory.mktemp(f"tiny-{family}-caller"))
            opener = OPENERS[family.removesuffix("-special")]
            made[family] = one_track_model(folder, smollm2_path, {opener: 10.0}, special=family.endswith("-special"))
        return made[family]

    return get


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", ["mistral", "llama3", "hermes", "mistral-special"])
def test_server_reads_each_family_s_calls(opener_model, family, stream):
    """Through the server, tool_choice auto on a template of each family: the model opens a call in
    that family's syntax, the grammar holds it to the tool's schema, the answer is a tool call.
    mistral-special: [TOOL_CALLS] is a special token, as in Mistral's tokenizers (it opens the
    call as its text; skipped in the output, the call array is read back)."""
    import plait
    from plait.runtime.server.http_server import create_app

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
        "tools": [TIME],
        "parallel_tool_calls": False,
        "max_tokens": 128,
        "temperature": 0,
        "stream": stream,
    }
    with plait.Engine(
        model=opener_model(family),
        chat_template=_template(MARKERS[family.removesuffix("-special")]),
        max_total_tokens=2048,
    ) as eng:
        with serve(create_app(eng, served_model_name="tiny")) as url:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        args = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls") or [])
        names = [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or [] if "name" in t["function"]]
        reason = (
            chunks[-1]["choices"][0]["finish_reason"]
            if chunks[-1]["choices"]
            else chunks[-2]["choices"][0]["finish_reason"]
        )
    else:
        choice = r.json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        names, args, reason = (
            [c["function"]["name"] for c in calls],
            calls[0]["function"]["arguments"],
            choice["finish_reason"],
        )
    assert names == ["get_time"] and reason == "tool_calls"
    jsonschema.validate(json.loads(args), TIME["function"]["parameters"])


def test_a_special_marker_token_writes_tags_only(smollm2_path):
    """A tokenizer whose [TOOL_CALLS] is a special token: a structural tag's trigger accepts that
    token as its text; every other grammar still refuses it (in a JSON string, say)."""
    import torch
    from transformers import AutoTokenizer

    from plait.grammar import GrammarSpec, make_backend

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    backend = make_backend("xgrammar", tok, len(tok))
    plan = parse_tools({"tools": TOOLS, "parallel_tool_calls": False})
    plan.fmt = MISTRAL
    tag = backend.compile(GrammarSpec.from_structural_tag({"type": "structural_tag", "format": tool_call_tags(plan)}))
    assert tag.matcher().accept(marker)
    doc = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "string"}))).matcher()
    assert doc.accept(tok.encode('"', add_special_tokens=False)[0]) and not doc.accept(marker)
    mask = torch.zeros(1, (len(tok) + 31) // 32, dtype=torch.int32)
    doc.fill_mask(mask, 0)
    assert not (int(mask[0, marker >> 5]) >> (marker & 31)) & 1
