"""GPTQ and AWQ checkpoints load from their quantization_config into the int4 path
(model_executor/quantized_checkpoint.py): the layers compute with the checkpoint's codes, and the
model computes what the dequantized checkpoint computes.

The checkpoints are made here: a tiny llama's projections quantized 4-bit per group, then packed
in each format's own layout (AutoGPTQ's and AutoAWQ's packing: GPTQ codes along K in int32 words,
zeros minus one; AWQ along N in the 0 2 4 6 1 3 5 7 nibble order), act-order's g_idx included."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import quantizable_llama_config
from safetensors.torch import save_file
from test_model import Harness
from transformers import AutoModelForCausalLM

from plait.runtime.layers.quantization import InputPermuted, Int4Linear
from plait.runtime.model_executor.model_loader import load_tokenizer
from plait.runtime.server_args import ServerArgs

# each projection's module, and which input it reads (act-order: one column order per input)
PROJ = {
    "q_proj": ("self_attn", "attn"),
    "k_proj": ("self_attn", "attn"),
    "v_proj": ("self_attn", "attn"),
    "o_proj": ("self_attn", "o"),
    "gate_proj": ("mlp", "mlp"),
    "up_proj": ("mlp", "mlp"),
    "down_proj": ("mlp", "down"),
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """4-bit codes [N, K], float16 scales [G, N], zeros [G, N] (ints) of w, per group of g_idx."""
    n = w.shape[0]
    scales, zeros = torch.zeros(groups, n), torch.zeros(groups, n)
    codes = torch.zeros_like(w, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero()[:, 0]
        part = w[:, cols]
        if sym:
            s = (part.abs().amax(1) / 7.5).half().float()
            z = torch.full_like(s, 8.0)
        else:
            lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).half().float()
            z = torch.round(-lo / s).clamp(0, 15)
        codes[:, cols] = (torch.round(part / s[:, None]) + z[:, None]).clamp(0, 15).long()
        scales[g], zeros[g] = s, z
    return codes, scales, zeros


def pack(values: torch.Tensor, dim: int, order: list[int] = list(range(8))) -> torch.Tensor:
    """8 nibbles to an int32 word along `dim` (nibble i: entry order[i] of the 8)."""
    v = values.long()
    v = v.reshape(-1, 8, v.shape[1]).permute(0, 2, 1) if dim == 0 else v.reshape(v.shape[0], -1, 8)
    word = sum(v[..., order[i]] << (4 * i) for i in range(8))
    return torch.from_numpy((word.numpy() & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def make_checkpoint(folder: str, src: str, method: str, group: int, act_order: bool, sym: bool) -> dict:
    """Quantize the float llama in `src` into `folder`; returns the dequantized reference weights."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if "rotary" not in k and k != "lm_head.weight"}
    rng = torch.Generator().manual_seed(0)
    perms = {}
    out, ref = {}, dict(state)
    for name in [k for k in state if k.endswith(tuple(f"{p}.weight" for p in PROJ))]:
        w = state[name]
        k = w.shape[1]
        groups = k // group
        if act_order:  # one order per input: q, k, v share theirs, as gate and up do
            key = (name.split(".")[2], PROJ[name.split(".")[-2]][1])
            perm = perms.setdefault(key, torch.randperm(k, generator=rng))
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // group).int()
        else:
            g_idx = (torch.arange(k) // group).int()
        codes, scales, zeros = quantize(w, g_idx, groups, sym)
        ref[name] = scales[g_idx.long()].t() * (codes - zeros[g_idx.long()].t())
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            out[f"{prefix}.qweight"] = pack(codes.t(), dim=0)
            out[f"{prefix}.qzeros"] = pack(zeros - 1, dim=1)
            out[f"{prefix}.g_idx"] = g_idx
        else:
            out[f"{prefix}.qweight"] = pack(codes.t(), dim=1, order=AWQ_ORDER)
            out[f"{prefix}.qzeros"] = pack(zeros, dim=1, order=AWQ_ORDER)
        out[f"{prefix}.scales"] = scales.half()
        del state[name]
    out.update(state)
    os.makedirs(folder)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(folder, "model.safetensors"))
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(src, f), folder)
    config = json.load(open(os.path.join(src, "config.json")))
    quant = {"quant_method": method, "bits": 4, "group_size": group}
    quant.update({"desc_act": act_order, "sym": sym} if method == "gptq" else {"zero_point": True, "version": "gemm"})
    config["quantization_config"] = quant
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    return ref


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory, smollm2_path) -> str:
    folder = str(tmp_path_factory.mktemp("float-llama"))
    config = quantizable_llama_config()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer(smollm2_path).save_pretrained(folder)
    return folder


VARIANTS = {  # method, group size, act-order, symmetric
    "gptq-act-order": ("gptq", 128, True, False),
    "gptq-sym-g64": ("gptq", 64, False, True),
    "awq": ("awq", 128, False, False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_loads_into_int4_and_computes_its_model(variant, float_llama, tmp_path):
    method, group, act_order, sym = VARIANTS[variant]
    folder = str(tmp_path / variant)
    ref = make_checkpoint(folder, float_llama, method, group, act_order, sym)
    h = Harness(folder)
    # every projection: Int4Linear over the checkpoint's codes (act-order: its input permuted)
    for i, layer in enumerate(h.runner.model.layers):
        for mod, names in (
            (layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
            (layer.self_attn.o_proj, ("o_proj",)),
            (layer.mlp.gate_up_proj, ("gate_proj", "up_proj")),
            (layer.mlp.down_proj, ("down_proj",)),
        ):
            want = torch.cat([ref[f"model.layers.{i}.{PROJ[n][0]}.{n}.weight"] for n in names])
            assert isinstance(mod, InputPermuted if act_order else Int4Linear), (variant, names)
            inner = mod.inner if act_order else mod
            # minimum = -scale * zero is held as float16: within 2^-11 of it (exact when symmetric)
            got = inner.dequantized()
            bound = (inner.scale_min[..., 1].float().abs() * 2**-11).repeat_interleave(32, dim=1) + 1e-7
            if act_order:  # (columns in the layer's order: back to the weight's)
                got = torch.empty_like(got).index_copy_(1, mod.perm, got)
                bound = torch.empty_like(bound).index_copy_(1, mod.perm, bound)
            err = (got - want).abs()
            assert (err <= bound).all(), (variant, names, err.max())
            if sym:
                assert torch.equal(got, want)
    # the model computes what the dequantized checkpoint computes
    hf = AutoModelForCausalLM.from_pretrained(float_llama, dtype=torch.float32).eval()
    hf.load_state_dict(ref, strict=False)
    ids = load_tokenizer(folder)("The quick brown fox jumps over the lazy dog, twice over.").input_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = h.step([(h.new_row(), ids)])[0]
    assert (got - want).abs().max() / (want.max() - want.min()) < 0.02


@pytest.mark.parametrize(
    "quant, message",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit weights"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version is 'gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group size is 16"),
        ({"quant_method": "fp8"}, "quantized with 'fp8'"),
    ],
)
def test_checkpoints_plait_does_not_load_are_refused_by_name(quant, message, float_llama, tmp_path):
    shutil.copytree(float_llama, tmp_path / "m")
    config = json.load(open(tmp_path / "m" / "config.json"))
    config["quantization_config"] = quant
    json.dump(config, open(tmp_path / "m" / "config.json", "w"))
    from plait.runtime.model_executor.model_runner import ModelRunner

    with pytest.raises(ValueError, match=f"{message}.*plait loads .*GPTQ"):
        ModelRunner(ServerArgs(model=str(tmp_path / "m"), max_total_tokens=64))


def test_tp2_shards_the_codes(float_llama, tmp_path):
    """Tensor parallel over a GPTQ checkpoint: each rank takes its rows of q, k, v, gate, up and its
    groups of o and down as codes (int4 on both ranks); every step's logits equal TP=1's."""
    from test_tensor_parallel import tp2_and_tp1_step_logits

    folder = str(tmp_path / "gptq")
    make_checkpoint(folder, float_llama, "gptq", 64, False, True)
    got, ref = tp2_and_tp1_step_logits(folder)
    # (many rows run on the bfloat16 copy of the weights, whose partial sums round to bfloat16 before
    # the all-reduce: not TP=1's sums to the last bit; a wrong shard is off by the whole range)
    worst = max(float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(got, ref, strict=True))
    assert worst < 0.01


def test_a_shard_of_codes_is_the_shard_of_the_weight():
    from plait.runtime.layers.quantization import QuantizedWeight

    g = torch.Generator().manual_seed(0)
    w = QuantizedWeight(
        "int4", torch.randint(0, 16, (48, 256), generator=g, dtype=torch.uint8), torch.rand(48, 8), -torch.rand(48, 8)
    )
    full = w.dequantize()
    for dim, start, length in ((0, 16, 16), (1, 128, 128), (1, 64, 96)):
        part = w.narrow(dim, start, length)
        assert isinstance(part, QuantizedWeight) and torch.equal(part.dequantize(), full.narrow(dim, start, length))
    split = w.narrow(1, 16, 64)  # splits a group of 32: float
    assert isinstance(split, torch.Tensor) and torch.equal(split, full.narrow(1, 16, 64))
    permuted = QuantizedWeight("int4", w.codes, w.scale, w.minimum, perm=torch.randperm(256, generator=g))
    assert torch.equal(permuted.narrow(0, 8, 8).dequantize(), permuted.dequantize()[8:16])
    assert torch.equal(permuted.narrow(1, 0, 128), permuted.dequantize()[:, :128])
