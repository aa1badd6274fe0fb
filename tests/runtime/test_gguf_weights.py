"""GGUF tensors read as the file stores them (model_executor/gguf_weights.py): the 4-bit types'
codes go into Int4Linear unchanged, the 5- to 8-bit types' into GroupInt8Linear, float ones stay
float, and the model computes what the dequantized file computes.

A tiny llama GGUF is written here with gguf-py, one ggml type per projection (Q4_0, Q4_1, Q4_K,
Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, F16, F32), from random blocks; the reference is the same file
dequantized by gguf-py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import decode_logits, quantizable_llama_config, skip_without_fused_op
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from test_model import Harness
from transformers import AutoModelForCausalLM, LlamaConfig

from plait.runtime.layers.quantization import GroupInt8Linear, Int4Linear
from plait.runtime.model_executor import model_loader
from plait.runtime.model_executor.gguf_weights import decode_int4, decode_int8g, read_tensors
from plait.runtime.model_executor.model_loader import load_tokenizer, load_weights

HIDDEN, INTER = 256, 512  # quantizable_llama_config's
_BLOCK = {  # values, bytes
    T.Q4_0: (32, 18),
    T.Q4_1: (32, 20),
    T.Q4_K: (256, 144),
    T.Q5_0: (32, 22),
    T.Q5_1: (32, 24),
    T.Q5_K: (256, 176),
    T.Q6_K: (256, 210),
    T.Q8_0: (32, 34),
}
LAYER_TYPES = [  # layer 0 mixes 4- and 6-bit types in one fused layer (q, k, v), layer 1 is float
    {"attn_q": T.Q4_K, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q4_1},
    {"attn_q": T.F16, "attn_k": T.F16, "attn_v": T.F32, "attn_output": T.F16},
]
MLP_TYPES = [
    {"ffn_gate": T.Q4_K, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0},
    {"ffn_gate": T.Q5_K, "ffn_up": T.Q5_1, "ffn_down": T.Q5_0},
]


def f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).view(np.uint8)


def random_tensor(rng, kind: T, rows: int, cols: int, model: bool = True) -> np.ndarray:
    """A tensor of `kind` as the file holds it: random codes; with `model`, scales that give weights
    of a few hundredths around 0 (a model whose logits mean something), else random scale bytes."""
    if kind in (T.F32, T.F16):
        return rng.normal(0, 0.05, (rows, cols)).astype(np.float32 if kind == T.F32 else np.float16)
    if kind == T.Q8_0 and model:
        return quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), kind)
    per, size = _BLOCK[kind]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    d = rng.uniform(0.004, 0.01, (rows, cols // per, 1)).astype(np.float16)
    if kind in (T.Q4_0, T.Q5_0):
        raw[..., 0:2] = f16(d if kind == T.Q4_0 else d / 2)
    elif kind == T.Q8_0:
        raw[..., 0:2] = f16(d / 16)
    elif kind == T.Q5_1:  # minimum -16 d: centred
        raw[..., 0:4] = np.concatenate([f16(d / 2), f16(-8 * d)], axis=-1)
    elif kind == T.Q5_K and model:  # as Q4_K's, codes to 31: dmin 15.5 d
        d = d / 64
        raw[..., 0:4] = np.concatenate([f16(d), f16(15.5 * d)], axis=-1)
        raw[..., 4:16] = [160] * 8 + [0] * 4
    elif kind == T.Q5_K:
        raw[..., 0:4] = np.concatenate([f16(d), f16(d)], axis=-1)
    elif kind == T.Q4_1:  # minimum -8 d: centred
        raw[..., 0:4] = np.concatenate([f16(d), f16(-8 * d)], axis=-1)
    elif kind == T.Q4_K and model:  # every sub-block scale and minimum 32 (bytes 160 x 8, 0 x 4),
        d = d / 32  # dmin 7.5 d: q * 32 d - 32 * 7.5 d, centred
        raw[..., 0:4] = np.concatenate([f16(d), f16(7.5 * d)], axis=-1)
        raw[..., 4:16] = [160] * 8 + [0] * 4
    elif kind == T.Q4_K:
        raw[..., 0:4] = np.concatenate([f16(d), f16(d)], axis=-1)
    elif kind == T.Q6_K:  # int8 sub-block scales x (q - 32): d small
        raw[..., 208:210] = f16(d / 500)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, smollm2_path) -> str:
    """A converted folder (config, tokenizer, tensor index) of a 2-layer llama GGUF."""
    folder = str(tmp_path_factory.mktemp("tiny-gguf"))
    path = os.path.join(folder, "tiny.gguf")
    config = quantizable_llama_config()
    config.dtype = torch.float32
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    tensors = {"token_embd.weight": (T.Q8_0, 49152, HIDDEN), "output_norm.weight": (T.F32, 1, HIDDEN)}
    kv = HIDDEN // 2
    for i, types in enumerate(LAYER_TYPES):
        shapes = {"attn_q": HIDDEN, "attn_k": kv, "attn_v": kv, "attn_output": HIDDEN}
        for name, kind in types.items():
            tensors[f"blk.{i}.{name}.weight"] = (kind, shapes[name], HIDDEN)
        tensors[f"blk.{i}.ffn_gate.weight"] = (MLP_TYPES[i]["ffn_gate"], INTER, HIDDEN)
        tensors[f"blk.{i}.ffn_up.weight"] = (MLP_TYPES[i]["ffn_up"], INTER, HIDDEN)
        tensors[f"blk.{i}.ffn_down.weight"] = (MLP_TYPES[i]["ffn_down"], HIDDEN, INTER)
        tensors[f"blk.{i}.attn_norm.weight"] = (T.F32, 1, HIDDEN)
        tensors[f"blk.{i}.ffn_norm.weight"] = (T.F32, 1, HIDDEN)
    for name, (kind, rows, cols) in tensors.items():
        if name.endswith("norm.weight"):
            writer.add_tensor(name, (1 + rng.normal(0, 0.1, cols)).astype(np.float32))
            continue
        data = random_tensor(rng, kind, rows, cols)
        writer.add_tensor(name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    load_tokenizer(smollm2_path).save_pretrained(folder)
    model_loader._index_gguf(path, config, folder)
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_gguf) -> dict[str, torch.Tensor]:
    """The file's weights dequantized by gguf-py (the float path: no float32 copy on disk)."""
    assert not model_loader._safetensors_files(tiny_gguf)
    return dict(load_weights(tiny_gguf))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_decode_to_what_gguf_py_dequantizes(kind):
    raw = random_tensor(np.random.default_rng(1), T[kind], 16, 512, model=False)
    codes, scale, minimum = decode_int4(raw, kind)
    assert codes.dtype == np.uint8 and codes.shape == (16, 512) and codes.max() <= 15
    w = (codes.reshape(16, -1, 32) * scale[..., None] + minimum[..., None]).reshape(16, 512)
    assert np.array_equal(w, dequantize(raw, T[kind]))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_5_to_8bit_blocks_decode_to_what_gguf_py_dequantizes(kind):
    raw = random_tensor(np.random.default_rng(2), T[kind], 16, 512, model=False)
    codes, scale, minimum = decode_int8g(raw, kind)
    group = 16 if kind == "Q6_K" else 32
    assert codes.dtype == np.int8 and codes.shape == (16, 512) and scale.shape == (16, 512 // group)
    assert (minimum is None) == (kind in ("Q8_0", "Q5_0", "Q6_K"))
    w = codes.reshape(16, -1, group) * scale[..., None]
    if minimum is not None:
        w = w + minimum[..., None]
    # float32 in both, in the same order: the same numbers
    assert np.array_equal(w.reshape(16, 512), dequantize(raw, T[kind]))


def _layer(runner, i: int, name: str):
    block = runner.model.layers[i]
    return getattr(block.self_attn if name in ("qkv_proj", "o_proj") else block.mlp, name)


def _ref(reference, i: int, *names: str) -> torch.Tensor:
    return torch.cat([reference[f"model.layers.{i}.{n}.weight"] for n in names])


def test_gguf_layers_compute_with_the_files_codes(tiny_gguf, reference):
    runner = Harness(tiny_gguf, quantization="gguf").runner
    # Q4_1 and Q4_0 / Q4_K pieces: int4 from the file's codes, exactly its weights (Q4_K's
    # sub-block scales d * sc are held as float16: within 2^-11 of them)
    o = _layer(runner, 0, "o_proj")
    assert isinstance(o, Int4Linear)
    assert torch.equal(o.dequantized(), _ref(reference, 0, "self_attn.o_proj"))
    gate_up = _layer(runner, 0, "gate_up_proj")
    assert isinstance(gate_up, Int4Linear)
    want = _ref(reference, 0, "mlp.gate_proj", "mlp.up_proj")
    sm = gate_up.scale_min.float().abs()  # [N, K/32, 2]: a float16 rounding of each is <= 2^-11 of it
    bound = ((15 * sm[..., 0] + sm[..., 1]) * 2**-11).repeat_interleave(32, dim=1)
    assert ((gate_up.dequantized() - want).abs() <= bound * 1.001).all()
    # the 5- to 8-bit types: int8 codes with float32 group scales, exactly the file's weights; q
    # (Q4_K), k (Q4_0) and v (Q6_K) fused: all int8g over Q6_K's groups of 16, exactly too
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    mlp = ("mlp.gate_proj", "mlp.up_proj")
    for i, name, hf, group in (
        (0, "qkv_proj", qkv, 16),  # Q4_K + Q4_0 + Q6_K
        (0, "down_proj", ("mlp.down_proj",), 32),  # Q8_0
        (1, "gate_up_proj", mlp, 32),  # Q5_K + Q5_1
        (1, "down_proj", ("mlp.down_proj",), 32),  # Q5_0
    ):
        layer = _layer(runner, i, name)
        assert isinstance(layer, GroupInt8Linear) and layer.group_size == group, (i, name)
        assert torch.equal(layer.dequantized(), _ref(reference, i, *hf)), (i, name)
    # float tensors stay float; the Q8_0 embedding makes the tied head the file's Q8_0 codes
    assert type(_layer(runner, 1, "qkv_proj")) is torch.nn.Linear
    head = runner.model.lm_head.packed
    assert isinstance(head, GroupInt8Linear)
    assert torch.equal(head.dequantized(), reference["model.embed_tokens.weight"])


def test_gguf_model_computes_what_the_dequantized_file_computes(tiny_gguf, reference):
    hf = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(tiny_gguf)).eval()
    hf.load_state_dict(reference, strict=False)  # (rotary buffers and the tied head are not in it)
    ids = load_tokenizer(tiny_gguf)("The quick brown fox jumps over the lazy dog, twice over.").input_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    h = Harness(tiny_gguf, quantization="gguf")
    got = h.step([(h.new_row(), ids)])[0]
    # int16 activations, Q4_K's float16 scales in Int4Linear, bfloat16 copies past 8 rows (where
    # the CPU has bfloat16 dot products)
    err = (got - want).abs().max() / (want.max() - want.min())
    assert err < 0.03, err


@pytest.mark.parametrize("rows", [1, 3])
def test_gguf_decode_steps_take_the_fused_op(tiny_gguf, rows):
    """A steady decode step runs the file's int4 and int8g layers and its Q8_0 head in one op
    (`decode_step`), with the very logits of the layer loop."""
    skip_without_fused_op("bfloat16", "gguf")
    got, fused_steps = decode_logits(tiny_gguf, True, rows, dtype="bfloat16", quantization="gguf")
    ref, _ = decode_logits(tiny_gguf, False, rows, dtype="bfloat16", quantization="gguf")
    assert fused_steps == len(got) - (2 if rows == 1 else 3), f"{fused_steps} of {len(got)} steps fused"
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_int4_reads_the_4bit_codes_and_quantizes_the_rest(tiny_gguf, reference):
    runner = Harness(tiny_gguf, quantization="int4").runner
    o = _layer(runner, 0, "o_proj")
    assert isinstance(o, Int4Linear) and torch.equal(o.dequantized(), _ref(reference, 0, "self_attn.o_proj"))
    # v is Q6_K: the fused layer is quantized to int4 from the dequantized weights, as any float one
    assert isinstance(_layer(runner, 0, "qkv_proj"), Int4Linear)
    assert isinstance(_layer(runner, 1, "qkv_proj"), Int4Linear)


def test_a_type_plait_does_not_read_is_refused_by_name(tiny_gguf):
    index = model_loader.gguf_index(tiny_gguf)
    index["tensors"][1] = {**index["tensors"][1], "type": "Q8_1"}
    with pytest.raises(ValueError, match=r"type Q8_1, which plait does not read; it reads .*Q4_K"):
        list(read_tensors(index, LlamaConfig.from_pretrained(tiny_gguf)))


def test_gguf_quantization_needs_a_gguf(tiny_model_dirs):
    with pytest.raises(ValueError, match="is not a GGUF; use int8 or int4"):
        Harness(tiny_model_dirs["llama"], quantization="gguf")


@pytest.mark.integration
def test_default_model_as_its_file(smollm2_path):
    """SmolLM2's Q4_1 projections are the file's codes (its float32 weights exactly), its Q8_0
    embedding's codes are the head's, and its logits are the float32 model's but for the kernels'
    int16 activations."""
    folder = model_loader.resolve_model("smollm2", float_weights=False)
    h = Harness(folder, quantization="gguf")
    runner = h.runner
    floats = dict(load_weights(smollm2_path))  # the float path's weights (safetensors)
    for i in (0, 29):
        layer = _layer(runner, i, "gate_up_proj")
        assert isinstance(layer, Int4Linear)
        want = torch.cat([floats[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(layer.dequantized(), want)
    head = runner.model.lm_head.packed
    assert isinstance(head, GroupInt8Linear) and torch.equal(head.dequantized(), floats["model.embed_tokens.weight"])
    ids = load_tokenizer(folder)("The capital of France is Paris, and the capital of Italy is").input_ids
    got = h.step([(h.new_row(), ids)])[0]
    del h, runner
    f = Harness(folder)
    want = f.step([(f.new_row(), ids)])[0]
    assert (got - want).abs().max() / (want.max() - want.min()) < 0.05
