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
- with `keep` = "gguf", 2-D tensors of the other quantized types (Q8_0, Q5_K, Q6_K, ...) as int8
  codes with a scale per row (re-rounded from the file's blocks: no int5 / int6 kernel).

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
        if keep and two_d and kind in _INT4_TYPES:
            codes, scale, minimum = decode_int4(raw, kind)
            parts = [process(a, t["name"]) for a in (codes, scale, minimum)]
            name = parts[0][1]
            if name in name_map:
                codes, scale, minimum = (torch.from_numpy(np.ascontiguousarray(a)) for a, _ in parts)
                yield name_map[name], QuantizedWeight("int4", codes, scale, minimum, f"GGUF {kind}")
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
    b = np.ascontiguousarray(raw).reshape(n, -1, block)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":
        minimum = -8.0 * d
    else:
        minimum = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., block - 16 :]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # element j < 16 low nibble, j >= 16 high
    return codes.reshape(n, -1), d, minimum


def _decode_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: super-blocks of 256 (d, dmin float16; 8 six-bit sub-block scales and minimums packed in
    12 bytes; 128 bytes of codes, each 64 values' bytes holding sub-block 2i low, 2i+1 high)."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, 144)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, nb, 1]
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(n, -1, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [n, nb, 4 chunks, 2 halves, 32]
    scale = d * sc.astype(np.float32)
    minimum = -dmin * mn.astype(np.float32)
    return codes.reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1)
