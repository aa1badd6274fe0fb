"""The Scheduler class on its own (no threads, no processes): continuous batching, chunked
prefill, cache-aware ordering, retraction and KV accounting."""

from __future__ import annotations

import pytest

from plait.runtime.request import GenerateInput
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import INDEXED_ROWS_MIN, Scheduler
from plait.runtime.server_args import ServerArgs


def make(path, **kw) -> Scheduler:
    args = dict(model=path, dtype="float32", max_total_tokens=4096, chunked_prefill_size=64)
    args.update(kw)
    return Scheduler(ServerArgs(**args))


def req(rid: str, ids: list[int], n: int = 8, **params) -> GenerateInput:
    return GenerateInput(
        rid=rid,
        input_ids=ids,
        params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **params),
        seed=0,
    )


def run_all(s: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        for o in s.step():
            out.setdefault(o.rid, []).extend(o.new_ids)
    assert not s.has_work()
    return out


def idle_accounting_ok(s: Scheduler) -> None:
    assert s.kv_slots_in_use() == 0
    assert s.allocator.available() + s.cache.total_size() == s.num_slots
    assert s.cache.protected_size() == 0
    assert s.table.available() == s.table.max_requests


@pytest.fixture(scope="module")
def path(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def test_chunked_prefill_equals_unchunked(path):
    ids = [(i * 37) % 40000 + 10 for i in range(300)]
    big = make(path, chunked_prefill_size=4096)
    big.add_request(req("a", ids, 10))
    ref = run_all(big)["a"]
    small = make(path, chunked_prefill_size=64)
    small.add_request(req("a", ids, 10))
    steps_before = small.num_steps
    assert run_all(small)["a"] == ref
    assert small.num_steps - steps_before >= 300 // 64 + 10 - 1  # the prompt took several steps
    idle_accounting_ok(small)


def test_new_requests_join_while_others_decode(path):
    s = make(path)
    s.add_request(req("a", list(range(100, 120)), 30))
    for _ in range(3):
        s.step()
    s.add_request(req("b", list(range(200, 400)), 5))  # 200 tokens: chunked over 4 steps
    steps = []
    for _ in range(4):
        steps.append({o.rid for o in s.step()})
    # "a" decodes in every step while "b" is being prefilled chunk by chunk
    assert all("a" in rids for rids in steps)
    assert any("b" in rids for rids in steps)
    run_all(s)
    idle_accounting_ok(s)


def test_lpm_orders_by_cached_prefix(path):
    s = make(path, schedule_policy="lpm", chunked_prefill_size=32, max_running_requests=1)
    shared = list(range(1000, 1040))
    s.add_request(req("warm", shared + [5], 1))
    run_all(s)
    s.add_request(req("cold", list(range(3000, 3041)), 1))
    s.add_request(req("hot", shared + [7], 1))
    first = {o.rid for o in s.step()}
    assert first == {"hot"}  # the request whose prefix is cached goes first
    run_all(s)
    fcfs = make(path, schedule_policy="fcfs", chunked_prefill_size=64, max_running_requests=1)
    fcfs.add_request(req("warm", shared + [5], 1))
    run_all(fcfs)
    fcfs.add_request(req("cold", list(range(3000, 3041)), 1))
    fcfs.add_request(req("hot", shared + [7], 1))
    assert {o.rid for o in fcfs.step()} == {"cold"}


def test_retraction_keeps_outputs_and_accounting(path):
    prompts = {f"r{i}": [(i * 101 + j * 7) % 30000 + 5 for j in range(20)] for i in range(6)}
    ref = {}
    for rid, ids in prompts.items():
        s = make(path)
        s.add_request(req(rid, ids, 40))
        ref.update(run_all(s))
    small = make(path, max_total_tokens=120)
    for rid, ids in prompts.items():
        small.add_request(req(rid, ids, 40))
    got = run_all(small)
    assert small.num_retractions > 0
    assert got == ref
    idle_accounting_ok(small)


def test_abort_releases_everything(path):
    s = make(path)
    s.add_request(req("a", list(range(50, 90)), 50))
    s.add_request(req("b", list(range(50, 300)), 50))  # still chunking when aborted
    s.add_request(req("c", list(range(600, 640)), 50))
    s.step()
    outs = [s.abort_request(r) for r in ("a", "b", "c")]
    assert all(o is not None and o.finish_reason["type"] == "abort" for o in outs)
    assert s.abort_request("nope") is None
    assert not s.has_work()
    idle_accounting_ok(s)


def test_a_failed_step_leaks_nothing(path, monkeypatch):
    """A step that raises (a bug, a bad kernel) after admitting new requests: aborting what the
    scheduler holds (as the scheduler process does) releases every row and slot, and requests
    after it still run. Before, the new requests' table rows leaked until none were left."""
    s = make(path, max_running_requests=4)
    s.add_request(req("old", list(range(50, 90)), 20))
    s.step()
    for i in range(3):
        s.add_request(req(f"new{i}", list(range(100 + 40 * i, 140 + 40 * i)), 20))
    original = s._process
    monkeypatch.setattr(s, "_process", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        s.step()
    monkeypatch.setattr(s, "_process", original)
    for rid in ("old", "new0", "new1", "new2"):
        assert s.abort_request(rid) is not None, rid
    assert not s.has_work()
    idle_accounting_ok(s)
    s.add_request(req("after", list(range(700, 740)), 5))
    assert len(run_all(s)["after"]) == 5


def test_oversized_requests_rejected(path):
    s = make(path, max_total_tokens=64)
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(req("big", list(range(10, 100))))
    with pytest.raises(ValueError, match="context length"):
        s.add_request(req("long", list(range(10, 600))))


def test_wide_decode_steps_index_the_table_once(path):
    # 10 rows of different lengths, finishing at different steps: steps of >= INDEXED_ROWS_MIN
    # single-token rows write their table entries by one index, the rest per row
    prompts = [[(i * 53 + j * 7) % 40000 + 10 for j in range(5 + 3 * i)] for i in range(10)]
    lengths = [6 + 2 * i for i in range(10)]
    expected = {}
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        alone = make(path)
        alone.add_request(req(f"r{i}", ids, n))
        expected.update(run_all(alone))
    s = make(path)
    calls = []
    table_index = s._table_index
    s._table_index = lambda reqs: calls.append(len(reqs)) or table_index(reqs)
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        s.add_request(req(f"r{i}", ids, n))
    assert run_all(s) == expected
    assert calls and min(calls) >= INDEXED_ROWS_MIN
    idle_accounting_ok(s)


def test_request_fill_len_and_tail_without_the_whole_list():
    from plait.runtime.request import Req

    req = Req(GenerateInput(rid="r", input_ids=[1, 2, 3], params=SamplingParams(), seed=0), arrival=0)
    assert req.fill_len == 3 and [req.fill_from(i) for i in range(4)] == [[1, 2, 3], [2, 3], [3], []]
    req.output_ids += [4, 5]
    assert req.fill_len == len(req.fill_ids) == 5
    assert all(req.fill_from(i) == req.fill_ids[i:] for i in range(6))


def test_repeated_decode_steps_advance_the_batch_and_equal_built_ones(path):
    # Requests finishing at different steps, a new one joining mid-decode, one aborted: the steps that
    # decode the same requests as the step before advance its batch; the tokens are those of
    # building every batch anew, and everything is returned at the end.
    prompts = [[(i * 41 + j * 11) % 40000 + 10 for j in range(7 + 5 * i)] for i in range(4)]
    lengths = [12, 20, 9, 16]

    def run(repeat: bool) -> tuple[dict[str, list[int]], Scheduler]:
        s = make(path)
        if not repeat:
            s._repeat_batch = lambda decode, slots: (None, None)
        for i in range(3):
            s.add_request(req(f"r{i}", prompts[i], lengths[i]))
        out: dict[str, list[int]] = {}
        for step in range(10_000):
            if not s.has_work():
                break
            if step == 6:
                s.add_request(req("r3", prompts[3], lengths[3]))
            if step == 9:
                s.abort_request("r2")
            for o in s.step():
                out.setdefault(o.rid, []).extend(o.new_ids)
        idle_accounting_ok(s)
        return out, s

    built, s_built = run(repeat=False)
    advanced, s_adv = run(repeat=True)
    assert advanced == built
    assert s_built.num_repeat_steps == 0
    assert s_adv.num_repeat_steps >= 10 and s_adv.num_repeat_steps < s_adv.num_steps


def test_table_entries_are_a_view_of_the_row_range():
    import torch

    from plait.runtime.mem_cache.memory_pool import ReqToTokenTable

    t = ReqToTokenTable(3, 10)
    t.entries(1, 4, 3).copy_(torch.tensor([7, 8, 9]))
    assert t.table[1].tolist() == [0, 0, 0, 0, 7, 8, 9, 0, 0, 0] and int(t.table.sum()) == 24
    assert torch.equal(t.entries(2, 0, 10), t.table[2]) and t.entries(0, 9, 1).numel() == 1
