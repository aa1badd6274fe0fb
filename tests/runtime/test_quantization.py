"""int8 and int4 weights: the quantized linear computes what its dequantized weight computes, a
quantized model serves through the Engine, and on the real SmolLM2 int8 stays close to float32;
int4 recovers a GGUF Q4_1 file's codes exactly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_model import Harness
from torch import nn

from plait.runtime.layers.quantization import (
    Fp8Linear,
    GroupInt8Linear,
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from plait.runtime.server_args import ServerArgs


def test_quantize_int8_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().max() == 127  # each row uses its full range
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()  # rounding error at most half a step


@pytest.mark.parametrize("rows", [1, 3, 7, 200])  # int8pack: int8 kernel below 4 rows, bf16 copy from 4
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
        if kernel == "dequant":  # F.linear on the same dequantized weight: float32 summation order only
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        else:  # bfloat16 activations: relative error ~2^-8 of the output's magnitude
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
    class AllReduced(nn.Linear):  # a subclass with its own forward is left alone
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(8, 8), AllReduced(8, 8))
    assert quantize_model(model, "int8") == 1
    assert isinstance(model[0], Int8Linear) and type(model[1]) is AllReduced
    with pytest.raises(ValueError, match="int3"):
        quantize_model(model, "int3")


def test_server_args_and_cli_flag():
    from plait.cli import _ENGINE_OPTIONS, build_parser

    assert ServerArgs(quantization="int8").quantization == "int8"
    assert ServerArgs(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int3")
    ns = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert ns.quantization == "int8" and "quantization" in _ENGINE_OPTIONS
    assert build_parser().parse_args(["serve", "--quantization", "int4"]).quantization == "int4"
    ns = build_parser().parse_args(["serve", "--disable-weight-prepack"])  # one copy of the weights
    assert ns.disable_weight_prepack and "disable_weight_prepack" in _ENGINE_OPTIONS


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

    path = tiny_model_dirs["qwen2"]  # untied LM head and q/k/v biases
    h = int8_harness(path)
    modules = list(h.runner.model.modules())
    assert not any(type(m) is nn.Linear for m in modules) and any(isinstance(m, Int8Linear) for m in modules)
    prompts = [[1, 15, 27, 99, 300, 7], [1, 4000, 12, 5]]
    expected = [greedy(h, p, 8) for p in prompts]
    with plait.Engine(model=path, dtype="float32", quantization="int8", max_total_tokens=2048) as eng:
        outs = eng.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        )
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
    from plait.runtime.model_executor.model_loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=True, add_generation_prompt=True)
        for c in (
            "What is the capital of France?",
            "Write a haiku about the sea.",
            "List three prime numbers.",
            "Explain what a lighthouse does.",
        )
    ]
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


# --- int4 (group-32 asymmetric, GGUF Q4_1's scheme) ---


def q4_1_tensor(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic Q4_1 tensor as a GGUF file holds it and as the loader dequantizes it:
    (codes uint8 [n, k], d and m fp16-valued float32 [n, k/32], W = d * q + m float32). Every block
    holds codes 0 and 15 (as Q4_1 writes them); block (0, 0) is constant (d = 0, all codes 0)."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    q = torch.randint(0, 16, (n, blocks, 32), generator=g, dtype=torch.uint8)
    pos = torch.randperm(32, generator=g)[:2]
    q[:, :, pos[0]], q[:, :, pos[1]] = 0, 15
    d = (torch.rand(n, blocks, generator=g) * torch.logspace(-4, -1, n)[:, None]).half().float()
    m = (-8 * d - torch.randn(n, blocks, generator=g) * d).half().float()
    d[0, 0], q[0, 0] = 0, 0
    w = d[..., None] * q.float() + m[..., None]
    return q.reshape(n, k), d, m, w.reshape(n, k)


def test_quantize_int4_recovers_q4_1_codes_exactly():
    q, d, m, w = q4_1_tensor(64, 256)
    got_q, scale, minimum = quantize_int4(w)
    assert got_q.dtype == torch.uint8 and scale.shape == minimum.shape == (64, 8)
    assert torch.equal(got_q, q)
    assert torch.equal(minimum, m)
    torch.testing.assert_close(scale, d, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(4, 48))


def test_quantize_int4_is_ggml_q4_1():
    """On arbitrary float weights the codes are the ones gguf-py's Q4_1 quantizer writes."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.manual_seed(3)
    w = torch.randn(16, 128) * torch.logspace(-3, 0, 16)[:, None]
    raw = quantize(w.numpy(), GGMLQuantizationType.Q4_1).reshape(-1, 20)  # per block: d, m (fp16), 16 bytes
    nibbles = raw[:, 4:]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).reshape(16, 128)
    q, scale, minimum = quantize_int4(w)
    assert (q.numpy() == codes).all()
    assert np.array_equal(scale.flatten().half().numpy(), raw[:, :2].copy().view(np.float16)[:, 0])
    assert np.array_equal(minimum.flatten().half().numpy(), raw[:, 2:4].copy().view(np.float16)[:, 0])


@pytest.mark.integration
def test_int4_recovers_the_bundled_gguf_codes():
    """The loader's float32 weights of a Q4_1 tensor re-quantize to the file's codes, d and m."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from plait.runtime.model_executor.model_loader import _bundled_smollm2_gguf

    t = next(t for t in GGUFReader(_bundled_smollm2_gguf()).tensors if t.name == "blk.3.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # [576, 1536]
    blocks = np.asarray(t.data).reshape(-1, 20)
    codes = np.concatenate([blocks[:, 4:] & 15, blocks[:, 4:] >> 4], axis=1).reshape(w.shape)
    q, scale, minimum = quantize_int4(w)
    assert (q.numpy() == codes).all()
    assert np.array_equal(scale.flatten().numpy(), blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float32))
    assert np.array_equal(minimum.flatten().numpy(), blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32))


def test_int4_dequantized_within_half_a_step():
    torch.manual_seed(4)
    w = torch.randn(32, 128) * torch.logspace(-2, 1, 32)[:, None]
    lin = Int4Linear(w, None, kernel="dequant")
    _, scale, _ = quantize_int4(w)
    step = scale.repeat_interleave(32, dim=1)
    # half a step of rounding, plus the float16 scale and minimum (a fraction of a % of a step)
    assert ((lin.dequantized() - w).abs() <= 0.55 * step + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 8, 9, 10, 200])  # int4pack: our GEMV up to 8 rows (else torch's int4
@pytest.mark.parametrize("bias", [False, True])  # kernel up to 9), the bf16 copy from there on;
@pytest.mark.parametrize("gemv,all_rows", [(True, False), (True, True), (False, False)])  # or the GEMV for all
def test_int4_linear_matches_dequantized(rows, bias, gemv, all_rows, monkeypatch):
    from plait.runtime.kernels.cpu import cpu_kernels

    cpu_kernels.load()
    if gemv and not cpu_kernels.int4_gemv_available():
        pytest.skip("no AVX512-VNNI or AVX2")
    monkeypatch.setattr(cpu_kernels, "int4_gemv_available", lambda: gemv)
    monkeypatch.setattr(cpu_kernels, "int4_gemv_all_rows", lambda: all_rows)
    torch.manual_seed(5)
    w, x = torch.randn(96, 128) * 0.1, torch.randn(rows, 128)
    b = torch.randn(96) if bias else None
    for kernel in ("dequant", "int4pack"):
        lin = Int4Linear(w, b, kernel=kernel)
        ref = F.linear(x, lin.dequantized(), b)
        got = lin(x)
        assert got.shape == (rows, 96) and got.dtype == torch.float32
        if kernel == "dequant":  # F.linear on the same dequantized weight: float32 summation order only
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        elif gemv and (rows <= 8 or all_rows):
            assert lin.packed_gemv is not None and lin.packed_int4 is None  # not a third copy
            assert (lin.packed_bf16 is None) == all_rows  # nor a bf16 one where unused
            # int16 activations, float32 out: the exact product up to ~1e-5
            assert (got - ref).abs().max() < 1e-4 * ref.abs().max()
        else:
            assert (lin.packed_gemv is None) != gemv and (lin.packed_int4 is None) == gemv
            if rows > 9 and cpu_kernels.small_gemm_available(torch.bfloat16):  # the copy: panels only
                assert lin.packed_bf16.panels is not None and lin.packed_bf16.packed is None
            # bfloat16 activations (torch's kernel: also its scales; from 10 rows: the weights):
            # compare with the same rounding of x; what is left is ~2^-8 of the output's magnitude.
            ref_bf16 = F.linear(x.bfloat16().float(), lin.dequantized(), b)
            assert (got - ref_bf16).abs().max() < 2**-7 * ref_bf16.abs().max()
    assert Int4Linear(w, b)(x.reshape(rows, 1, 128)).shape == (rows, 1, 96)


def test_int4_kernel_constraints_fall_back(monkeypatch):
    import plait.runtime.layers.quantization as quant

    torch.manual_seed(6)
    x = torch.randn(1, 64)
    # N not a multiple of 16: no int4 kernel, the bf16 copy serves every row
    lin = Int4Linear(torch.randn(40, 64), None, kernel="int4pack")
    assert lin.packed_int4 is None and lin.packed_gemv is None
    ref = F.linear(x.bfloat16().float(), lin.dequantized())
    assert (lin(x) - ref).abs().max() < 2**-7 * ref.abs().max()
    # K not a multiple of the group: that layer is int8
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 64))
    assert quantize_model(model, "int4") == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[1], Int4Linear)
    # other devices and torch builds without the op: dequantize
    assert quant.default_int4_kernel(torch.device("cuda")) == "dequant"
    monkeypatch.setattr(quant, "int4pack_available", lambda: False)
    lin = Int4Linear(torch.randn(32, 64), None)
    assert lin.kernel == "dequant" and lin.packed_int4 is None and lin.packed_gemv is None
    # the same dequantized weight through F.linear: float32 summation order only
    torch.testing.assert_close(lin(x), F.linear(x, lin.dequantized()), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="int4pack"):
        Int4Linear(torch.randn(32, 64), None, kernel="int4pack")


def dequantized_reference(path: str) -> Harness:
    """A float32 model whose linear weights are the int4 ones dequantized (LM head: int8's)."""
    from plait.runtime.distributed.parallel import ParallelLMHead

    h = Harness(path)
    with torch.no_grad():
        for mod in list(h.runner.model.modules()):
            if type(mod) is nn.Linear:
                mod.weight.copy_(Int4Linear(mod.weight, None, kernel="dequant").dequantized())
            elif isinstance(mod, ParallelLMHead):
                mod.packed = Int8Linear(mod.local_weight(), None, "dequant")
    return h


def test_tiny_int4_model_through_engine(tiny_model_dirs):
    """The Engine with quantization=int4 generates what the int4 model computes directly, and its
    first greedy tokens are those of a float32 model holding the dequantized weights."""
    from conftest import assert_no_leak

    import plait
    from plait.runtime.distributed.parallel import ParallelLMHead

    path = tiny_model_dirs["qwen2"]  # untied LM head and q/k/v biases
    h = Harness(path)
    assert quantize_model(h.runner.model, "int4") > 0
    modules = list(h.runner.model.modules())
    assert not any(type(m) is nn.Linear for m in modules)
    assert (
        sum(isinstance(m, Int4Linear) and (m.packed_int4 is not None or m.packed_gemv is not None) for m in modules)
        == 2 * 4
    )
    head = next(m for m in modules if isinstance(m, ParallelLMHead))
    assert isinstance(head.packed, Int8Linear)  # the LM head stays 8-bit
    prompts = [[1, 15, 27, 99, 300, 7], [1, 4000, 12, 5]]
    expected = [greedy(h, p, 8) for p in prompts]
    ref = dequantized_reference(path)
    assert [greedy(ref, p, 4) for p in prompts] == [e[:4] for e in expected]
    with plait.Engine(model=path, dtype="float32", quantization="int4", max_total_tokens=2048) as eng:
        for p, e in zip(prompts, expected):  # one at a time: 1-row decode steps, as greedy() runs them
            out = eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
            assert out["output_ids"] == e
        assert_no_leak(eng)


@pytest.mark.integration
def test_smollm2_int4_closer_to_float32_than_int8(smollm2_path):
    """On the Q4_1 GGUF, int4 holds the file's own weights: its logits are nearer float32's than
    int8's, over a prompt (many rows: the bfloat16 copy; measured KL 0.0017 vs 0.0050 on the quality
    text) and over decode steps (one row: `int4_gemv` where it runs; measured on 48 steps: KL
    0.00107, torch's int4 kernel 0.00121, int8 0.00461)."""
    from plait.benchmarks.quality import TEXT
    from plait.runtime.model_executor.model_loader import load_tokenizer

    ids = load_tokenizer(smollm2_path).encode(TEXT, add_special_tokens=False)
    n = 16  # decode steps at the end of the text

    def log_probs(h: Harness) -> tuple[torch.Tensor, torch.Tensor]:
        row = h.new_row()
        prompt = torch.log_softmax(h.step([(row, ids[:-n])])[0].float(), -1)
        decode = torch.stack([torch.log_softmax(h.step([(row, [t])])[0][0].float(), -1) for t in ids[-n:]])
        h.table.free(row)
        return prompt, decode

    def kl(p: torch.Tensor, q: torch.Tensor) -> float:
        return float((p.exp() * (p - q)).sum(-1).mean())

    ref = log_probs(Harness(smollm2_path))
    prompt_kl, decode_kl = {}, {}
    for method in ("int4", "int8"):
        h = Harness(smollm2_path)
        quantize_model(h.runner.model, method)
        prompt, decode = log_probs(h)
        prompt_kl[method], decode_kl[method] = kl(ref[0], prompt), kl(ref[1], decode)
    assert prompt_kl["int4"] < 0.004 and prompt_kl["int4"] < 0.6 * prompt_kl["int8"], prompt_kl
    assert decode_kl["int4"] < 0.003 and decode_kl["int4"] < 0.6 * decode_kl["int8"], decode_kl


@pytest.mark.parametrize("group", [16, 32])
def test_group_int8_linear_with_and_without_its_kernel(monkeypatch, group):
    """GroupInt8Linear is its codes' weight whichever form holds them (the kernel's layout, or the
    codes where no kernel runs), and computes it with or without `int8g_gemv`."""
    from plait.runtime.kernels.cpu import cpu_kernels

    g = torch.Generator().manual_seed(group)
    q = torch.randint(-32, 32, (48, 128), dtype=torch.int8, generator=g)
    scale = torch.rand(48, 128 // group, generator=g) / 100
    low = -torch.rand(48, 128 // group, generator=g) / 10
    bias = torch.randn(48, generator=g)
    want = (q.float().reshape(48, -1, group) * scale[..., None] + low[..., None]).reshape(48, 128)
    x = torch.randn(3, 128, generator=g)
    ref = F.linear(x.double(), want.double(), bias.double())
    cpu_kernels.load()
    for kernels in (True, False):
        monkeypatch.setitem(cpu_kernels._state, "ok", kernels and cpu_kernels._state["ok"])
        layer = GroupInt8Linear(q, scale, low, bias)
        assert torch.equal(layer.dequantized(), want)
        assert (layer.packed_gemv is not None) == cpu_kernels.int4_gemv_available()
        y = layer(x)
        assert y.shape == (3, 48) and y.dtype == torch.float32
        # int16 activations (~1e-5), else the bfloat16 copy's activations and weights
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 2**-7
    assert layer.packed_gemv is None and layer.qweight.dtype == torch.int8
