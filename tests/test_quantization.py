"""int8 weights: the quantized linear computes what its dequantized weight computes, a quantized
model serves through the Engine, and on the real SmolLM2 int8 stays close to float32."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from plait.runtime.quantization import (
    Fp8Linear,
    Int8Linear,
    quantize_int8,
    quantize_model,
)
from plait.runtime.server_args import ServerArgs
from test_model import Harness
from torch import nn


def test_quantize_int8_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-2, 1, 48)[:, None]   # rows of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().max() == 127                                     # each row uses its full range
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()                 # rounding error at most half a step


@pytest.mark.parametrize("rows", [1, 3, 7, 200])   # int8pack: int8 kernel below 4 rows, bf16 copy from 4
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_dequantized(rows, bias):
    torch.manual_seed(1)
    w, x = torch.randn(96, 64) * 0.1, torch.randn(rows, 64)
    b = torch.randn(96) if bias else None
    for kernel in ("dequant", "int8pack"):
        lin = Int8Linear(w, b, kernel)
        ref = F.linear(x, lin.dequantized(), b)
        got = lin(x)
        assert got.shape == (rows, 96) and got.dtype == torch.float32
        if kernel == "dequant":
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        else:   # bfloat16 activations: relative error ~2^-8 of the output's magnitude
            assert (got - ref).abs().max() < 0.01 * ref.abs().max()
    # leading dimensions are kept
    assert Int8Linear(w, b, "int8pack")(x.reshape(rows, 1, 64)).shape == (rows, 1, 96)


def test_w8a8_kernel_within_activation_quantization_error():
    torch.manual_seed(2)
    w, x = torch.randn(64, 128) * 0.1, torch.randn(5, 128) * torch.tensor([[0.1], [1], [3], [10], [0.01]])
    lin = Int8Linear(w, torch.randn(64), "w8a8")
    deq = lin.dequantized()
    ref = F.linear(x, deq, lin.bias)
    # int8 activations, one scale per row (token): each input is off by at most half a step.
    x_step = x.abs().amax(1, keepdim=True) / 127
    bound = x_step / 2 * deq.abs().sum(1) + 1e-4
    err = (lin(x) - ref).abs()
    assert (err <= bound).all() and err.max() > 0


def test_fp8_needs_cuda_and_falls_back_to_int8():
    with pytest.raises(ValueError, match="CUDA"):
        Fp8Linear(torch.randn(16, 16), None)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    assert quantize_model(model, "fp8") == 2
    assert all(isinstance(model[i], Int8Linear) for i in (0, 2))


def test_quantize_model_replaces_plain_linears_only():
    class AllReduced(nn.Linear):   # a subclass with its own forward is left alone
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(8, 8), AllReduced(8, 8))
    assert quantize_model(model, "int8") == 1
    assert isinstance(model[0], Int8Linear) and type(model[1]) is AllReduced
    with pytest.raises(ValueError, match="int4"):
        quantize_model(model, "int4")


def test_server_args_and_cli_flag():
    from plait.cli import _ENGINE_OPTIONS, build_parser
    assert ServerArgs(quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int4")
    ns = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert ns.quantization == "int8" and "quantization" in _ENGINE_OPTIONS


def greedy(h: Harness, ids: list[int], n: int) -> list[int]:
    """Prefill then n - 1 decode steps of one request, as the engine runs them."""
    row = h.new_row()
    out = [int(h.step([(row, ids)])[0][-1].argmax())]
    for _ in range(n - 1):
        out.append(int(h.step([(row, [out[-1]])])[0][-1].argmax()))
    h.table.free(row)
    return out


def int8_harness(path: str) -> Harness:
    h = Harness(path)
    assert quantize_model(h.runner.model, "int8") > 0
    return h


def test_tiny_int8_model_through_engine(tiny_model_dirs):
    """The Engine with quantization=int8 generates what the quantized model computes directly."""
    from conftest import assert_no_leak

    import plait
    path = tiny_model_dirs["qwen2"]   # untied LM head and q/k/v biases
    h = int8_harness(path)
    modules = list(h.runner.model.modules())
    assert not any(type(m) is nn.Linear for m in modules) and any(isinstance(m, Int8Linear) for m in modules)
    prompts = [[1, 15, 27, 99, 300, 7], [1, 4000, 12, 5]]
    expected = [greedy(h, p, 8) for p in prompts]
    with plait.Engine(model=path, dtype="float32", quantization="int8", max_total_tokens=2048) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                                "ignore_eos": True})
        assert [o["output_ids"] for o in outs] == expected
        assert_no_leak(eng)


def perplexity(h: Harness, ids: list[int]) -> float:
    row = h.new_row()
    logits = h.step([(row, ids)])[0]
    h.table.free(row)
    lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-lp.mean().item())


@pytest.mark.integration
def test_smollm2_int8_close_to_float32(smollm2_path):
    from plait.benchmarks.quality import TEXT
    from plait.runtime.model_loader import load_tokenizer
    tok = load_tokenizer(smollm2_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True, add_generation_prompt=True)
               for c in ("What is the capital of France?", "Write a haiku about the sea.",
                         "List three prime numbers.", "Explain what a lighthouse does.")]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    text = tok.encode(TEXT)
    ref, q = Harness(smollm2_path), int8_harness(smollm2_path)
    n = 16
    ref_out = [greedy(ref, p, n) for p in prompts]
    q_out = [greedy(q, p, n) for p in prompts]
    # free-running: tokens before the first difference (measured: 58 of 4 x 16)
    same_prefix = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(q_out, ref_out))
    assert same_prefix >= 0.75 * n * len(prompts), (q_out, ref_out)
    # teacher-forced: top-1 on float32's continuation (measured: 97%)
    agree = total = 0
    for p, r in zip(prompts, ref_out):
        row = q.new_row()
        logits = q.step([(row, p + r[:-1])])[0][-n:]
        q.table.free(row)
        agree += int((logits.argmax(-1) == torch.tensor(r)).sum())
        total += n
    assert agree / total >= 0.9
    # measured: 24.080 -> 24.086
    ppl_ref, ppl_q = perplexity(ref, text), perplexity(q, text)
    assert abs(ppl_q - ppl_ref) < 0.01 * ppl_ref, (ppl_ref, ppl_q)
