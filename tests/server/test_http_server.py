"""The HTTP server on a real socket: uvicorn on loopback in a background thread over the tiny
random Llama, driven by the `openai` client and `httpx`; plus `plait serve` as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import free_port, serve

import plait
from plait.runtime.server.http_server import create_app

GREEDY = {"temperature": 0, "max_new_tokens": 8}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    with plait.Engine(
        model=tiny_model_dirs["llama"],
        dtype="float32",
        max_total_tokens=8192,
        chunked_prefill_size=256,
        max_running_requests=48,
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


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_no_kv(engine, timeout: float = 10.0) -> None:
    """Every KV slot is free or cached again (aborts land asynchronously)."""
    deadline = time.monotonic() + timeout
    while engine.kv_slots_in_use() != 0:
        assert time.monotonic() < deadline, f"{engine.kv_slots_in_use()} KV slots still in use"
        time.sleep(0.05)


def sse_events(lines) -> list:
    """Parse `data: ...` lines into JSON objects, with "[DONE]" kept as a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    assert "Traceback" not in resp.text
    return err


# --- OpenAI-compatible API --------------------------------------------------------------------
def test_models(oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]


def test_chat(oai, engine):
    out = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, temperature=0, seed=1
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}], add_generation_prompt=True, tokenize=False
    )
    assert out.usage.prompt_tokens == len(engine.tokenizer(ids, add_special_tokens=False).input_ids)
    assert 1 <= out.usage.completion_tokens <= 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # the same request streamed gives the same text, role first, finish reason last
    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_usage_reports_cached_prompt_tokens(oai, engine):
    """usage.prompt_tokens_details.cached_tokens, read through the openai SDK: 0 for a prompt the cache
    has not seen, nearly all of it when the same prompt comes again (streamed too); with n samples,
    only what was cached before the request (the other samples read the first one's KV)."""
    engine.flush_cache()
    messages = [{"role": "user", "content": "A prompt for the cache counter, " + "long enough " * 8}]
    first = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    fresh = oai.completions.create(
        model="tiny", prompt="Four samples of a new prompt " * 6, n=4, max_tokens=2, temperature=1.0, seed=5
    )
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0


def test_tokenize_and_detokenize(http, engine):
    prompt = "Count the tokens of this prompt."
    out = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert out["tokens"] == engine.tokenizer(prompt).input_ids and out["count"] == len(out["tokens"])
    assert out["token_strs"] == engine.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] == engine.get_server_info()["context_length"]
    messages = [{"role": "user", "content": "Hello!"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]  # the same template as a chat request
    back = http.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == engine.tokenizer.decode(out["tokens"])
    assert_error(http.post("/tokenize", json={"prompt": prompt, "messages": messages}), 400, "exactly one")
    assert_error(http.post("/tokenize", json={"prompt": 3}), 400, "prompt")
    assert_error(http.post("/detokenize", json={"tokens": [1, 10**9]}), 400, "vocabulary")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_chat_n_logprobs(oai):
    out = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_completion_tokens=5,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        assert c.logprobs.content, c
        for entry in c.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
    # n copies are seeded seed, seed+1, ...: streamed with n=3 gives the same three texts
    stream = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_completion_tokens=5,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in out.choices]


def test_completions(oai):
    out = oai.completions.create(
        model="tiny", prompt=["The sky is", "One, two,"], max_tokens=5, temperature=0, n=2, logprobs=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy copies agree
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text
    assert out.usage.completion_tokens == 20
    # token-id prompt, streamed
    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt=[1, 2, 3, 4],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_errors(oai, http):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="echo"):
        oai.completions.create(model="tiny", prompt="x", max_tokens=1, echo=True)
    assert_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, "messages")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400, "role")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}), 400, "max_tokens")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature")
    assert_error(http.post("/v1/completions", json={"prompt": "x " * 600, "max_tokens": 1}), 400, "context length")
    assert oai.completions.create(model="tiny", prompt="x", max_tokens=1).choices[0].finish_reason


# --- native API -------------------------------------------------------------------------------
def test_generate_single_batch_ids(http, engine):
    one = http.post("/generate", json={"text": "Hello there", "sampling_params": GREEDY}).json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert one["meta_info"]["prompt_tokens"] == len(engine.tokenizer("Hello there").input_ids)
    assert one["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    prompts = ["Hello there", "A different prompt", "third"]
    batch = http.post("/generate", json={"text": prompts, "sampling_params": GREEDY}).json()
    assert [r["output_ids"] for r in batch][0] == one["output_ids"]  # order kept
    singles = [http.post("/generate", json={"text": p, "sampling_params": GREEDY}).json() for p in prompts[1:]]
    assert [r["output_ids"] for r in batch[1:]] == [r["output_ids"] for r in singles]
    ids = engine.tokenizer("Hello there").input_ids
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == one["output_ids"]
    lists = http.post("/generate", json={"input_ids": [ids, ids], "sampling_params": [GREEDY, GREEDY]}).json()
    assert [r["output_ids"] for r in lists] == [one["output_ids"]] * 2


def test_generate_n_item_major(http):
    sp = {"temperature": 0.9, "max_new_tokens": 6, "n": 2, "seed": 5}
    out = http.post("/generate", json={"text": ["first prompt", "second prompt"], "sampling_params": sp}).json()
    assert len(out) == 4
    alone = http.post("/generate", json={"text": "second prompt", "sampling_params": sp}).json()
    assert isinstance(alone, list) and len(alone) == 2  # n > 1: a list
    assert [r["output_ids"] for r in out[2:]] == [r["output_ids"] for r in alone]


def test_prefill_only_and_logprobs(http, engine):
    text = "The quick brown fox jumps over the lazy dog"
    n = len(engine.tokenizer(text).input_ids)
    out = http.post(
        "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    ).json()
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    lps = out["meta_info"]["input_token_logprobs"]
    assert len(lps) == n and lps[0][0] is None and all(isinstance(x[0], float) for x in lps[1:])
    start = 3
    out2 = http.post(
        "/generate",
        json={
            "text": text,
            "sampling_params": GREEDY,
            "return_logprob": True,
            "logprob_start_len": start,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = out2["meta_info"]
    assert len(meta["input_token_logprobs"]) == n - start
    first = meta["input_token_logprobs"][0]
    assert isinstance(first[0], float) and math.isclose(first[0], lps[start][0], abs_tol=1e-3)
    assert isinstance(first[2], str)
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])


def test_generate_stream(http):
    whole = http.post("/generate", json={"text": "Stream me", "sampling_params": GREEDY}).json()
    with http.stream(
        "POST", "/generate", json={"text": "Stream me", "sampling_params": GREEDY, "stream": True}
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    results = events[:-1]
    texts = [r["text"] for r in results]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert results[-1]["text"] == whole["text"] and results[-1]["output_ids"] == whole["output_ids"]
    assert all(r["meta_info"]["finish_reason"] is None for r in results[:-1])


def test_info_routes(http, engine):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == engine.args.model
    assert http.get("/model_info").json() == info
    server = http.get("/get_server_info").json()
    assert "version" in server and http.get("/server_info").status_code == 200
    assert http.post("/flush_cache").status_code == 200 and http.get("/flush_cache").status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.post("/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"}).json() == {
        "success": True
    }
    metrics = http.get("/metrics").text
    for name in (
        "plait_prompt_tokens_total",
        "plait_generation_tokens_total",
        "plait_requests_total",
        "plait_num_running_reqs",
        "plait_cache_hit_rate",
        "plait_time_to_first_token_seconds_bucket",
        "plait_e2e_request_latency_seconds_count",
    ):
        assert name in metrics


def test_bad_input(http, engine):
    cases = [
        (b'{"text": "x", ', "JSON"),
        (b'[1, 2]', "object"),
        ({"text": "x", "input_ids": [1, 2]}, "exactly one"),
        ({"sampling_params": GREEDY}, "exactly one"),
        ({"text": 5}, "text"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"text": "x", "sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex"),
        ({"text": "x", "sampling_params": "greedy"}, "sampling_params"),
        ({"text": "x", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "x " * 600}, "context length"),
        ({"input_ids": [1, 10**9]}, "input_ids"),
        ({"text": ["a", "b"], "stream": True}, "stream"),
    ]
    for body, word in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        assert_error(http.post("/generate", **kw), 400, word)
    assert_error(http.get("/generate"), 405)
    assert_error(http.get("/no/such/route"), 404)
    big = b'{"text": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    assert_error(http.post("/generate", content=big), 413)
    assert http.post("/generate", json={"text": "still fine", "sampling_params": GREEDY}).status_code == 200
    wait_no_kv(engine)


# --- concurrency, disconnects, limits ---------------------------------------------------------
def test_concurrent_streams(url, engine):
    async def one(client: httpx.AsyncClient, i: int) -> list:
        body = {
            "text": f"Concurrent client number {i} says",
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        }
        async with client.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            return sse_events([line async for line in resp.aiter_lines()])

    async def main() -> list:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    for events in results:
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert len(last["output_ids"]) == 12
        texts = [e["text"] for e in events[:-1]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    for i in (0, 37, 63):  # each stream got exactly what the request gets on its own
        alone = httpx.post(
            url + "/generate",
            json={
                "text": f"Concurrent client number {i} says",
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            },
            timeout=60,
        ).json()
        assert alone["output_ids"] == results[i][-2]["output_ids"]
    wait_no_kv(engine)


LONG = {"temperature": 0, "max_new_tokens": 480, "ignore_eos": True}


def test_stream_disconnect_aborts(url, engine):
    # 480 tokens of the tiny model can all be out before a client on a loaded machine has read 16
    # of them, or before the server notices the disconnect: such a try tests nothing, so it is run
    # again; a request that is never aborted fails every try
    for _ in range(5):
        before = engine.get_server_info()["num_generated_tokens"]
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream(
                "POST", "/generate", json={"text": "go on", "sampling_params": LONG, "stream": True}
            ) as resp:
                # some tokens out: the request holds KV of its own (its first few can sit in cached pages)
                for line in resp.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["meta_info"]["completion_tokens"] >= 16:
                        break
                running = engine.kv_slots_in_use() > 0
            # leaving the block closes the connection mid-stream
        wait_no_kv(engine, timeout=30)  # (a loaded 2-core machine can take seconds to notice)
        generated = engine.get_server_info()["num_generated_tokens"] - before
        if running and generated < LONG["max_new_tokens"]:
            return
    pytest.fail("in 5 tries, no streamed request was aborted before its end")


def test_openai_stream_disconnect_aborts(oai, engine):
    stream = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "talk"}],
        n=2,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    # the first chunk only carries the role; wait for some generated text, so the requests hold
    # KV of their own (their first few tokens can sit in cached pages)
    pieces = 0
    for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].delta.content)
        if pieces >= 16:
            break
    assert engine.kv_slots_in_use() > 0
    stream.close()
    wait_no_kv(engine, timeout=30)


def test_nonstream_disconnect_aborts(url, engine):
    # 16 x 480 tokens take the tiny model ~0.7 s here (4 x 480 had come down to ~0.3 s, inside the
    # old 0.4 s timeout); the client gives up after 0.1 s
    before = engine.get_server_info()["num_generated_tokens"]
    with httpx.Client(base_url=url, timeout=0.1) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json={"text": "go on", "sampling_params": {**LONG, "n": 16}})
    wait_no_kv(engine, timeout=30)
    generated = engine.get_server_info()["num_generated_tokens"] - before
    assert generated < 16 * 480, "the request ran to the end: it was not aborted"


def test_abort_request(url, http, engine):
    got = {}

    def run() -> None:
        got["resp"] = httpx.post(
            url + "/generate",
            json={"text": "abort me", "rid": "abort-me", "sampling_params": {**LONG, "n": 8}},
            timeout=60,
        )

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    while not http.post("/abort_request", json={"rid": "abort-me"}).json()["found"]:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    thread.join()
    results = got["resp"].json()
    assert got["resp"].status_code == 200 and len(results) == 8
    assert {r["meta_info"]["finish_reason"]["type"] for r in results} == {"abort"}
    assert sorted(r["meta_info"]["id"] for r in results) == [f"abort-me-{i}" for i in range(8)]
    assert_error(http.post("/abort_request", json={}), 400, "rid")
    wait_no_kv(engine)


def test_queue_bound_503(engine):
    with (
        serve(create_app(engine, served_model_name="tiny", max_queued_requests=1)) as base,
        httpx.Client(base_url=base, timeout=60) as client,
    ):
        # the one allowed request: long, abandoned by its client after 1.5 s (which aborts it)
        def hold() -> None:
            with contextlib.suppress(httpx.ReadTimeout):
                httpx.post(base + "/generate", json={"text": "hold", "sampling_params": {**LONG, "n": 16}}, timeout=1.5)

        holder = threading.Thread(target=hold)
        holder.start()
        deadline = time.monotonic() + 5
        while client.get("/get_server_info").json()["num_http_in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = client.post("/generate", json={"text": "x", "sampling_params": GREEDY})
        assert_error(busy, 503, "limit")
        assert int(busy.headers["retry-after"]) >= 1
        holder.join()
        deadline = time.monotonic() + 5
        while client.get("/get_server_info").json()["num_http_in_flight"]:  # the abort lands
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.post("/generate", json={"text": "x", "sampling_params": GREEDY}).status_code == 200
    wait_no_kv(engine)


def test_api_key_and_load_log(engine, caplog):
    caplog.set_level(logging.INFO, logger="plait.http")
    app = create_app(engine, api_key="s3cret", served_model_name="tiny", log_interval=0.05)
    with serve(app) as base:
        assert httpx.get(base + "/health").status_code == 200
        for path in ("/get_model_info", "/v1/models", "/metrics"):
            assert_error(httpx.get(base + path), 401)
            assert_error(httpx.get(base + path, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(httpx.post(base + "/generate", json={"text": "x"}), 401)
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        deadline = time.monotonic() + 5
        while not any("gen throughput" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no periodic load line"
            good.completions.create(model="tiny", prompt="busy", max_tokens=2)  # keep it busy
            time.sleep(0.1)


class FailingEngine:
    """An engine whose stream fails after one result and whose other calls fail outright."""

    args = type("Args", (), {"model": "stub"})()
    tokenizer = None

    def __init__(self):
        self.aborted: list[str] = []

    def get_server_info(self) -> dict:
        return {"context_length": 64}

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def async_generate(self, stream: bool = False, rid=None, **kwargs):
        async def events():
            yield {"text": "a", "output_ids": [5], "meta_info": {"id": rid, "finish_reason": None}}
            raise RuntimeError("boom")

        if stream:
            return events()
        raise RuntimeError("kaboom")


def test_engine_failures_are_error_objects():
    stub = FailingEngine()
    with serve(create_app(stub)) as base:
        with httpx.stream("POST", base + "/generate", json={"text": "x", "stream": True, "rid": "r1"}) as resp:
            events = sse_events(resp.iter_lines())
        assert events[0]["text"] == "a" and events[-1] == "[DONE]"
        assert events[1]["error"]["type"] == "server_error" and "Traceback" not in json.dumps(events)
        assert "r1" in stub.aborted
        assert_error(httpx.post(base + "/generate", json={"text": "x"}), 500)
        assert httpx.get(base + "/health").status_code == 200


# --- plait serve --------------------------------------------------------------------------------
def _serve_cmd(model: str, port: int) -> list[str]:
    return [
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
        "2048",
        "--log-level",
        "warning",
    ]


@contextlib.contextmanager
def running_serve(model: str):
    """`plait serve` in a subprocess on a free port, healthy; yields (process, port, env)."""
    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        _serve_cmd(model, port), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "plait serve did not become healthy"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        yield proc, port, env
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_and_sigterm(tiny_model_dirs):
    with running_serve(tiny_model_dirs["llama"]) as (proc, port, env):
        base = f"http://127.0.0.1:{port}"
        out = httpx.post(base + "/generate", json={"text": "hi", "sampling_params": GREEDY}, timeout=30)
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 8
        # a second server on the same port: one clear line, exit code 1, before loading anything
        busy = subprocess.run(
            _serve_cmd(tiny_model_dirs["llama"], port), cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert busy.returncode == 1
        assert "already in use" in busy.stderr and "Traceback" not in busy.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # drained, engine shut down, clean exit
        log = proc.stdout.read()
        assert "ready" in log and f"http://127.0.0.1:{port}" in log


def test_serve_exits_when_scheduler_dies(tiny_model_dirs):
    """A dead model worker makes `plait serve` log the cause and exit non-zero, not hang."""
    with running_serve(tiny_model_dirs["llama"]) as (proc, _, _):
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "the scheduler process should be a child of the server"
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        assert proc.wait(timeout=15) != 0
        assert "died" in proc.stdout.read()
