"""Speculative decoding, n-gram (prompt-lookup) and draft-model: the draft index, the acceptance
rule, and the scheduler producing exactly what decoding without speculation produces — greedy and
seeded sampling, with stops, grammars, logprobs and retraction — with no KV slot leaked in the
target's pool or the draft model's."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from plait.runtime.layers.sampler import Sampler, SamplingBatch
from plait.runtime.model_executor.model_runner import ModelRunner
from plait.runtime.request import GenerateInput
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.scheduler.scheduler import Scheduler
from plait.runtime.server_args import ServerArgs
from plait.runtime.speculative.draft_model import DraftModel
from plait.runtime.speculative.ngram import NgramIndex, accepted_prefix

# --- the draft index ---------------------------------------------------------------------------


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    ids = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    # the suffix (5, 6, 7) occurred at 0 and 5: the latest one (followed by 9, 2, ...) wins
    assert idx.propose(ids, 3) == [9, 2, 5]
    ids += [9, 2, 5, 6, 3]  # now only the unigram (3,) is new: no earlier occurrence
    assert idx.propose(ids, 4) == []
    ids += [4, 7]  # (4, 7) unseen; (7,) last seen followed by 9 (position 8)
    assert idx.propose(ids, 2) == [9, 2]
    assert idx.propose(ids, 0) == []


def test_ngram_index_prefers_longer_matches_and_restarts_on_shrink():
    idx = NgramIndex(1, 2)
    ids = [1, 2, 3, 9, 2, 4, 1, 2]
    # (1, 2) occurred at 0 (followed by 3); the unigram (2,) more recently (followed by 4)
    assert idx.propose(ids, 1) == [3]
    assert idx.propose([1, 2, 7, 2], 2) == [7, 2]  # a shorter sequence: re-indexed, not stale


def test_ngram_index_is_incremental():
    idx = NgramIndex(2, 4)
    ids = list(range(50)) * 3
    for n in range(10, len(ids)):
        idx.propose(ids[:n], 4)
    assert idx._done == len(ids) - 2  # each position indexed once, never re-scanned


def test_accepted_prefix():
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 5]) == 3
    assert accepted_prefix([1], [2, 5]) == 0


# --- the acceptance rule on a crafted distribution ---------------------------------------------


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 5}])
def test_acceptance_rule_for_a_point_mass_draft(params):
    """The scheduler keeps draft t iff the sampler's draw at that position is t. Over many seeds:
    kept with probability p(t), and on rejection the token follows p with t removed."""
    V, n, draft = 8, 40_000, 2
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0]])
    p = SamplingParams(**params)
    batch = SamplingBatch.build([p] * n, list(range(n)), [3] * n, [[0]] * n, [[]] * n, [7], V)
    draws = Sampler()(logits.expand(n, V), batch)
    # the processed distribution, as the sampler defines it (temperature, top-k, top-p)
    probs = torch.softmax(logits[0] / p.temperature, dim=-1)
    s, order = probs.sort(descending=True)
    keep = torch.arange(V) < (p.top_k if p.top_k > 0 else V)
    if p.top_p < 1.0:
        keep &= (s.cumsum(0) - s) < p.top_p
    target = torch.zeros(V)
    target[order[keep]] = s[keep]
    target /= target.sum()
    accepted = (draws == draft).float().mean().item()
    assert abs(accepted - target[draft].item()) < 0.01
    rejected = draws[draws != draft]
    freq = torch.bincount(rejected, minlength=V).float() / rejected.numel()
    rest = target.clone()
    rest[draft] = 0
    rest /= rest.sum()
    assert (freq - rest).abs().max().item() < 0.01


# --- the scheduler, tiny model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dirs):
    return ModelRunner(ServerArgs(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=4096))


def make(runner, spec: bool, **kw) -> Scheduler:
    args = {
        "model": runner.model_path,
        "dtype": "float32",
        "max_total_tokens": 4096,
        "speculative_algorithm": "ngram" if spec else None,
    }
    args.update(kw)
    return Scheduler(ServerArgs(**args), runner)


class OracleDrafts:
    """Stands in for a request's NgramIndex on the tiny random model (whose output never repeats
    its input): proposes the reference continuation with every `wrong`-th position corrupted, so
    verification sees full, partial and zero acceptance."""

    def __init__(self, prompt_len: int, ref: list[int], wrong: int = 4):
        self.prompt_len, self.ref, self.wrong = prompt_len, ref, wrong

    def propose(self, ids: list[int], k: int) -> list[int]:
        pos = len(ids) - self.prompt_len
        return [t if (pos + i) % self.wrong else (t + 1) % 1000 for i, t in enumerate(self.ref[pos : pos + k])]


def run_all(s: Scheduler, inputs: list[GenerateInput], oracle: dict | None = None) -> dict[str, tuple]:
    """Run to completion; rid -> (output ids, finish reason, output logprobs)."""
    for inp in inputs:
        s.add_request(inp)
    for req in [*s.waiting, *(r for r, _ in s.grammar_queue)]:
        if oracle and req.rid in oracle:
            req.ngram = OracleDrafts(len(req.origin_ids), oracle[req.rid][0])
    out: dict[str, list] = {}
    for _ in range(20_000):
        if not s.has_work():
            break
        for o in s.step():
            ids, _, lps = out.setdefault(o.rid, [[], None, []])
            ids.extend(o.new_ids)
            lps.extend(o.output_logprobs or [])
            if o.finish_reason is not None:
                out[o.rid][1] = o.finish_reason
    assert not s.has_work()
    idle_accounting_ok(s)
    return {k: tuple(v) for k, v in out.items()}


def idle_accounting_ok(s: Scheduler) -> None:
    assert s.kv_slots_in_use() == 0
    assert s.allocator.available() + s.cache.total_size() == s.num_slots
    assert s.cache.protected_size() == 0
    if s.draft is not None:
        assert_no_draft_leak(s.draft)


def assert_no_draft_leak(draft: DraftModel) -> None:
    """Every draft KV slot and table row is free once no request runs."""
    assert draft.slots_in_use() == 0 and not draft.states
    assert draft.table.available() == draft.table.max_requests


def inputs(n: int, max_new: int = 48, seed0: int = 0, **params) -> list[GenerateInput]:
    params = {"temperature": 0, "ignore_eos": True, **params}
    # repetitive prompts: the random model's continuations tend to cycle, so drafts are found
    return [
        GenerateInput(
            rid=f"r{i}",
            input_ids=[(7 * i + j % 5) * 13 + 100 for j in range(24 + i)],
            params=SamplingParams(max_new_tokens=max_new, **params),
            seed=seed0 + i,
        )
        for i in range(n)
    ]


def both(runner, reqs_fn, oracle: bool = True, **kw):
    """Run without and with speculation; on the tiny model the drafts come from `OracleDrafts`
    built on the plain run's output."""
    plain = run_all(make(runner, False, **kw), reqs_fn())
    s = make(runner, True, **kw)
    spec = run_all(s, reqs_fn(), plain if oracle else None)
    return plain, spec, s


@pytest.mark.parametrize("n", [1, 3])
def test_greedy_identical_tiny(tiny_runner, n):
    plain, spec, s = both(tiny_runner, lambda: inputs(n))
    assert spec == plain
    assert s.num_spec_proposed_tokens > s.num_spec_accepted_tokens > 0
    assert s.num_generated_tokens == sum(len(v[0]) for v in spec.values())


def test_ngram_drafts_pause_while_rejected(tiny_runner):
    """Drafts that are never kept: after each fully rejected round the request pauses drafting
    for 1, 2, 4 ... rounds, so it proposes a handful of tokens, not 8 every step; output unchanged."""
    plain = run_all(make(tiny_runner, False), inputs(1, 48))
    s = make(tiny_runner, True)
    for inp in inputs(1, 48):
        s.add_request(inp)
    s.waiting[0].ngram = OracleDrafts(len(s.waiting[0].origin_ids), plain["r0"][0], wrong=1)
    spec = run_all(s, [])
    assert spec == plain
    assert s.num_spec_accepted_tokens == 0
    # 8 drafts in round 1, then after pauses of 1, 2, 4, 8 and 16 rounds (47 rounds in all)
    assert 0 < s.num_spec_proposed_tokens <= 6 * 8


def test_no_speculation_above_max_batch(tiny_runner):
    plain, spec, s = both(tiny_runner, lambda: inputs(3), speculative_max_batch=2)
    assert spec == plain
    assert s.num_spec_proposed_tokens == 0


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01},
        {"temperature": 1.0, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2},
    ],
)
def test_seeded_sampling_identical(tiny_runner, params):
    """The draw at each position is the one decoding without speculation makes, so a seeded
    request yields the same tokens (and so the same distribution) with speculation on."""
    plain, spec, s = both(tiny_runner, lambda: inputs(3, 40, seed0=5, **params))
    assert spec == plain
    assert s.num_spec_proposed_tokens > 0


def test_sampled_grammar_identical(tiny_runner):
    """Sampled constrained requests: jump-forward appends forced text, drafts follow it and are
    checked against the matcher (rolled back when rejected); the output stays the same and valid."""
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 6}, "b": {"enum": ["xx", "yyy"]}},
            "required": ["a", "b"],
        }
    )
    plain, spec, s = both(
        tiny_runner, lambda: inputs(2, 40, seed0=3, temperature=1.0, json_schema=schema, ignore_eos=False)
    )
    assert spec == plain
    assert s.num_spec_proposed_tokens > 0 and s.num_jump_forward_tokens > 0
    for ids, reason, _ in spec.values():
        assert reason["type"] == "stop"
        json.loads(tiny_runner.tokenizer.decode(ids, skip_special_tokens=True))


def test_stops_and_lengths_exact(tiny_runner):
    ref = run_all(make(tiny_runner, False), inputs(3, 40))
    tok = tiny_runner.tokenizer
    for i, (ids, _, _) in enumerate(ref.values()):
        stop_id = ids[17 + i]  # a token that occurs mid-output (first occurrence ends it)
        text = tok.decode(ids[:30])
        stop_str = text[-6:-2]
        for extra in ({"stop_token_ids": [stop_id]}, {"stop": [stop_str]}, {"max_new_tokens": 13 + i}):

            def reqs(i=i, extra=extra):
                r = inputs(3, 40)[i]
                r.params = SamplingParams(**{**r.params.__dict__, **extra})
                return [r]

            plain = run_all(make(tiny_runner, False), reqs())
            # drafts from the unstopped output run past the stop
            spec = run_all(make(tiny_runner, True), reqs(), {f"r{i}": ref[f"r{i}"]})
            assert spec == plain, extra
            assert len(plain[f"r{i}"][0]) < 40
            reason = plain[f"r{i}"][1]
            assert reason["type"] == ("length" if "max_new_tokens" in extra else "stop")


def test_eos_exact(tiny_runner):
    """A token of the greedy output made the EOS: generation ends at its first occurrence."""
    ref = run_all(make(tiny_runner, False), inputs(1, 40))["r0"][0]
    eos = ref[20]
    outs = []
    for spec in (False, True):
        s = make(tiny_runner, spec)
        s.eos_ids = {eos}
        outs.append(run_all(s, inputs(1, 40, ignore_eos=False), {"r0": (ref,)} if spec else None)["r0"])
    assert outs[1] == outs[0]
    assert outs[0][0] == ref[: ref.index(eos) + 1]
    assert outs[0][1] == {"type": "stop", "matched": eos}


def test_logprobs_match(tiny_runner):
    def reqs():
        rs = inputs(2, 32)
        for r in rs:
            r.return_logprob, r.top_logprobs_num = True, 2
        return rs

    plain, spec, s = both(tiny_runner, reqs)
    assert s.num_spec_accepted_tokens > 0
    for rid, (ids, reason, lps) in plain.items():
        ids2, reason2, lps2 = spec[rid]
        assert ids2 == ids and reason2 == reason
        assert [t for _, t in lps2] == ids
        assert max(abs(a[0] - b[0]) for a, b in zip(lps, lps2)) < 1e-4


def test_retraction_with_drafts(tiny_runner, tiny_model_dirs):
    plain = run_all(make(tiny_runner, False), inputs(4, 60))
    small = ModelRunner(ServerArgs(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=200))
    s = make(small, True, max_total_tokens=200)
    squeezed = run_all(s, inputs(4, 60), plain)
    assert s.num_retractions > 0
    assert squeezed == plain


# --- the real model ----------------------------------------------------------------------------

DOC = (
    '{"name": "Alice Johnson", "email": "alice.johnson@example.com", "city": "Paris", '
    '"orders": [{"id": 1042, "item": "blue notebook", "qty": 3}, {"id": 1043, "item": "red pen", "qty": 10}]}'
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "email", "city"],
}


@pytest.fixture(scope="module")
def smol_runner(smollm2_path):
    return ModelRunner(ServerArgs(model="smollm2", dtype="float32", max_total_tokens=8192))


def chat(runner, text: str) -> list[int]:
    tok = runner.tokenizer
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    )


def smol_inputs(runner, n: int, max_new: int = 80, **params) -> list[GenerateInput]:
    """Copying prompts; with `sampled`, odd requests sample (seeded, temperature 0.7)."""
    asks = [
        "Repeat the following JSON exactly:\n",
        "Copy this record without changes:\n",
        "Here is a JSON document. Output it again, verbatim:\n",
    ]
    sampled = params.pop("sampled", False)
    return [
        GenerateInput(
            rid=f"s{i}",
            input_ids=chat(runner, asks[i % 3] + DOC.replace("Alice", ["Alice", "Bob", "Carol"][i % 3])),
            params=SamplingParams(max_new_tokens=max_new, temperature=0.7 if sampled and i % 2 else 0, **params),
            seed=i,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(("n", "max_new"), [(1, 80), (3, 40)])
def test_identical_real_model(smol_runner, n, max_new):
    """Greedy (and, with 3 requests, one seeded sampled) copying requests: same output, fewer steps."""
    plain, spec, s = both(
        smol_runner, lambda: smol_inputs(smol_runner, n, max_new, sampled=n > 1), oracle=False, max_total_tokens=8192
    )
    assert spec == plain
    assert s.num_spec_accepted_tokens > 0.5 * s.num_spec_proposed_tokens > 0  # it copies
    assert s.num_steps < 0.6 * sum(len(v[0]) for v in spec.values()) / n + 10


def test_json_schema_identical_and_valid(smol_runner):
    plain, spec, s = both(
        smol_runner,
        lambda: smol_inputs(smol_runner, 2, 96, json_schema=json.dumps(SCHEMA)),
        oracle=False,
        max_total_tokens=8192,
    )
    assert spec == plain
    assert s.num_spec_accepted_tokens > 0
    for ids, reason, _ in spec.values():
        assert reason["type"] == "stop"
        jsonschema.validate(json.loads(smol_runner.tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_engine_reports_acceptance(smollm2_path):
    """get_server_info and the metrics carry the acceptance counters (the process path)."""
    from conftest import assert_no_leak

    import plait
    from plait.runtime.server.metrics import ServerMetrics

    with plait.Engine(model="smollm2", dtype="float32", max_total_tokens=4096, speculative_algorithm="ngram") as eng:
        prompt = eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Repeat the following JSON exactly:\n" + DOC}],
            tokenize=False,
            add_generation_prompt=True,
        )
        out = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 40})
        info = eng.get_server_info()
        assert_no_leak(eng)
    assert out["text"].startswith('{"name": "Alice Johnson"')
    assert info["num_spec_proposed_tokens"] >= info["num_spec_accepted_tokens"] > 0
    assert 0 < info["spec_accept_rate"] <= 1
    text = ServerMetrics().render(info, 0).decode()
    assert f"plait_spec_accept_rate {info['spec_accept_rate']}" in text


def test_greedy_grammar_drafts_only_at_small_batches(tiny_runner, monkeypatch):
    """Above the batch threshold greedy constrained requests decode one token per step (no
    forced-text drafts): the same text, no jump-forward tokens."""
    import plait.runtime.scheduler.speculation as sched

    schema = json.dumps(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    )

    def reqs():
        return inputs(2, 30, json_schema=schema, ignore_eos=False)

    small = make(tiny_runner, False)
    ref = run_all(small, reqs())
    assert small.num_jump_forward_tokens > 0
    monkeypatch.setattr(sched, "JUMP_FORWARD_MAX_BATCH", 0)  # always above it
    big = make(tiny_runner, False)
    assert run_all(big, reqs()) == ref
    assert big.num_jump_forward_tokens == 0


# --- draft-model speculation, tiny models ------------------------------------------------------


def draft_args(target: str, draft: str, **kw) -> ServerArgs:
    return ServerArgs(
        **{
            "model": target,
            "dtype": "float32",
            "max_total_tokens": 4096,
            "speculative_algorithm": "draft",
            "speculative_draft_model": draft,
            **kw,
        }
    )


@pytest.fixture(scope="module")
def self_draft(tiny_runner, tiny_model_dirs):
    """The target itself as its draft: every greedy draft is what the target samples."""
    return DraftModel(draft_args(tiny_model_dirs["llama"], tiny_model_dirs["llama"]), tiny_runner)


@pytest.fixture(scope="module")
def other_draft(tiny_runner, tiny_model_dirs):
    """A different random model with the same tokenizer: its drafts are mostly wrong."""
    return DraftModel(draft_args(tiny_model_dirs["llama"], tiny_model_dirs["qwen2"]), tiny_runner)


def make_draft(runner, draft: DraftModel, **kw) -> Scheduler:
    return Scheduler(draft_args(runner.model_path, draft.runner.model_path, **kw), runner, draft)


def both_draft(runner, draft: DraftModel, reqs_fn, **kw):
    """Run without speculation and with the draft model."""
    plain = run_all(make(runner, False, **kw), reqs_fn())
    s = make_draft(runner, draft, **kw)
    return plain, run_all(s, reqs_fn()), s


def accept_rate(s: Scheduler) -> float:
    return s.num_spec_accepted_tokens / s.num_spec_proposed_tokens


@pytest.fixture
def draft_calls(monkeypatch):
    """Records each `propose` call of a DraftModel and the draft forwards it ran."""
    calls: list[list] = []

    def watch(draft: DraftModel) -> list[list]:
        propose, forward = draft.propose, draft.runner.forward

        def counting_propose(reqs):
            calls.append([reqs, 0, None])
            calls[-1][2] = propose(reqs)
            return calls[-1][2]

        def counting_forward(batch):
            calls[-1][1] += 1
            return forward(batch)

        monkeypatch.setattr(draft, "propose", counting_propose)
        monkeypatch.setattr(draft.runner, "forward", counting_forward)
        return calls

    return watch


@pytest.mark.parametrize("n", [1, 3])
def test_draft_self_greedy_identical(tiny_runner, self_draft, draft_calls, n):
    """The target as its own draft: same output, (nearly) every draft kept, far fewer steps; the
    requests draft together, one draft forward per draft position."""
    calls = draft_calls(self_draft)
    plain, spec, s = both_draft(tiny_runner, self_draft, lambda: inputs(n))
    assert spec == plain
    assert s.num_spec_proposed_tokens > 0 and accept_rate(s) >= 0.98
    assert s.num_steps < 48 / 4
    assert s.num_generated_tokens == sum(len(v[0]) for v in spec.values())
    assert max(len(reqs) for reqs, _, _ in calls) == n
    assert all(forwards == max(map(len, drafts)) for _, forwards, drafts in calls)


def test_draft_other_model_identical(tiny_runner, other_draft):
    """A draft that is mostly wrong: rejected drafts are rolled back, the output is unchanged."""
    plain, spec, s = both_draft(tiny_runner, other_draft, lambda: inputs(2))
    assert spec == plain
    assert s.num_spec_proposed_tokens > 0 and accept_rate(s) < 0.5


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.3},
        {"temperature": 0.3, "top_p": 0.9, "top_k": 20, "min_p": 0.01},
        {"temperature": 0.3, "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2},
    ],
)
def test_draft_seeded_sampling_identical(tiny_runner, self_draft, params):
    """Greedy drafts against seeded sampling: some kept, some not, the same tokens as without.
    (A low temperature: the tiny random model's distributions are so flat that at 1.0 a greedy
    draft is almost never drawn.)"""
    plain, spec, s = both_draft(
        tiny_runner, self_draft, lambda: inputs(3, 40, seed0=5, **params), speculative_num_draft_tokens=4
    )
    assert spec == plain
    assert 0 < s.num_spec_accepted_tokens < s.num_spec_proposed_tokens


GRAMMARS = {
    "json_schema": json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"enum": ["xx", "yyy"]}},
            "required": ["a", "b"],
        }
    ),
    "regex": r"(ab|cd|[a-z ]){4,30}\.",
}


@pytest.mark.parametrize("kind", sorted(GRAMMARS))
@pytest.mark.parametrize("temperature", [0, 0.3])
def test_draft_grammar_identical(tiny_runner, self_draft, kind, temperature):
    """Constrained requests: drafts are checked against the matcher (cut at the first it rejects,
    rolled back when verification rejects them); the output is unchanged and valid."""
    import re

    def reqs():
        return inputs(2, 40, seed0=3, temperature=temperature, ignore_eos=False, **{kind: GRAMMARS[kind]})

    plain, spec, s = both_draft(tiny_runner, self_draft, reqs)
    assert spec == plain
    assert s.num_spec_proposed_tokens > 0
    for ids, reason, _ in spec.values():
        text = tiny_runner.tokenizer.decode(ids, skip_special_tokens=True)
        if reason["type"] == "stop":
            assert re.fullmatch(GRAMMARS[kind], text) if kind == "regex" else json.loads(text)


def test_draft_cache_follows_committed_tokens(self_draft):
    """After a rejection the draft cache is cut back to what was committed: the next drafts are
    the ones a fresh cache gives, and the cache holds exactly its tokens' slots."""
    d = self_draft
    ids = inputs(1)[0].input_ids
    first = d.propose([("x", ids, 6)])[0]
    assert len(first) == 6 and d.states["x"].ids == ids + first[:-1]
    # one draft kept, then another token, then more (as when jump-forward re-tokenizes): the
    # cache must go back to the first difference, not just drop its tail
    committed = ids + [first[0], (first[1] + 1) % 1000, first[2]]
    again = d.propose([("x", committed, 6)])[0]
    assert len(again) == 2  # the length adapts: kept + 1
    assert d.states["x"].ids == committed + again[:-1]
    assert d.slots_in_use() == len(d.states["x"].ids)
    d.release("x")
    assert d.propose([("y", committed, 2)])[0] == again
    d.release("y")
    assert_no_draft_leak(d)


def test_draft_no_leak_after_finish_and_abort(tiny_runner, self_draft):
    """Aborted requests (with drafts pending or not) and finished ones leave no slot or row held
    in either pool; the others' draft caches stay whole."""
    s = make_draft(tiny_runner, self_draft)
    for inp in inputs(3, 60):
        s.add_request(inp)
    for _ in range(50):
        s.step()
        if len(self_draft.states) == 3:
            break
    assert len(self_draft.states) == 3 and any(r.num_draft for r in s.running)
    held = sum(len(st.ids) for st in self_draft.states.values())
    assert self_draft.slots_in_use() == held
    assert s.abort_request("r1") is not None
    assert set(self_draft.states) == {"r0", "r2"}
    assert self_draft.slots_in_use() == sum(len(st.ids) for st in self_draft.states.values()) < held
    s.step()
    assert s.abort_request("r0") is not None
    while s.has_work():
        s.step()
    idle_accounting_ok(s)
    assert s.speculative_stats()["draft_kv_slots_in_use"] == 0


def test_draft_memory_pressure_identical(tiny_runner, tiny_model_dirs):
    """A target pool that forces retraction and a draft pool too small for every request: drafting
    is skipped or idle caches evicted, the output is unchanged, nothing leaks."""
    plain = run_all(make(tiny_runner, False), inputs(4, 60))
    small = ModelRunner(ServerArgs(model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=200))
    draft = DraftModel(
        draft_args(tiny_model_dirs["llama"], tiny_model_dirs["llama"], speculative_draft_max_tokens=120), small
    )
    s = make_draft(small, draft, max_total_tokens=200, speculative_draft_max_tokens=120)
    assert run_all(s, inputs(4, 60)) == plain
    assert s.num_retractions > 0 and s.num_spec_accepted_tokens > 0


def test_draft_vocab_mismatch(tiny_runner, tiny_model_dirs, tmp_path):
    """A draft model with another vocabulary size or other token ids is refused at startup."""
    import shutil

    from conftest import _tiny_config
    from transformers import AutoModelForCausalLM

    target = tiny_model_dirs["llama"]
    bigger = tmp_path / "bigger-vocab"
    AutoModelForCausalLM.from_config(_tiny_config("llama", 49152 + 64)).save_pretrained(bigger)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(target, name), bigger / name)
    with pytest.raises(ValueError, match="vocabulary of 49216 tokens, the target model 49152"):
        DraftModel(draft_args(target, str(bigger)), tiny_runner)
    swapped = tmp_path / "swapped-tokens"
    shutil.copytree(target, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different tokenizer"):
        DraftModel(draft_args(target, str(swapped)), tiny_runner)
    with pytest.raises(ValueError, match="speculative_draft_quantization must be one of"):
        DraftModel(draft_args(target, target, speculative_draft_quantization="int3"), tiny_runner)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"speculative_algorithm": "draft"}, "needs speculative_draft_model"),
        ({"speculative_draft_model": "smollm2"}, "only used with speculative_algorithm 'draft'"),
        ({"speculative_algorithm": "draft", "speculative_draft_model": "smollm2", "tp_size": 2}, "tp_size"),
        (
            {"speculative_algorithm": "draft", "speculative_draft_model": "smollm2", "speculative_draft_max_tokens": 1},
            "speculative_draft_max_tokens",
        ),
    ],
)
def test_draft_args_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)


def test_engine_draft_model(tiny_model_dirs):
    """The process path: a draft-model engine reports its acceptance and holds no draft slot idle."""
    from conftest import assert_no_leak

    import plait
    from plait.runtime.server.metrics import ServerMetrics

    path = tiny_model_dirs["llama"]
    with plait.Engine(
        model=path,
        dtype="float32",
        max_total_tokens=2048,
        speculative_algorithm="draft",
        speculative_draft_model=path,
        speculative_draft_max_tokens=512,
    ) as eng:
        outs = eng.generate(["one two three", "a b c d"], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        info = eng.get_server_info()
        assert_no_leak(eng)
    assert all(o["meta_info"]["completion_tokens"] == 24 for o in outs)
    assert info["num_spec_proposed_tokens"] > 0 and info["spec_accept_rate"] > 0.9
    assert info["draft_kv_slots_in_use"] == 0
    assert f"plait_spec_accept_rate {info['spec_accept_rate']}" in ServerMetrics().render(info, 0).decode()


def test_engine_checks_the_draft_model_first(tiny_model_dirs, tmp_path):
    """An unknown draft model path is a ValueError from Engine() itself, before any process starts."""
    import plait

    with pytest.raises(ValueError, match="no-such-draft"):
        plait.Engine(
            model=tiny_model_dirs["llama"],
            speculative_algorithm="draft",
            speculative_draft_model=str(tmp_path / "no-such-draft"),
        )


def test_draft_length_adapts():
    """Fully kept rounds double the draft length (to the maximum), a partial one sets it to what
    was kept plus one, nothing kept pauses drafting 1, 2, 4 ... rounds until a draft is kept."""
    from plait.runtime.speculative.ngram import MAX_PAUSE, DraftLength

    n = DraftLength(8)
    assert n.take() == 8
    n.record(3, 2)
    assert (n.k, n.pause) == (3, 0)
    n.record(3, 3)
    assert (n.k, n.pause) == (6, 0)
    n.record(6, 6)
    assert n.take() == 8
    pauses = []
    for _ in range(7):
        n.record(1, 0)
        pauses.append(n.pause)
        n.pause = 0
    assert n.k == 1 and pauses == [1, 2, 4, 8, 16, 16, 16] and MAX_PAUSE == 16
    n.pause = 2
    assert [n.take(), n.take(), n.take()] == [0, 0, 1]  # each paused round is used up once
    n.record(1, 1)
    assert (n.k, n.misses) == (2, 0)
    n.record(0, 0)  # nothing proposed: nothing changes
    assert n.k == 2
    fixed = DraftLength(8, shrink=False)  # n-gram drafts: the length stays, only misses pause
    fixed.record(8, 3)
    assert (fixed.take(), fixed.pause) == (8, 0)
    fixed.record(8, 0)
    assert (fixed.take(), fixed.take()) == (0, 8)


def test_draft_state_counts_what_the_committed_ids_kept():
    from plait.runtime.speculative.draft_model import _DraftState

    st = _DraftState(row=0, max_k=8)
    base = [1, 2, 3]

    def round_(drafts, committed):
        st.drafts, st.base = drafts, len(base)
        st.observe(base + committed)

    round_([4, 5, 6], [4, 5, 9])
    assert st.length.k == 3
    round_([4, 5, 6], [4, 5, 6, 7])
    assert st.length.k == 6
    round_([4], [5])
    assert (st.length.k, st.length.pause) == (1, 1)
    st.observe(base + [4, 5])  # no new proposal since: nothing changes
    assert (st.length.k, st.length.pause) == (1, 1)
