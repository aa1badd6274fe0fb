"""GGUF tensors as the file stores them.

A GGUF's first resolution (model_loader) writes the model's config and tokenizer into a cache
folder, with `gguf_index.json`: where each tensor lies in the file, its ggml type and shape, and
the GGUF -> Hugging Face name map. `read_tensors` then memory-maps the file and yields HF-named
tensors, with transformers' per-architecture tensor processors (the llama Q/K un-permute):

- float tensors (F32, F16, BF16) and, unless kept quantized, every quantized type dequantized to
  float32 (gguf-py's dequantizers: the float path, and the safetensors conversion a Hugging Face
  folder needs);
- with `keep` = "int4" or "gguf", 2-D tensors of the 4-bit types Q4_0, Q4_1 and Q4_K as
  `QuantizedWeight` int4 codes with a scale and minimum per 32 values, the form `Int4Linear`
  computes with: Q4_0 `(q - 8) * d`, Q4_1 `q * d + m` and Q4_K `q * (d * sc) - dmin * m` per
  32-value sub-block, so no float weight is made (Q4_0 and Q4_1 exactly; Q4_K's sub-block scale
  `d * sc` rounds to float16 in the kernel, a relative 2^-11 of it);
- with `keep` = "gguf", 2-D tensors of the 5- to 8-bit types as `QuantizedWeight` int8g codes with a
  float32 scale (and minimum) per group, the form `GroupInt8Linear` computes with, exactly: Q8_0
  `q * d` and Q5_0 `(q - 16) * d` per 32, Q5_1 `q * d + m` per 32, Q5_K `q * (d * sc) - dmin * m`
  per 32, Q6_K `(q - 32) * (d * sc)` per 16; the rarer 2- and 3-bit and IQ types as int8 codes with
  a scale per row (re-rounded from the file's blocks).

A type gguf-py cannot dequantize is refused, naming it and the types plait reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported where tensors are read
    import torch

    from ..layers.quantization import QuantizedWeight

INDEX_FILE = "gguf_index.json"
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_INT8G_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")


def served_types() -> list[str]:
    """The ggml tensor types plait reads."""
    from gguf.quants import _type_traits

    return sorted({*_FLOAT_TYPES, *(t.name for t in _type_traits)})


def write_index(reader, gguf_path: str, name_map: dict[str, str], architecture: str, out_dir: str) -> None:
    """Record `reader`'s tensors (offsets, types, shapes) and the name map in `out_dir`."""
    tensors = [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "shape": [int(d) for d in t.data.shape],  # rows first; quantized: bytes per row last
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    index = {"gguf": gguf_path, "architecture": architecture, "name_map": name_map, "tensors": tensors}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f)


def gguf_index(folder: str) -> dict | None:
    """The folder's GGUF index, or None for a folder that did not come from a GGUF."""
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_tensors(index: dict, config, keep: str | None = None) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield `(hf_name, tensor)` for every GGUF tensor the model has; `keep` ("int4" | "gguf" |
    None) selects which quantized tensors stay quantized (see the module docstring)."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from ..layers.quantization import QuantizedWeight, quantize_int8

    config_dict = config.to_dict()
    processor = TENSOR_PROCESSORS.get(index["architecture"], TensorProcessor)(config=config_dict)
    parsed: dict = {"config": config_dict, "tensors": {}}
    name_map = index["name_map"]
    served = served_types()
    data = np.memmap(index["gguf"], dtype=np.uint8, mode="r")

    def process(arr: np.ndarray, name: str) -> tuple[np.ndarray, str]:
        out = processor.process(weights=arr, name=name, tensor_key_mapping=name_map, parsed_parameters=parsed)
        return out.weights, out.name

    for t in index["tensors"]:
        kind = t["type"]
        if kind not in served:
            raise ValueError(f"GGUF tensor {t['name']} has type {kind}, which plait does not read; it reads {served}")
        raw = data[t["offset"] : t["offset"] + t["nbytes"]]
        raw = raw.view(_FLOAT_TYPES[kind]).reshape(t["shape"]) if kind in _FLOAT_TYPES else raw.reshape(t["shape"])
        two_d = len(t["shape"]) == 2
        as_codes = "int4" if kind in _INT4_TYPES else "int8g" if kind in _INT8G_TYPES and keep == "gguf" else None
        if keep and two_d and as_codes:
            decoded = decode_int4(raw, kind) if as_codes == "int4" else decode_int8g(raw, kind)
            parts = [process(a, t["name"]) for a in decoded if a is not None]
            name = parts[0][1]
            if name in name_map:
                codes, scale, *minimum = (torch.from_numpy(np.ascontiguousarray(a)) for a, _ in parts)
                yield name_map[name], QuantizedWeight(as_codes, codes, scale, *minimum, source=f"GGUF {kind}")
            continue
        if kind in _FLOAT_TYPES:
            arr = (raw.astype(np.uint32) << 16).view(np.float32) if kind == "BF16" else raw.astype(np.float32)
        else:
            arr = dequantize(raw, GGMLQuantizationType[kind])
        weights, name = process(arr, t["name"])
        if name not in name_map:
            continue  # e.g. rope_freqs: recomputed by the model, not a parameter
        w = torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))
        if keep == "gguf" and two_d and kind not in _FLOAT_TYPES:
            yield name_map[name], QuantizedWeight("int8", *quantize_int8(w), source=f"GGUF {kind}")
        else:
            yield name_map[name], w
    # processors that merge tensors (MoE experts) leave their results here
    for name, tensor in parsed["tensors"].items():
        yield name, torch.as_tensor(tensor).to(torch.float32).contiguous()


def decode_int4(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit GGUF tensor's rows `[N, bytes]` -> codes uint8 `[N, K]` (0..15) and float32 scale and
    minimum `[N, K / 32]`: `W = codes * scale + minimum` per group of 32."""
    n = raw.shape[0]
    if kind == "Q4_K":
        return _decode_q4_k(raw)
    block = 18 if kind == "Q4_0" else 20
    b = _blocks(raw, block)
    d = _f16(b[..., 0:2])[..., 0]
    minimum = -8.0 * d if kind == "Q4_0" else _f16(b[..., 2:4])[..., 0]
    qs = b[..., block - 16 :]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # element j < 16 low nibble, j >= 16 high
    return codes.reshape(n, -1), d, minimum


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    """A tensor's rows `[N, bytes]` as `[N, blocks, size]`."""
    return np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields `[..., 2]` (uint8) as float32 `[..., 1]`."""
    return b.copy().view(np.float16).astype(np.float32)


def _k_scale_min(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's super-block header: (d, dmin `[n, nb, 1]` float32, sc, m `[n, nb, 8]`): 8 six-bit
    sub-block scales and minimums packed in 12 bytes."""
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return _f16(b[..., 0:2]), _f16(b[..., 2:4]), sc.astype(np.float32), mn.astype(np.float32)


def _decode_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: super-blocks of 256 (d, dmin float16; 8 six-bit sub-block scales and minimums packed in
    12 bytes; 128 bytes of codes, each 64 values' bytes holding sub-block 2i low, 2i+1 high)."""
    n = raw.shape[0]
    b = _blocks(raw, 144)
    d, dmin, sc, mn = _k_scale_min(b)
    qs = b[..., 16:].reshape(n, -1, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [n, nb, 4 chunks, 2 halves, 32]
    return codes.reshape(n, -1), (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1)


def decode_int8g(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 5- to 8-bit GGUF tensor's rows `[N, bytes]` -> int8 codes `[N, K]` and float32 scale and
    minimum (None: zeros) `[N, K / G]`, `W = codes * scale + minimum` per group of G (16 for Q6_K,
    else 32). Each scale is the file's fp16 (times its 6- or 8-bit sub-block scale), exact in float32."""
    n = raw.shape[0]
    if kind == "Q8_0":
        b = _blocks(raw, 34)
        return b[..., 2:].copy().view(np.int8).reshape(n, -1), _f16(b[..., 0:2]).reshape(n, -1), None
    if kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4  # d (and m)
        b = _blocks(raw, head + 20)
        qh = b[..., head : head + 4].copy().view(np.uint32)  # bit j: value j's fifth bit
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = b[..., head + 4 :]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)  # value j < 16 low nibble, >= 16 high
        d = _f16(b[..., 0:2])
        if kind == "Q5_0":
            return (codes.astype(np.int8) - 16).reshape(n, -1), d.reshape(n, -1), None
        return codes.astype(np.int8).reshape(n, -1), d.reshape(n, -1), _f16(b[..., 2:4]).reshape(n, -1)
    if kind == "Q5_K":
        b = _blocks(raw, 176)
        d, dmin, sc, mn = _k_scale_min(b)
        qh = b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]  # [n, nb, 8 sub-blocks, 32]
        qs = b[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]  # [.., 4, 2, 32]
        codes = (qs.reshape(n, -1, 8, 32) & 15) | ((qh & 1) << 4)
        return codes.astype(np.int8).reshape(n, -1), (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1)
    if kind == "Q6_K":
        b = _blocks(raw, 210)
        ql = b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]  # [.., 2, 2, 64]
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
        codes = (ql.reshape(n, -1, 8, 32) & 15) | ((qh.reshape(n, -1, 8, 32) & 3) << 4)
        scale = _f16(b[..., 208:210]) * b[..., 192:208].copy().view(np.int8).astype(np.float32)
        return (codes.astype(np.int8) - 32).reshape(n, -1), scale.reshape(n, -1), None
    raise ValueError(f"decode_int8g: {kind} is not one of {', '.join(_INT8G_TYPES)}")
