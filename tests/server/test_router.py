"""Data parallelism: the routing policies (pure Python), the HTTP router over two replica servers
on loopback (the tiny random Llama), and `plait serve --dp-size 2`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import free_port, serve, wait_healthy

import plait
from plait.runtime.router.app import create_router_app
from plait.runtime.router.policy import (
    CacheAwarePolicy,
    PrefixTree,
    RoundRobinPolicy,
    ids_to_text,
    make_policy,
)
from plait.runtime.router.router import Router, label_metrics, routing_text
from plait.runtime.server.http_server import create_app

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = {"temperature": 0, "max_new_tokens": 4}


# --- the prefix tree --------------------------------------------------------------------------
def test_tree_match_per_replica():
    t = PrefixTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    t.insert("hello world, again", "b")
    assert t.match("hello world, again and again") == {"a": 11, "b": 18}
    assert t.match("hello thx") == {"a": 6, "b": 8}
    assert t.match("goodbye") == {}
    assert t.match("") == {}
    assert t.chars == {"a": 11, "b": len("hello there") + len("hello world, again") - len("hello ")}


def test_tree_evicts_least_recently_seen_per_replica():
    t = PrefixTree(max_chars=30)
    t.insert("x" * 10 + "first", "a")
    t.insert("x" * 10 + "second", "a")
    t.insert("x" * 10 + "first", "a")  # touch: "second" is now the least recent
    t.insert("other text entirely", "b")  # another replica's share does not count against a
    assert t.chars["a"] == 10 + 5 + 6
    t.insert("x" * 10 + "third!", "a")  # 27 chars, fits
    t.insert("y" * 10, "a")  # 37 > 30: evict LRU leaves down to <= 27
    assert t.chars["a"] <= 30
    m = t.match("x" * 10 + "second")
    assert m["a"] == 10  # "second" went first, the shared stem stays
    assert t.match("x" * 10 + "first")["a"] == 15 or t.match("x" * 10 + "third!")["a"] == 16
    assert t.match("y" * 10)["a"] == 10
    assert t.match("other text entirely") == {"b": 19}


def test_tree_chars_stay_exact_under_random_inserts_and_eviction():
    rng = random.Random(0)
    t = PrefixTree(max_chars=400)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        t.insert(text, rng.choice("pq"))
    for r in "pq":
        total, stack = 0, list(t.root.children.values())
        while stack:
            node = stack.pop()
            assert node.seen or node.children, "empty nodes are removed"
            if r in node.seen:
                total += len(node.edge)
                assert node.parent is t.root or r in node.parent.seen  # a replica's text is a subtree
            stack += node.children.values()
        assert total == t.chars[r] <= 400
    t.forget("p")
    assert "p" not in t.chars and all("p" not in n for n in t.match("ab" * 20))


# --- policies ---------------------------------------------------------------------------------
def test_cache_aware_follows_longest_prefix():
    p = CacheAwarePolicy(cache_threshold=0.5)
    loads = {"r0": 0, "r1": 0}
    assert p.choose("A" * 100 + "q1", loads) == "r0"  # nothing known: least loaded, first
    loads["r0"] = 1
    assert p.choose("B" * 100 + "q1", loads) == "r1"  # no match: least loaded
    loads["r1"] = 1
    for q in range(5):  # each prefix stays where it was seen
        assert p.choose("A" * 100 + f"x{q}", loads) == "r0"
        assert p.choose("B" * 100 + f"x{q}", loads) == "r1"


def test_cache_aware_below_cache_threshold_goes_to_least_loaded():
    p = CacheAwarePolicy(cache_threshold=0.5)
    p.choose("shared" + "a" * 100, {"r0": 0, "r1": 0})
    # matches 6 of 106 characters on r0: too little, so the least-loaded replica
    assert p.choose("shared" + "b" * 100, {"r0": 2, "r1": 1}) == "r1"
    # ties on load go to the replica holding less text
    p2 = CacheAwarePolicy(cache_threshold=0.9)
    p2.choose("x" * 500, {"r0": 0, "r1": 0})
    assert p2.choose("y" * 10, {"r0": 0, "r1": 0}) == "r1"


def test_cache_aware_balance_thresholds():
    text = "P" * 200

    def route(loads):  # a policy that has seen `text` on r0 only
        p = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2.0)
        assert p.choose(text, {"r0": 0, "r1": 0}) == "r0"
        return p.choose(text + "?", loads)

    assert route({"r0": 6, "r1": 1}) == "r1"  # 6 - 1 > 4 and 6 > 1 * 2: overloaded
    assert route({"r0": 5, "r1": 1}) == "r0"  # 5 - 1 = 4 is not > 4
    assert route({"r0": 20, "r1": 11}) == "r0"  # 20 - 11 > 4 but 20 < 11 * 2
    assert route({"r0": 23, "r1": 11}) == "r1"
    # the longest match wins among several replicas that saw the prefix
    q = CacheAwarePolicy(cache_threshold=0.1)
    q.choose("ab" * 50, {"r0": 0, "r1": 5})
    q.choose("ab" * 20, {"r0": 5, "r1": 0})
    assert q.choose("ab" * 50 + "z", {"r0": 3, "r1": 0}) == "r0"


def test_cache_aware_only_chooses_given_replicas_and_forgets():
    p = CacheAwarePolicy()
    p.choose("T" * 50, {"r0": 0, "r1": 0})
    assert p.choose("T" * 50, {"r1": 3}) == "r1"  # r0 out of rotation
    p.forget("r1")
    assert p.tree.match("T" * 50) == {"r0": 50}


def test_round_robin_cycles():
    p = RoundRobinPolicy()
    loads = {"a": 5, "b": 0, "c": 9}
    assert [p.choose("same text", loads) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_make_policy_validates():
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("cache_aware", 0.2, 8, 1.2).balance_abs_threshold == 8
    for bad in (
        {"name": "random"},
        {"name": "cache_aware", "cache_threshold": 1.5},
        {"name": "cache_aware", "balance_rel_threshold": 0.5},
        {"name": "cache_aware", "balance_abs_threshold": -1},
    ):
        with pytest.raises(ValueError):
            make_policy(**bad)


def test_routing_text():
    assert routing_text("/generate", {"text": "hi"}) == "hi"
    assert routing_text("/generate", {"text": ["first", "second"]}) == "first"
    assert routing_text("/generate", {"input_ids": [1, 2, 3]}) == ids_to_text([1, 2, 3])
    assert len(ids_to_text([1, 2, 3])) == 4 and ids_to_text([1, 2]) != ids_to_text([2, 1])
    assert routing_text("/generate", {"input_ids": [[5, 6], [7]]}) == ids_to_text([5, 6])
    assert routing_text("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_text("/v1/completions", {"prompt": [[9, 9]]}) == ids_to_text([9, 9])
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ]
    }
    assert routing_text("/v1/chat/completions", chat) == "system: be brief\nuser: hello\n"
    messages = {"system": "be brief", "messages": [{"role": "user", "content": "hello"}]}
    assert routing_text("/v1/messages", messages) == routing_text("/v1/chat/completions", chat)  # same prefix
    assert routing_text("/v1/embeddings", {"input": ["doc one", "doc two"]}) == "doc one"
    assert routing_text("/generate", None) == "" and routing_text("/v1/completions", {"prompt": 3}) == ""
    assert routing_text("/v1/responses", {"instructions": "be brief", "input": "hello"}) == "be brief\nhello"
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call_output", "output": "12"},
    ]
    assert routing_text("/v1/responses", {"input": items}) == "\nuser: hi\nfunction_call_output: 12\n"


def test_label_metrics():
    text = "# HELP m help\n# TYPE m counter\nm_total 3.0\nh_bucket{le=\"0.1\"} 2.0\n"
    seen: set[str] = set()
    a = label_metrics(text, "http://a", seen)
    b = label_metrics(text, "http://b", seen)
    assert a == [
        "# HELP m help",
        "# TYPE m counter",
        'm_total{replica="http://a"} 3.0',
        'h_bucket{replica="http://a",le="0.1"} 2.0',
    ]
    assert b == ['m_total{replica="http://b"} 3.0', 'h_bucket{replica="http://b",le="0.1"} 2.0']


# --- the router over two in-process replicas --------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    kw = {
        "dtype": "float32",
        "max_total_tokens": 4096,
        "chunked_prefill_size": 512,
        "max_running_requests": 64,
        "random_seed": 0,
        "num_threads": 1,
    }
    with (
        plait.Engine(model=tiny_model_dirs["llama"], **kw) as e0,
        plait.Engine(model=tiny_model_dirs["llama"], **kw) as e1,
    ):
        yield [e0, e1]


@pytest.fixture(scope="module")
def replicas(engines):
    with (
        serve(create_app(engines[0], served_model_name="tiny")) as u0,
        serve(create_app(engines[1], served_model_name="tiny")) as u1,
    ):
        yield [u0, u1]


@contextlib.contextmanager
def router_at(urls, policy="cache_aware", api_key=None, worker_api_key=None, health_interval=30.0, **kw):
    """The router app on a free loopback port; yields (base URL, Router)."""
    router = Router(
        urls, make_policy(policy, **kw), worker_api_key, health_interval=health_interval, health_timeout=2.0
    )
    with serve(create_router_app(router, api_key)) as base:
        yield base, router


def shared_prefix_workload(num_prefixes: int, per_prefix: int, seed: int = 0) -> list[str]:
    """Prompts over a few long shared prefixes (distinct words each), in a shuffled order."""
    rng = random.Random(seed)
    words = [
        "apple",
        "river",
        "stone",
        "cloud",
        "maple",
        "tiger",
        "ocean",
        "piano",
        "lemon",
        "quartz",
        "violet",
        "copper",
        "meadow",
        "falcon",
        "harbor",
        "canyon",
    ]
    prompts = []
    for k in range(num_prefixes):
        prefix = f"Document {k}: " + " ".join(rng.choice(words) for _ in range(200)) + "\n"
        prompts += [prefix + f"Question {k}.{j}: what is item {j}?" for j in range(per_prefix)]
    rng.shuffle(prompts)
    return prompts


async def _post_all(base: str, prompts: list[str], sampling=GREEDY) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        return await asyncio.gather(
            *(client.post("/generate", json={"text": p, "sampling_params": sampling}) for p in prompts)
        )


def hit_rate(responses: list[httpx.Response]) -> float:
    metas = [r.json()["meta_info"] for r in responses]
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


def test_cache_aware_beats_round_robin_on_shared_prefixes(replicas, engines):
    prompts = shared_prefix_workload(num_prefixes=12, per_prefix=4)
    rates, spread = {}, {}
    for policy in ("round_robin", "cache_aware"):
        for e in engines:
            assert e.flush_cache()
        with router_at(replicas, policy) as (base, router):
            responses = asyncio.run(_post_all(base, prompts))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
            assert all(len(r.json()["output_ids"]) == 4 for r in responses)
            rates[policy] = hit_rate(responses)
            spread[policy] = [r.routed for r in router.replicas.values()]
    print(f"cache hit rate: {rates}, requests per replica: {spread}")
    # each prefix is computed once with cache-aware routing (the ideal rate is about 3/4 of the
    # prompt, the prefix share times 3 of 4 requests), about twice with round robin (about 1/2)
    assert rates["cache_aware"] > 0.65, rates
    assert rates["cache_aware"] > rates["round_robin"] + 0.12, rates
    assert min(spread["cache_aware"]) >= len(prompts) // 4, spread  # both replicas still used


def test_router_forwards_every_endpoint(replicas):
    with router_at(replicas, "round_robin") as (base, router), httpx.Client(base_url=base, timeout=60) as http:
        direct = httpx.post(replicas[0] + "/generate", json={"text": "Hello", "sampling_params": GREEDY}).json()
        routed = [http.post("/generate", json={"text": "Hello", "sampling_params": GREEDY}).json() for _ in range(2)]
        assert all(r["output_ids"] == direct["output_ids"] for r in routed)  # same model on both replicas
        with http.stream(
            "POST", "/generate", json={"text": "Hello", "sampling_params": GREEDY, "stream": True}
        ) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"output_ids"' in lines[-2]
        comp = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 3
        chat = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.get("/get_model_info").json()["model_path"]
        ids = http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("Hello")
        bad = http.post("/generate", content=b"{not json")
        assert bad.status_code == 400 and "error" in bad.json()  # the replica's own 400
        info = http.get("/get_server_info").json()
        assert info["dp_size"] == 2 and len(info["replicas"]) == 2
        assert all(r["healthy"] and "server_info" in r for r in info["replicas"])
        assert sum(r["routed"] for r in info["replicas"]) == 6
        assert http.post("/flush_cache").status_code == 200
        metrics = http.get("/metrics").text
        assert f'plait_router_replica_healthy{{replica="{replicas[1]}"}} 1.0' in metrics
        assert f'plait_prompt_tokens_total{{replica="{replicas[0]}"}}' in metrics
        assert http.get("/health").status_code == 200
        assert all(r.in_flight == 0 for r in router.replicas.values())


def test_router_keeps_responses_on_the_replica_that_made_them(replicas):
    """Responses live in one replica's memory: with round robin, a follow-up by
    previous_response_id (plain and streamed) and GET /v1/responses/{id} still reach that replica."""
    with router_at(replicas, "round_robin") as (base, router), httpx.Client(base_url=base, timeout=60) as http:
        body = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
        last = http.post("/v1/responses", json={**body, "input": "Hello"}).json()["id"]
        for turn in range(3):
            follow = {**body, "input": f"And {turn}?", "previous_response_id": last, "stream": turn == 1}
            r = http.post("/v1/responses", json=follow)
            assert r.status_code == 200, r.text
            if turn == 1:
                created = next(line for line in r.text.splitlines() if line.startswith("data: "))
                last = json.loads(created[6:])["response"]["id"]
            else:
                last = r.json()["id"]
            got = http.get(f"/v1/responses/{last}")
            assert got.status_code == 200 and got.json()["id"] == last
        assert len(router.response_owners) == 4
        assert http.get("/v1/responses/resp_" + "0" * 32).status_code == 404
        # a response the router never saw (made before it started): asked of every replica
        direct = httpx.post(replicas[1] + "/v1/responses", json={**body, "input": "Hi"}).json()["id"]
        assert http.get(f"/v1/responses/{direct}").json()["id"] == direct


def test_router_api_keys(engines):
    with serve(create_app(engines[0], api_key="worker-key")) as worker:
        with router_at([worker], api_key="router-key", worker_api_key="worker-key") as (base, _):
            body = {"text": "Hi", "sampling_params": GREEDY}
            assert httpx.post(base + "/generate", json=body).status_code == 401
            assert (
                httpx.post(base + "/generate", json=body, headers={"Authorization": "Bearer worker-key"}).status_code
                == 401
            )
            ok = httpx.post(base + "/generate", json=body, headers={"Authorization": "Bearer router-key"}, timeout=60)
            assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
            assert httpx.get(base + "/health").status_code == 200
        with router_at([worker]) as (base, _):  # no worker key: the client's header goes through
            assert httpx.post(base + "/generate", json=body, timeout=60).status_code == 401
            assert (
                httpx.post(
                    base + "/generate", json=body, headers={"Authorization": "Bearer worker-key"}, timeout=60
                ).status_code
                == 200
            )


def test_router_without_healthy_replica_answers_503():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    with router_at(dead, health_interval=0.2) as (base, router):
        deadline = time.monotonic() + 10
        while any(r.healthy for r in router.replicas.values()):  # the health checks notice
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for path in ("/generate", "/v1/completions"):
            resp = httpx.post(base + path, json={"text": "x", "prompt": "x"})
            assert resp.status_code == 503 and "Traceback" not in resp.text
            err = resp.json()["error"]
            assert err["code"] == "no_healthy_replica" and "no healthy replica" in err["message"]
            assert dead[0] in err["message"]
        assert httpx.get(base + "/health").status_code == 503
        assert httpx.get(base + "/get_server_info").json()["num_healthy_replicas"] == 0


def test_router_retries_a_dead_replica_and_takes_it_back(replicas):
    dead = f"http://127.0.0.1:{free_port()}"
    with router_at([dead, replicas[0]], "round_robin", health_interval=3600) as (base, router):
        deadline = time.monotonic() + 10
        while router.replicas[dead].healthy:  # the first health check notices at once
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "connection refused" in router.replicas[dead].last_error
        router.replicas[dead].healthy = True  # as if it died between two checks
        # round robin picks the dead one first: connection refused, retried on the live one
        out = httpx.post(base + "/generate", json={"text": "Hi", "sampling_params": GREEDY}, timeout=60)
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
        assert router.replicas[dead].routed == 1 and router.replicas[replicas[0]].routed == 1
        assert not router.replicas[dead].healthy and "ConnectError" in router.replicas[dead].last_error
        stream = httpx.post(
            base + "/generate", json={"text": "Hi", "sampling_params": GREEDY, "stream": True}, timeout=60
        )
        assert stream.status_code == 200 and stream.text.rstrip().endswith("[DONE]")
        # the health check puts a replica that answers again back in rotation
        router.replicas[dead].healthy = False
        router.replicas[replicas[0]].healthy = False
        assert asyncio.run(_check_with_client(router, router.replicas[replicas[0]]))
        assert router.replicas[replicas[0]].healthy


async def _check_with_client(router: Router, replica) -> bool:
    saved = router.client
    router.client = httpx.AsyncClient()
    try:
        return await router.check(replica)
    finally:
        await router.client.aclose()
        router.client = saved


# --- separate replica processes: SIGKILL mid-load, and plait serve --dp-size 2 -----------------
@contextlib.contextmanager
def dp_serve(model: str, dp_size: int = 2):
    """`plait serve --dp-size N` in a subprocess, healthy; yields (process, base URL)."""
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
        "--dp-size",
        str(dp_size),
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
        "--num-threads",
        "2",
        "--log-level",
        "warning",
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
        wait_healthy(proc, base, 300, "plait serve --dp-size")  # three servers load on a shared machine
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_dp_serve_and_killing_a_replica_mid_load_loses_nothing(tiny_model_dirs):
    with dp_serve(tiny_model_dirs["llama"]) as (proc, base):
        one = httpx.post(base + "/generate", json={"text": "Hello", "sampling_params": GREEDY}, timeout=60)
        assert one.status_code == 200 and len(one.json()["output_ids"]) == 4
        info = httpx.get(base + "/get_server_info", timeout=30).json()
        assert info["dp_size"] == 2 and len(info["replicas"]) == 2
        assert all(r["healthy"] and r["server_info"]["server_args"]["num_threads"] == 1 for r in info["replicas"])
        pids = [r["pid"] for r in info["replicas"]]

        prompts = shared_prefix_workload(num_prefixes=4, per_prefix=12, seed=1)
        sampling = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}

        async def load_and_kill() -> list[httpx.Response]:
            task = asyncio.ensure_future(_post_all(base, prompts, sampling))
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                while (await client.get("/get_server_info")).json()["replicas"][0]["in_flight"] < 4:
                    assert not task.done(), "the load ended before replica 0 had requests in flight"
                    await asyncio.sleep(0.02)
            os.kill(pids[0], signal.SIGKILL)  # with requests in flight on it
            return await task

        responses = asyncio.run(load_and_kill())
        bad = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
        assert not bad, bad
        assert all(len(r.json()["output_ids"]) == 24 for r in responses)
        info = httpx.get(base + "/get_server_info", timeout=30).json()
        assert [r["healthy"] for r in info["replicas"]] == [False, True]
        assert httpx.get(base + "/health").status_code == 200
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while _alive(pids[1]):  # the surviving replica is stopped with the server
        assert time.monotonic() < deadline, "replica outlived plait serve --dp-size"
        time.sleep(0.1)
