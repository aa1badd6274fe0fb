"""Tests for runtime.sampling_params and runtime.sampler (CPU, fast)."""

from __future__ import annotations

import random

import pytest
import torch

from plait.runtime.layers.sampler import Sampler, SamplingBatch, exponentials, row_key, token_hash
from plait.runtime.sampling_params import SamplingParams as SP


def build(params, logits_or_V, seeds=None, steps=None, prompts=None, outputs=None, eos=(0,)):
    """SamplingBatch.build with defaults for the lists the test doesn't care about."""
    B = len(params)
    V = logits_or_V if isinstance(logits_or_V, int) else logits_or_V.shape[1]
    outputs = outputs if outputs is not None else [[] for _ in range(B)]
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(B)),
        steps if steps is not None else [len(o) for o in outputs],
        prompts if prompts is not None else [[] for _ in range(B)],
        outputs,
        list(eos),
        V,
    )


def sample(params, logits, **kw):
    return Sampler()(logits, build(params, logits, **kw))


def empirical(logits_row: torch.Tensor, p: SP, n: int, seed: int = 1234) -> torch.Tensor:
    """Frequencies of n draws for one row, varying the step (one batched call)."""
    V = logits_row.numel()
    logits = logits_row.unsqueeze(0).expand(n, V).contiguous()
    toks = sample([p] * n, logits, seeds=[seed] * n, steps=list(range(n)), outputs=[[] for _ in range(n)], eos=())
    return torch.bincount(toks, minlength=V).double() / n


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a.double() - b.double()).abs().sum().item()


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_and_input_untouched(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 100, generator=g).to(dtype)
    before = logits.clone()
    out = sample([SP(temperature=0)] * 7, logits)
    assert out.dtype == torch.int64 and out.shape == (7,)
    assert torch.equal(out, logits.float().argmax(-1))
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 200, generator=g)
    params = [SP(temperature=0.9, top_k=1)] * 16
    assert all(p.greedy for p in params)
    assert torch.equal(sample(params, logits), logits.argmax(-1))


def test_mixed_batch_greedy_rows_are_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 64, generator=g)
    params = [SP(temperature=0), SP(temperature=1.0), SP(top_k=1), SP(top_p=0.9), SP(temperature=0), SP(min_p=0.1)]
    out = sample(params, logits)
    for b in (0, 2, 4):
        assert out[b] == logits[b].argmax()


def test_sampling_does_not_modify_logits():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=g)
    before = logits.clone()
    params = [SP(repetition_penalty=1.5, top_p=0.8), SP(min_new_tokens=2), SP()]
    sample(params, logits, prompts=[[1, 2], [3], [4]], outputs=[[5], [], [6]])
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- determinism


def test_same_seed_and_step_same_token_regardless_of_batch():
    g = torch.Generator().manual_seed(4)
    V, n = 500, 24
    logits = torch.randn(n, V, generator=g) * 2
    params = [SP(temperature=0.8)] * n
    seeds = [1000 + i for i in range(n)]
    steps = [7 * i for i in range(n)]
    sampler = Sampler()
    ref = sampler(logits, build(params, logits, seeds=seeds, steps=steps))

    # Each row alone.
    for i in range(n):
        alone = sampler(logits[i : i + 1], build(params[i : i + 1], V, seeds=seeds[i : i + 1], steps=steps[i : i + 1]))
        assert alone.item() == ref[i].item()

    # Shuffled, interleaved with greedy / filtered / penalised rows (forces the sorted path
    # and the penalty path for the batch, but not for the rows under test).
    extra_p = [
        SP(temperature=0),
        SP(top_k=5),
        SP(top_p=0.5),
        SP(min_p=0.2),
        SP(repetition_penalty=1.3, frequency_penalty=0.4),
    ]
    extra_logits = torch.randn(len(extra_p), V, generator=g)
    order = list(range(n))
    random.Random(0).shuffle(order)
    rows = [("t", i) for i in order] + [("x", j) for j in range(len(extra_p))]
    random.Random(1).shuffle(rows)
    P, S, St, L, Pr, O = [], [], [], [], [], []
    for kind, i in rows:
        if kind == "t":
            P.append(params[i])
            S.append(seeds[i])
            St.append(steps[i])
            L.append(logits[i])
            Pr.append([])
            O.append([])
        else:
            P.append(extra_p[i])
            S.append(99)
            St.append(3)
            L.append(extra_logits[i])
            Pr.append([1, 2, 3])
            O.append([4, 4, 5])
    out = sampler(torch.stack(L), SamplingBatch.build(P, S, St, Pr, O, [0], V))
    for pos, (kind, i) in enumerate(rows):
        if kind == "t":
            assert out[pos].item() == ref[i].item()


def test_same_seed_same_tokens_with_and_without_sorted_path():
    # A row with no filter gives the same token whether or not the batch sorts.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 300, generator=g)
    s = Sampler()
    for step in range(50):
        a = s(logits, build([SP()], logits, seeds=[42], steps=[step]))
        b = s(torch.cat([logits, logits]), build([SP(), SP(top_p=0.3)], 300, seeds=[42, 7], steps=[step, step]))
        assert a.item() == b[0].item()


def test_different_seeds_differ():
    V, n = 1000, 300
    logits = torch.zeros(n, V)  # uniform: two independent draws agree with prob 1/V
    a = sample([SP()] * n, logits, seeds=[1] * n, steps=list(range(n)))
    b = sample([SP()] * n, logits, seeds=[2] * n, steps=list(range(n)))
    assert (a == b).float().mean().item() < 0.02
    assert len(set(a.tolist())) > 200  # steps give fresh draws too
    # Many seeds at the same step also spread over the vocabulary.
    c = sample([SP()] * n, logits, seeds=list(range(n)), steps=[0] * n)
    assert len(set(c.tolist())) > 200


def test_large_and_negative_seeds_are_accepted():
    logits = torch.zeros(3, 50)
    out = sample([SP()] * 3, logits, seeds=[-1, 2**70 + 5, 2**63 - 1])
    assert ((0 <= out) & (out < 50)).all()


def test_hash_uniforms_are_uniform_and_open_interval():
    e = exponentials(torch.tensor([[row_key(s, t)] for s in range(4) for t in range(4)]), token_hash(4096).unsqueeze(0))
    u = torch.exp(-e.double()).flatten()
    assert (u > 0).all() and (u < 1).all()
    # Kolmogorov-Smirnov distance against U(0,1).
    us = u.sort().values
    grid = torch.arange(1, us.numel() + 1, dtype=torch.float64) / us.numel()
    assert (us - grid).abs().max().item() < 0.01


# ----------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_empirical_distribution_matches_softmax(temperature):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(10, generator=g)
    freq = empirical(logits, SP(temperature=temperature), 40000)
    expected = torch.softmax(logits / temperature, -1)
    assert tv(freq, expected) < 0.02


def test_empirical_distribution_with_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.05, 0.30, 0.02, 0.25, 0.15, 0.13, 0.10]))
    p = torch.softmax(logits, -1)
    n = 30000
    # top_k=3 -> {1, 3, 4} renormalised.
    exp_k = torch.zeros(7)
    exp_k[[1, 3, 4]] = p[[1, 3, 4]]
    exp_k /= exp_k.sum()
    assert tv(empirical(logits, SP(top_k=3), n), exp_k) < 0.02
    # top_p=0.6 -> 0.30+0.25 = 0.55 < 0.6, + 0.15 -> {1, 3, 4}.
    assert tv(empirical(logits, SP(top_p=0.6), n), exp_k) < 0.02
    # min_p=0.4 -> threshold 0.12 keeps {1, 3, 4, 5}.
    exp_m = torch.zeros(7)
    exp_m[[1, 3, 4, 5]] = p[[1, 3, 4, 5]]
    exp_m /= exp_m.sum()
    assert tv(empirical(logits, SP(min_p=0.4), n), exp_m) < 0.02


def test_top_k_restricts_support():
    g = torch.Generator().manual_seed(7)
    V, n = 40, 3000
    logits = torch.randn(V, generator=g) * 0.3
    topk = set(logits.topk(5).indices.tolist())
    # All rows top_k -> partial-topk path.
    f = empirical(logits, SP(top_k=5, temperature=2.0), n)
    assert set(f.nonzero().flatten().tolist()) == topk
    # Mixed with an unfiltered row -> full sort path.
    L = torch.stack([logits, logits]).repeat(n, 1)
    params = [SP(top_k=5, temperature=2.0), SP(temperature=2.0)] * n
    out = sample(params, L, seeds=[3] * (2 * n), steps=[i // 2 for i in range(2 * n)])
    assert set(out[0::2].tolist()) == topk
    assert len(set(out[1::2].tolist())) > 5


@pytest.mark.parametrize(
    "top_p,expected",
    [
        (0.35, {2}),  # 0.4 alone reaches it
        (0.65, {2, 0}),  # 0.4 + 0.3 = 0.7
        (0.75, {2, 0, 3}),  # + 0.2 = 0.9
        (0.95, {2, 0, 3, 1}),
    ],
)
def test_top_p_support_is_nucleus(top_p, expected):
    probs = torch.tensor([0.3, 0.1, 0.4, 0.2])
    f = empirical(torch.log(probs), SP(top_p=top_p), 4000)
    assert set(f.nonzero().flatten().tolist()) == expected


def test_min_p_drops_small_tokens():
    probs = torch.tensor([0.5, 0.05, 0.3, 0.15])
    f = empirical(torch.log(probs), SP(min_p=0.2), 4000)  # threshold 0.1
    assert set(f.nonzero().flatten().tolist()) == {0, 2, 3}


def test_top_p_keeps_top_token_even_if_tiny_top_p():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    f = empirical(torch.log(probs), SP(top_p=1e-6), 500)
    assert f[3].item() == 1.0


# ----------------------------------------------------------------------------- penalties


def reference_penalties(logits, params, prompts, outputs):
    """Straightforward per-row, per-token Python reference."""
    out = logits.clone().double()
    for b, p in enumerate(params):
        for t in set(prompts[b]) | set(outputs[b]):
            v = out[b, t].item()
            out[b, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(outputs[b]):
            c = outputs[b].count(t)
            out[b, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_penalties_match_reference(seed, every_row):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    B, V = 6, 30
    logits = torch.randn(B, V, generator=g) * 3
    params = []
    for b in range(B):
        kinds = ["rep", "freq", "pres", "all"] if every_row else ["none", "rep", "freq", "pres", "all"]
        kind = "none" if (b == 0 and not every_row) else rng.choice(kinds)
        params.append(
            SP(
                temperature=0,
                repetition_penalty=rng.uniform(0.5, 2.0) if kind in ("rep", "all") else 1.0,
                frequency_penalty=rng.uniform(-2, 2) if kind in ("freq", "all") else 0.0,
                presence_penalty=rng.uniform(-2, 2) if kind in ("pres", "all") else 0.0,
            )
        )
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(0, 12))] for _ in range(B)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 12))] for _ in range(B)]
    sampler = Sampler()
    batch = build(params, logits, prompts=prompts, outputs=outputs, eos=())
    got = sampler.adjust_logits(logits, batch)
    ref = reference_penalties(logits, params, prompts, outputs)
    # float32 against the float64 reference: one or two float32 roundings of each penalised logit
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # End to end: greedy picks the argmax of the penalised logits.
    assert torch.equal(sampler(logits, batch), ref.argmax(-1))


def test_no_penalty_batch_builds_no_penalty_tensors():
    b = build([SP(), SP(temperature=0)], 10, prompts=[[1], [2]], outputs=[[3], [4]])
    assert b.penalty_rows is None and b.rep_index is None and b.out_penalty is None
    assert b.top_ks is None and b.top_ps is None and b.min_ps is None and b.sort_width is None
    g = build([SP(temperature=0)] * 3, 10)
    assert g.all_greedy and g.temperatures is None and g.block_rows is None
    r = build([SP(repetition_penalty=1.2), SP()], 10, prompts=[[1], [2]], outputs=[[3], [4]])
    assert r.out_penalty is None and r.penalty_rows.tolist() == [0]
    assert sorted(r.rep_index.tolist()) == [1, 3]
    f = build(
        [SP(presence_penalty=0.5), SP(frequency_penalty=1.0, repetition_penalty=2.0)],
        10,
        prompts=[[1], [2]],
        outputs=[[3, 3], [4, 4, 5]],
    )
    assert f.out_penalty.shape == (2, 10)
    assert f.out_penalty[0].nonzero().flatten().tolist() == [3] and f.out_penalty[0, 3] == 0.5
    assert f.out_penalty[1, 4] == 2.0 and f.out_penalty[1, 5] == 1.0
    assert sorted(f.rep_index.tolist()) == [12, 14, 14, 15]  # row 1 only: 10 + {2, 4, 4, 5}


def test_penalties_are_output_only_for_frequency_and_presence():
    logits = torch.zeros(1, 5)
    p = SP(temperature=0, frequency_penalty=1.0, presence_penalty=0.5)
    x = Sampler().adjust_logits(logits, build([p], 5, prompts=[[1, 1, 1]], outputs=[[2, 2, 3]]))
    assert x.tolist() == [[0.0, 0.0, -2.5, -1.5, 0.0]]


# ----------------------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_blocks_eos_and_stop_ids():
    V = 20
    logits = torch.zeros(1, V)
    logits[0, 0] = 10.0  # EOS
    logits[0, 5] = 9.0  # stop token
    logits[0, 7] = 8.0
    p = SP(temperature=0, min_new_tokens=3, stop_token_ids=[5])
    s = Sampler()
    for step, want in [(0, 7), (1, 7), (2, 7), (3, 0)]:
        out = s(logits, build([p], V, steps=[step], outputs=[[7] * step], eos=(0,)))
        assert out.item() == want
    # Multiple EOS ids, sampled rows: none of the blocked ids is ever drawn.
    n = 2000
    L = torch.zeros(n, V)
    L[:, [0, 1, 5]] = 5.0
    p = SP(min_new_tokens=10, stop_token_ids=[5])
    out = sample([p] * n, L, seeds=list(range(n)), steps=[3] * n, eos=(0, 1))
    assert not torch.isin(out, torch.tensor([0, 1, 5])).any()
    # After min_new_tokens, they dominate again.
    out = sample([p] * n, L, seeds=list(range(n)), steps=[10] * n, eos=(0, 1))
    assert torch.isin(out, torch.tensor([0, 1, 5])).float().mean() > 0.9


def test_build_rejects_out_of_range_ids():
    with pytest.raises(ValueError):
        build([SP(min_new_tokens=1, stop_token_ids=[99])], 10)
    with pytest.raises(ValueError):
        build([SP(repetition_penalty=1.1)], 10, prompts=[[10]])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), build([SP()], 10))


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), build([], 10))
    assert out.shape == (0,) and out.dtype == torch.int64


# ----------------------------------------------------------------------------- SamplingParams


def test_params_defaults_and_none_means_default():
    p = SP.from_dict({"temperature": None, "max_new_tokens": None, "stop": None}, strict=True)
    assert p == SP()
    assert SP.from_dict(None, strict=True) == SP()
    assert SP(top_p=None).top_p == 1.0
    p.validate()


def test_stop_string_normalizes_to_list():
    assert SP(stop="x").stop == ["x"]
    assert SP.from_dict({"stop": "x", "stop_regex": "a+"}, strict=False).stop == ["x"]
    assert SP(stop_regex="a+").stop_regex == ["a+"]
    lst = ["a"]
    p = SP(stop=lst)
    lst.append("b")
    assert p.stop == ["a"]  # not aliased


def test_strict_vs_lenient_unknown_keys():
    with pytest.raises(ValueError, match="bogus"):
        SP.from_dict({"temperature": 0.5, "bogus": 1}, strict=True)
    p = SP.from_dict({"temperature": 0.5, "bogus": 1}, strict=False)
    assert p.temperature == 0.5


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "abc"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"n": True}, "n"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": [1]}, "stop"),
        ({"stop_regex": "("}, "stop_regex"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"regex": 3}, "regex"),
    ],
)
def test_validate_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SP(**kw).validate()


def test_validate_messages_and_vocab_bound():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SP(temperature=-1).validate()
    with pytest.raises(ValueError, match="stop_token_ids"):
        SP(stop_token_ids=[100]).validate(vocab_size=100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SP(stop_token_ids=[-1]).validate()
    SP(stop_token_ids=[99]).validate(vocab_size=100)


def test_validate_accepts_valid_edges():
    SP(temperature=0).validate()  # int 0 = greedy
    assert SP(temperature=0).greedy and SP(top_k=1).greedy and not SP().greedy
    SP(
        top_p=1,
        min_p=1,
        top_k=-1,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=0.1,
        max_new_tokens=0,
        min_new_tokens=0,
        seed=-5,
    ).validate()
    SP(temperature=1, top_k=50, n=3, stop=["a"], regex="a+").validate()


def test_at_most_one_grammar_field():
    with pytest.raises(ValueError, match="at most one"):
        SP(regex="a+", json_schema="{}").validate()
    with pytest.raises(ValueError, match="choices"):
        SP(choices=[]).validate()
    assert SP(json_schema={"type": "integer"}).json_schema == '{"type": "integer"}'
    assert SP(choices=["x", "y"]).grammar_spec().kind == "choice"
    assert SP().grammar_spec() is None


def test_a_reference_cycle_is_read_within_its_resource():
    """`{"$ref": "#"}`-only chains describe nothing and are refused; a nested resource's own
    `$defs` (goreleaser's `FileInfo`, an `$id` of its own pointing at `#/$defs/FileInfo`) is not
    a cycle with the document's `$defs` of the same name."""
    from plait.grammar import GrammarError

    with pytest.raises(GrammarError, match="circular"):
        SP(
            json_schema={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ).grammar_spec()
    inner = {
        "$id": "https://example.com/file-info",
        "$ref": "#/$defs/FileInfo",
        "$defs": {"FileInfo": {"type": "object"}},
    }
    assert (
        SP(json_schema={"$defs": {"FileInfo": inner}, "$ref": "#/$defs/FileInfo"}).grammar_spec().kind == "json_schema"
    )
