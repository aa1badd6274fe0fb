"""Hardening of the HTTP server over the tiny random Llama: hostile input (each a clear 4xx, and
the next request still works), overload (503 + Retry-After, KV over-commit retracts, request
time limit, body limit), faults (client disconnects at any point, an abort while the grammar
compiles, the model worker SIGKILLed mid-batch, SIGTERM under load) and security (API key on
every route, private socket folder, no pickle, no remote code, model names, no prompts in logs).

Decisions recorded here: unknown fields are ignored (as OpenAI's API does), on every route and in
`sampling_params`; a prompt made only of special tokens is a valid prompt (200); a request with
no Content-Type is read as JSON (curl), any non-JSON Content-Type is a 415."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import httpx
import msgspec
import pytest
from conftest import free_port, serve, wait_healthy
from test_http_server import REPO, assert_error, sse_events, wait_no_kv

import plait
from plait.runtime.server import http_common, http_server
from plait.runtime.server.http_server import create_app

GREEDY = {"temperature": 0, "max_new_tokens": 4}
LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    with plait.Engine(
        model=tiny_model_dirs["llama"],
        dtype="float32",
        max_total_tokens=8192,
        chunked_prefill_size=256,
        max_running_requests=32,
        random_seed=0,
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine):
    with serve(create_app(engine, served_model_name="tiny")) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


def still_serves(http: httpx.Client) -> None:
    out = http.post("/generate", json={"text": "still fine", "sampling_params": GREEDY})
    assert out.status_code == 200, out.text
    assert len(out.json()["output_ids"]) == 4


# --- bad input --------------------------------------------------------------------------------
NATIVE_NUMERIC = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "n",
)
OPENAI_NUMERIC = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "n",
    "logprobs",
)
BAD_NUMBERS = {
    "nan": "NaN",
    "inf": "Infinity",
    "-inf": "-Infinity",
    "neg": "-3",
    "huge": "1" + "0" * 30,
    "hugefloat": "1e400",
}
# Huge but finite is a valid value for these (it flattens / suppresses sampling): 200, not 400.
UNBOUNDED_ABOVE = ("temperature", "repetition_penalty")


def _raw(template: str, value: str) -> bytes:
    return template.replace("VALUE", value).encode()


def _bad_cases() -> list:
    cases = []
    for name in NATIVE_NUMERIC:
        for tag, lit in BAD_NUMBERS.items():
            if name in ("top_k",) and tag == "neg":
                lit = "-2"  # -1 means "off"
            body = _raw(
                '{"text": "x", "sampling_params": {"max_new_tokens": 2, "%s": VALUE}}' % name
                if name != "max_new_tokens"
                else '{"text": "x", "sampling_params": {"%s": VALUE}}' % name,
                lit,
            )
            status = 200 if (tag == "huge" and name in UNBOUNDED_ABOVE) else 400
            cases.append(pytest.param("/generate", body, status, name, id=f"native-{name}-{tag}"))
    for name in OPENAI_NUMERIC:
        for tag, lit in BAD_NUMBERS.items():
            if name == "top_k" and tag == "neg":
                lit = "-2"
            body = _raw(
                '{"prompt": "x", "max_tokens": 2, "%s": VALUE}' % name
                if name != "max_tokens"
                else '{"prompt": "x", "max_tokens": VALUE}',
                lit,
            )
            status = 200 if (tag == "huge" and name in UNBOUNDED_ABOVE) else 400
            cases.append(pytest.param("/v1/completions", body, status, name, id=f"completions-{name}-{tag}"))
    for tag, lit in BAD_NUMBERS.items():
        body = _raw('{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": VALUE}', lit)
        cases.append(pytest.param("/v1/chat/completions", body, 400, "top_logprobs", id=f"chat-top_logprobs-{tag}"))
        body = _raw('{"text": "x", "return_logprob": true, "top_logprobs_num": VALUE}', lit)
        cases.append(pytest.param("/generate", body, 400, "top_logprobs_num", id=f"native-top_logprobs_num-{tag}"))
    deep = {"text": "x", "sampling_params": {"x": json.loads("[" * 200 + "]" * 200)}}
    stops = [f"stop{i}" for i in range(5000)]
    chat = [{"role": "user", "content": "x"}]
    cases += [
        pytest.param("/generate", deep, 400, "nests", id="deep-json"),
        pytest.param("/generate", b"[" * 200_000 + b"]" * 200_000, 400, "nests", id="deeper-than-the-parser"),
        pytest.param("/generate", b'{"text": "caf\xe9 \xff\xfe"}', 400, "JSON", id="invalid-utf8"),
        pytest.param("/generate", {"text": ""}, 400, "empty", id="empty-prompt"),
        pytest.param("/generate", {"input_ids": []}, 400, "empty", id="empty-ids"),
        pytest.param("/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "empty", id="empty-completion"),
        pytest.param("/v1/chat/completions", {"messages": []}, 400, "messages", id="no-messages"),
        pytest.param("/generate", {"text": "x", "sampling_params": {"stop": stops}}, 400, "stop", id="5000-stops"),
        pytest.param("/v1/chat/completions", {"messages": chat, "stop": stops}, 400, "stop", id="5000-stops-chat"),
        pytest.param(
            "/generate", {"text": "x", "sampling_params": {"stop": ["x" * 5000]}}, 400, "stop", id="long-stop"
        ),
        pytest.param(
            "/generate",
            {"text": "x", "sampling_params": {"stop_token_ids": list(range(2000))}},
            400,
            "stop_token_ids",
            id="many-stop-ids",
        ),
        pytest.param("/generate", {"text": "x", "sampling_params": {"n": 10**6}}, 400, "n", id="n-million"),
        pytest.param("/generate", {"text": ["x"] * 2000}, 400, "sequences", id="2000-prompts"),
        pytest.param("/v1/completions", {"prompt": "x", "n": 10**9}, 400, "n", id="completions-n-billion"),
        pytest.param("/generate", {"text": "x", "sampling_params": {"seed": 2**70}}, 400, "seed", id="huge-seed"),
        pytest.param("/generate", {"input_ids": [2**70]}, 400, "input_ids", id="huge-token-id"),
        pytest.param(
            "/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, 400, "grammar", id="bad-regex"
        ),
        pytest.param(
            "/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, 400, "", id="schema-not-json"
        ),
        pytest.param(
            "/v1/chat/completions",
            {
                "messages": chat,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
            },
            400,
            "schema",
            id="schema-invalid",
        ),
        pytest.param("/generate", {"text": "x " * 600}, 400, "context length", id="prompt-too-long"),
        pytest.param("/generate", {"text": "x", "sampling_params": []}, 400, "sampling_params", id="no-params"),
    ]
    return cases


@pytest.mark.parametrize(("path", "body", "status", "word"), _bad_cases())
def test_bad_input(http, engine, path, body, status, word):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    t0 = time.monotonic()
    resp = http.post(path, **kw)
    if status == 200:
        assert resp.status_code == 200, resp.text
    else:
        assert_error(resp, status, word)
    assert time.monotonic() - t0 < 10
    still_serves(http)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/xml"]
)
def test_wrong_content_type(http, content_type):
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        resp = http.post(path, content=b'{"text": "x", "prompt": "x"}', headers={"content-type": content_type})
        assert_error(resp, 415, "application/json")
    still_serves(http)


def test_json_content_types_and_none_accepted(http):
    for ct in ("application/json", "application/json; charset=utf-8", None):
        headers = {"content-type": ct} if ct else {}
        resp = http.post("/generate", content=json.dumps({"text": "x", "sampling_params": GREEDY}), headers=headers)
        assert resp.status_code == 200, (ct, resp.text)


def test_unknown_fields_are_ignored(http):
    """OpenAI ignores unknown fields; so do we, everywhere (documented in api_schema.py)."""
    out = http.post("/generate", json={"text": "x", "bogus": 1, "sampling_params": {**GREEDY, "bogus": [1]}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
    out = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0, "bogus": {"a": 1}})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    out = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x", "extra": 1}], "max_tokens": 2, "frobnicate": True},
    )
    assert out.status_code == 200


def test_special_token_prompts_are_valid(http, engine):
    """A prompt of only special tokens is a prompt: it is answered, not rejected."""
    specials = "".join(engine.tokenizer.all_special_tokens)
    out = http.post("/generate", json={"text": specials * 3, "sampling_params": GREEDY})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
    ids = engine.tokenizer.all_special_ids
    out = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0})
    assert out.status_code == 200


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": "(a+)+$"},
        {"regex": "(a|aa)*b(x+x+)+y"},
        {
            "json_schema": json.dumps(
                {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}, "required": ["s"]}
            )
        },
        {"json_schema": json.dumps({"$ref": "#"})},
        {"json_schema": json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
        {
            "json_schema": json.dumps(
                {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
            )
        },
        {
            "json_schema": json.dumps(
                {
                    "$defs": {
                        "t": {
                            "type": "object",
                            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}},
                        }
                    },
                    "$ref": "#/$defs/t",
                }
            )
        },
    ],
    ids=[
        "nested-quantifier",
        "alternation-blowup",
        "schema-pattern",
        "ref-self",
        "ref-loop",
        "ref-cycle",
        "recursive-tree",
    ],
)
def test_pathological_grammars_answer_in_bounded_time(http, engine, spec):
    """Catastrophic-backtracking patterns and recursive $refs: a 200 (the grammar is fine: no regex
    backtracking is involved) or a clear 400 (it does not compile), within seconds, never a 5xx."""
    t0 = time.monotonic()
    resp = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 12, **spec}})
    assert time.monotonic() - t0 < 30
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert_error(resp, 400, "grammar")
    wait_no_kv(engine)
    still_serves(http)


# --- the published schema ---------------------------------------------------------------------
def test_openapi_describes_the_generate_routes(http):
    spec = http.get("/openapi.json").json()
    comps = spec["components"]["schemas"]
    for path, model in (
        ("/generate", "GenerateRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"200", "400", "503"} <= set(spec["paths"][path]["post"]["responses"])
    sp = comps["SamplingParamsBody"]["properties"]
    temp = next(s for s in sp["temperature"]["anyOf"] if s.get("type") == "number")
    assert temp["minimum"] == 0
    top_p = next(s for s in sp["top_p"]["anyOf"] if s.get("type") == "number")
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    n = next(s for s in comps["ChatCompletionRequest"]["properties"]["n"]["anyOf"] if s.get("type") == "integer")
    assert (n["minimum"], n["maximum"]) == (1, 128)
    assert comps["ChatCompletionRequest"]["required"] == ["messages"]


# --- overload ---------------------------------------------------------------------------------
def test_more_requests_than_the_queue_get_503(engine):
    """12 concurrent requests on a server that holds 3: the rest get 503 + Retry-After at once,
    every one gets an answer, and no KV slot leaks."""
    with serve(create_app(engine, max_queued_requests=3)) as base:

        async def one(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post(
                "/generate",
                json={"text": "load", "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}},
            )

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                return await asyncio.gather(*(one(client) for _ in range(12)))

        answers = asyncio.run(main())
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 503} and codes.count(200) >= 3, codes
    for r in answers:
        if r.status_code == 503:
            assert_error(r, 503, "limit")
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert len(r.json()["output_ids"]) == 64
    wait_no_kv(engine)


def test_kv_overcommit_retracts_and_completes(tiny_model_dirs):
    """8 requests needing ~8 x 110 KV slots on a 320-slot pool: retraction, never a crash; every
    request completes in full."""
    with (
        plait.Engine(
            model=tiny_model_dirs["llama"],
            dtype="float32",
            max_total_tokens=320,
            chunked_prefill_size=256,
            random_seed=0,
        ) as eng,
        serve(create_app(eng)) as base,
    ):

        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            return await client.post(
                "/generate",
                json={
                    "text": f"request number {i} " * 6,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 90, "ignore_eos": True},
                },
            )

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(8)))

        answers = asyncio.run(main())
        assert [r.status_code for r in answers] == [200] * 8
        assert all(len(r.json()["output_ids"]) == 90 for r in answers)
        assert eng.get_server_info()["num_retractions"] > 0
        wait_no_kv(eng)


def test_request_timeout(engine):
    """--request-timeout: a request running longer fails with 504 (an error event when streaming)
    and is aborted, which frees its KV. The limit is short: the tiny model decodes 400 tokens of
    one sequence in ~0.3 s, 8 of them in ~0.6 s (2 cores)."""
    with serve(create_app(engine, request_timeout=0.1)) as base, httpx.Client(base_url=base, timeout=30) as c:
        before = engine.get_server_info()["num_generated_tokens"]
        t0 = time.monotonic()
        resp = c.post("/generate", json={"text": "slow", "sampling_params": {**LONG, "n": 8}})
        assert time.monotonic() - t0 < 5
        assert_error(resp, 504, "limit of 0.1 s")
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "slow", "max_tokens": 400, "n": 8, "stream": True, "ignore_eos": True, "temperature": 0},
        ) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        with c.stream("POST", "/generate", json={"text": "slow", "sampling_params": LONG, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        wait_no_kv(engine)
        assert engine.get_server_info()["num_generated_tokens"] - before < 8 * 400 + 2 * 400
        assert c.post("/generate", json={"text": "quick", "sampling_params": GREEDY}).status_code == 200


def test_body_limit_also_for_chunked_bodies(http):
    def chunks():
        for _ in range(10):
            yield b" " * (1024 * 1024)

    assert_error(http.post("/generate", content=chunks()), 413)
    # a declared length past the limit is refused before any of the body is read
    host, port = http.base_url.host, http.base_url.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 99999999999\r\n\r\n{}"
        )
        head = ""
        while "}}" not in head:
            chunk = sock.recv(65536).decode()
            if not chunk:
                break
            head += chunk
    assert head.startswith("HTTP/1.1 413") and "request_too_large" in head, head
    still_serves(http)


def test_kv_pool_sizing_is_bounded(tiny_model_dirs):
    from plait.runtime.server_args import ServerArgs

    for bad in (0, 1.5, 5.0):
        with pytest.raises(ValueError, match="kv_memory_fraction"):
            ServerArgs(kv_memory_fraction=bad)
    with pytest.raises(ValueError, match="max-total-tokens"):  # ~ petabytes: refused, not OOM-killed
        plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=10**12)


# --- faults -----------------------------------------------------------------------------------
@pytest.mark.parametrize("events_read", [0, 1, 5])
def test_disconnects_at_any_point_free_kv(url, engine, events_read):
    bodies = [
        ("/generate", {"text": "bye", "sampling_params": {**LONG, "n": 1}, "stream": True}),
        ("/v1/completions", {"prompt": "bye", "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "bye"}],
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
                "response_format": {"type": "json_object"},
            },
        ),
    ]
    with httpx.Client(base_url=url, timeout=30) as client:
        for path, body in bodies:
            with client.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for _ in range(events_read):
                    while not next(lines).startswith("data: "):
                        pass
            wait_no_kv(engine, timeout=5)
    # non-streaming, abandoned at different moments
    for wait in (0.01, 0.2):
        with httpx.Client(base_url=url, timeout=wait) as client, pytest.raises(httpx.TimeoutException):
            client.post("/v1/completions", json={"prompt": "bye", "max_tokens": 400, "n": 4, "ignore_eos": True})
        wait_no_kv(engine, timeout=5)
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0


def _slow_schema(i: int) -> dict:
    """A schema (unique per i, so never cached) that takes a while to compile."""
    props = {
        f"field_{i}_{k}": {"type": "string", "pattern": f"^[a-z]{{{k % 7 + 1},{k % 7 + 40}}}[0-9]{{2,9}}$"}
        for k in range(60)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def test_abort_while_grammar_compiles(url, http, engine):
    """Clients that go away while their grammar compiles: nothing leaks, nothing stays queued, and
    the server goes on (the compile finishing later for nobody is harmless). Long enough that the
    client always gives up first: compile plus 20 tokens can take under 50 ms on the tiny model."""
    for i in range(3):
        body = {"text": "x", "sampling_params": {"max_new_tokens": 400, "json_schema": json.dumps(_slow_schema(i))}}
        with httpx.Client(base_url=url, timeout=0.05) as client, pytest.raises(httpx.TimeoutException):
            client.post("/generate", json=body)
    deadline = time.monotonic() + 30
    while True:
        info = engine.get_server_info()
        if info["num_running"] == 0 and info["num_waiting"] == 0 and engine.kv_slots_in_use() == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    still_serves(http)


def test_model_worker_killed_mid_batch(tiny_model_dirs):
    """SIGKILL the scheduler while it generates: every in-flight request ends with an error (503)
    within seconds, /health says unhealthy, new requests get 503 — nothing hangs."""
    eng = plait.Engine(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=4096, random_seed=0)
    try:
        with serve(create_app(eng)) as base:
            results: dict[str, object] = {}

            def nonstream(i: int) -> None:
                results[f"plain{i}"] = httpx.post(
                    base + "/generate", json={"text": f"p{i}", "sampling_params": LONG}, timeout=30
                )

            def stream(i: int) -> None:
                with httpx.stream(
                    "POST",
                    base + "/v1/completions",
                    timeout=30,
                    json={"prompt": f"s{i}", "max_tokens": 400, "stream": True, "ignore_eos": True},
                ) as r:
                    results[f"stream{i}"] = sse_events(r.iter_lines())

            threads = [threading.Thread(target=f, args=(i,)) for i in range(3) for f in (nonstream, stream)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while eng.get_server_info()["num_running"] < 6:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(eng.scheduler_pid, signal.SIGKILL)
            t0 = time.monotonic()
            for t in threads:
                t.join(timeout=15)
                assert not t.is_alive(), "a request hangs after the model worker died"
            assert time.monotonic() - t0 < 10
            for name, res in results.items():
                if name.startswith("plain"):
                    assert_error(res, 503, "died")
                else:
                    assert res[-1] == "[DONE]" and "died" in res[-2]["error"]["message"], res[-3:]
            assert_error(httpx.get(base + "/health"), 503, "died")
            assert_error(httpx.post(base + "/generate", json={"text": "x"}), 503)
    finally:
        eng.shutdown()


def test_serve_worker_killed_under_load_exits(tiny_model_dirs):
    """`plait serve`: the model worker SIGKILLed mid-batch; in-flight requests end (error or closed
    connection, never a hang) and the server exits non-zero within seconds."""
    with served(tiny_model_dirs["llama"]) as (proc, base):
        outcomes: list[str] = []

        def one(i: int) -> None:
            try:
                r = httpx.post(base + "/generate", json={"text": f"k{i}", "sampling_params": LONG}, timeout=30)
                outcomes.append(str(r.status_code))
            except httpx.TransportError as e:
                outcomes.append(type(e).__name__)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # Poll, not a fixed wait: the tiny model can finish all four requests within a second.
        deadline = time.monotonic() + 20
        while (info := httpx.get(base + "/get_server_info", timeout=10).json())["num_running"] == 0:
            assert time.monotonic() < deadline, "the requests should be running"
            time.sleep(0.02)
        assert info["num_running"] > 0, "the requests should be running"
        os.kill(info["scheduler_pid"], signal.SIGKILL)
        t0 = time.monotonic()
        assert proc.wait(timeout=20) == 1
        for t in threads:
            t.join(timeout=20)
            assert not t.is_alive()
        assert time.monotonic() - t0 < 20
        assert all(o in ("503", "200") or o.endswith("Error") for o in outcomes), outcomes
        assert "died" in proc.stdout.read()


@contextlib.contextmanager
def served(model: str, *flags: str):
    """`plait serve` in a subprocess (as test_http_server.running_serve, with a start-up deadline
    for a loaded machine); yields (process, base url)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        "--log-level",
        "warning",
        *flags,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 240, "plait serve")
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_under_load_drains_and_exits_0(tiny_model_dirs):
    """SIGTERM with streams and plain requests running: each ends complete or with an explicit
    error (never a cut stream), new requests get 503, and the process exits 0 in bounded time."""
    with served(tiny_model_dirs["llama"]) as (proc, base):
        outcomes: dict[str, str] = {}

        def plain(i: int) -> None:
            r = httpx.post(base + "/generate", json={"text": f"t{i}", "sampling_params": {**LONG, "n": 4}}, timeout=30)
            ok = r.status_code == 200 and all(len(x["output_ids"]) == 400 for x in r.json())
            unavailable = r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
            outcomes[f"plain{i}"] = "complete" if ok else "unavailable" if unavailable else f"error {r.status_code}"

        def stream(i: int) -> None:
            with httpx.stream(
                "POST", base + "/generate", timeout=30, json={"text": f"u{i}", "sampling_params": LONG, "stream": True}
            ) as r:
                ev = sse_events(r.iter_lines())
            assert ev[-1] == "[DONE]", ev[-2:]
            done = "meta_info" in ev[-2] and ev[-2]["meta_info"]["finish_reason"]["type"] == "length"
            # (a stream's status was 200 when it started: the drain ends it with an error event)
            code = None if done else ev[-2].get("error", {}).get("code")
            outcomes[f"stream{i}"] = (
                "complete" if done else "unavailable" if code == "service_unavailable" else f"error {code}"
            )

        threads = [threading.Thread(target=f, args=(i,)) for i in range(3) for f in (plain, stream)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < http_server.DRAIN_TIMEOUT_S + 15
        for t in threads:
            t.join(timeout=10)
        assert len(outcomes) == 6, outcomes
        # how many complete depends on the machine's speed against the drain timeout; none is cut
        assert all(o in ("complete", "unavailable") for o in outcomes.values()), outcomes


# --- security ---------------------------------------------------------------------------------
def test_api_key_on_every_route_but_health(engine, monkeypatch):
    calls = []
    real = http_common.hmac.compare_digest

    def spy(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(http_common.hmac, "compare_digest", spy)
    app = create_app(engine, api_key="k3y", served_model_name="tiny")
    routes = [(r.path, m) for r in app.routes if hasattr(r, "methods") for m in sorted(r.methods - {"HEAD"})]
    assert len(routes) >= 15
    with serve(app) as base, httpx.Client(base_url=base, timeout=30) as c:
        for path, method in routes:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Basic k3y"},
                {"Authorization": "Bearer k3y-longer"},
            ):
                resp = c.request(method, path, headers=headers, json={"text": "x"})
                if path == "/health":
                    assert resp.status_code == 200
                elif path.startswith("/v1/messages"):  # Anthropic's error shape there
                    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
                    assert "API key" in resp.json()["error"]["message"]
                else:
                    assert_error(resp, 401, "API key")
            ok = c.request(
                method,
                path,
                headers={"Authorization": "Bearer k3y"},
                json={
                    "text": "x",
                    "sampling_params": GREEDY,
                    "prompt": "x",
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "x"}],
                    "rid": "none",
                },
            )
            assert ok.status_code != 401, (path, ok.text)
    assert calls, "the key must be compared with hmac.compare_digest"


def test_ipc_dir_is_private(engine):
    st = os.stat(engine.ipc_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    names = os.listdir(engine.ipc_dir)
    assert names and all(stat.S_ISSOCK(os.stat(os.path.join(engine.ipc_dir, n)).st_mode) for n in names)


def test_sockets_carry_msgpack_never_pickle():
    from plait.runtime.managers import ipc
    from plait.runtime.request import GenerateInput

    codec = ipc.Codec(ipc.ToScheduler)
    msg = ipc.AbortReq(rid="r")
    assert msgspec.msgpack.decode(codec.encode(msg)) == {"type": "AbortReq", "rid": "r"}

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch /tmp/plait-pwned",))

    with pytest.raises(msgspec.DecodeError):
        codec.decode(pickle.dumps(Boom()))
    with pytest.raises((TypeError, NotImplementedError, msgspec.EncodeError)):
        codec.encode(GenerateInput(rid="r", input_ids=[1], params=Boom(), seed=0))  # no fallback to pickle


def test_no_unrestricted_unpickling_in_runtime():
    """Bytes from a socket are never unpickled: a runtime module that uses pickle at all must
    restrict what it loads (an Unpickler subclass with an allow-list `find_class`)."""
    runtime = os.path.join(REPO, "runtime")
    offenders = []
    for name in sorted(
        os.path.relpath(os.path.join(d, f), runtime)  # every subpackage too
        for d, _, files in os.walk(runtime)
        for f in files
    ):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(runtime, name)) as f:
            src = f.read()
        if re.search(r"\bpickle\.loads?\(|\b(dill|cloudpickle)\b", src):
            offenders.append(f"{name}: pickle.load(s)")
        if re.search(r"\(pickle\.Unpickler\)", src) and "def find_class" not in src:
            offenders.append(f"{name}: an Unpickler without an allow-list find_class")
    assert not offenders, offenders


def test_no_remote_code(tmp_path, tiny_model_dirs):
    """A model folder that asks for its own Python code is refused; the code never runs."""
    import shutil

    from plait.runtime.model_executor.model_loader import load_config

    folder = tmp_path / "evil"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    marker = tmp_path / "ran"
    (folder / "evil_config.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil_config.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        load_config(str(folder))
    assert not marker.exists()
    for root in ("runtime", "grammar", "frontend"):
        for dirpath, _, files in os.walk(os.path.join(REPO, root)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        assert "trust_remote_code=True" not in f.read(), name


def test_model_names_never_reach_outside(http, monkeypatch, tmp_path):
    from plait.runtime.model_executor import model_loader

    for name in ("../../etc/passwd", "/etc/passwd", "~/.ssh/id_rsa"):  # a client's `model`: a name, never a path
        assert_error(http.post("/v1/completions", json={"model": name, "prompt": "x"}), 404, "does not exist")

    def no_hub(*a, **k):
        raise AssertionError("must not reach the hub")

    monkeypatch.setattr(model_loader, "_download_from_hub", no_hub)
    monkeypatch.chdir(tmp_path)
    for name in ("org/../../etc", "a/..", "org/.hidden", "../x", "x/y/../../z"):
        with pytest.raises(model_loader.ModelNotFoundError):
            model_loader.resolve_model(name, cache_dir=str(tmp_path))


def test_logs_never_hold_prompts_unless_asked(engine, caplog):
    secret = "PROMPT-SECRET-4242"
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="plait")  # the engine sets its own level
    with serve(create_app(engine, log_interval=0.05)) as base, httpx.Client(base_url=base, timeout=30) as c:
        assert c.post("/generate", json={"text": secret, "sampling_params": GREEDY}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": secret, "max_tokens": 2}).status_code == 200
        assert (
            c.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}], "max_tokens": 2}
            ).status_code
            == 200
        )
        assert c.post("/generate", json={"text": secret, "sampling_params": {"regex": "("}}).status_code == 400
        time.sleep(0.2)
    assert not [r for r in caplog.records if secret in r.getMessage()]
    caplog.clear()
    with serve(create_app(engine, log_requests=True)) as base:
        assert httpx.post(base + "/generate", json={"text": secret, "sampling_params": GREEDY}).status_code == 200
    assert any(secret in r.getMessage() for r in caplog.records)


# --- soak -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_soak_short(tiny_model_dirs, capsys):
    """`plait bench soak` for ~30 s on the tiny model: mixed traffic with aborts; nothing lost, no
    KV slot leaked (the benchmark's own verdict), and its report has the RSS curve and counts."""
    from plait.benchmarks import soak

    code = soak.main(
        [
            "--model",
            tiny_model_dirs["llama"],
            "--minutes",
            "0.5",
            "--concurrency",
            "6",
            "--max-total-tokens",
            "2048",
            "--sample-s",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    totals = re.search(r"^\s+total\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.MULTILINE)
    sent, answered, errors, aborted, lost = map(int, totals.groups())
    assert sent > 20 and lost == 0 and answered + errors + aborted == sent, out
    assert aborted > 0 and "KV slots in use after settling: 0" in out and "resident memory" in out
