"""Run each agent-facing client library against a live plait server and print what it got back.

    .venv/bin/python scripts/client_libraries_check.py [--url http://127.0.0.1:30000]

Without --url it starts `plait serve` on the default model (SmolLM2-135M-Instruct) on a free port.
Each line is one library call and its result, so a release note can quote what a user sees: the
openai SDK's Responses API (text, a function-tool round trip, a stream), the openai Agents SDK
(one-tool agent), the anthropic SDK (messages.create and messages.stream with a tool), and
langchain-openai's OpenAIEmbeddings. The tests (tests/server/) assert the same paths; this shows them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = "What is the weather in Paris? Use the tool."


def show(what: str, value) -> None:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    print(f"{what}: {text[:300]}", flush=True)


def openai_responses(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="smollm2", input="Say hello in five words.", max_output_tokens=24, temperature=0)
    show("openai responses.create text", {"output_text": r.output_text, "usage": r.usage.model_dump()})
    r = client.responses.create(model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    call = next(o for o in r.output if o.type == "function_call")
    show("openai responses.create function_call", {"name": call.name, "arguments": call.arguments})
    follow = client.responses.create(
        model="smollm2",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees, raining"}],
        max_output_tokens=40,
        temperature=0,
    )
    show("openai responses.create after the tool output", follow.output_text)
    events = list(client.responses.create(model="smollm2", input="Count to five.", max_output_tokens=16, stream=True))
    show("openai responses stream", {"events": len(events), "types": sorted({e.type for e in events})})


def agents_sdk(url: str) -> None:
    import agents
    import openai

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 12 degrees and raining in {city}."

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        model="smollm2", openai_client=openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    )
    agent = agents.Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=60, tool_choice="required", reset_tool_choice=True
        ),
    )
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=4))
    show("openai-agents Runner.run", {"tool_calls": calls, "final_output": result.final_output})


def anthropic_sdk(url: str) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    msg = client.messages.create(
        model="smollm2",
        max_tokens=24,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
    )
    show("anthropic messages.create", {"content": [b.model_dump() for b in msg.content], "stop": msg.stop_reason})
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    with client.messages.stream(
        model="smollm2",
        max_tokens=60,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": ASK}],
    ) as stream:
        final = stream.get_final_message()
    show(
        "anthropic messages.stream with a tool",
        {"content": [b.model_dump() for b in final.content], "stop": final.stop_reason},
    )


def langchain_embeddings(url: str) -> None:
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="smollm2", base_url=url + "/v1", api_key="unused", check_embedding_ctx_length=False)
    vecs = emb.embed_documents(["plait", "structured generation"])
    show("langchain-openai OpenAIEmbeddings", {"vectors": len(vecs), "dim": len(vecs[0]), "first": vecs[0][:3]})


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "plait")
    proc = subprocess.Popen([exe, "serve", "--model", "smollm2", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("plait serve exited before it was healthy")
        time.sleep(1)
    proc.terminate()
    raise SystemExit("plait serve was not healthy in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one on the default model)")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_server()
    failed = 0
    try:
        for check in (openai_responses, agents_sdk, anthropic_sdk, langchain_embeddings):
            try:
                check(url)
            except Exception as e:  # noqa: BLE001 — each library's failure is reported, the rest still run
                failed += 1
                show(f"{check.__name__} FAILED", f"{type(e).__name__}: {e}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
