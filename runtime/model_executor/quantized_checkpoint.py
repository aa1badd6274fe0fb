"""GPTQ and AWQ checkpoints, read from their `quantization_config` into the int4 path.

Both store a linear layer's weight as 4-bit codes `q` with, per group of `group_size` input
columns, a float16 scale `s` and a 4-bit zero `z`: `W[n, k] = s[g, n] * (q[n, k] - z[g, n])`, which
is `Int4Linear`'s form `q * scale + minimum` with `minimum = -s * z` (held as float16, as the
scale: exact for symmetric checkpoints, z = 8; within 2^-11 of s * z otherwise). A group of 64 or
128 is 2 or 4 of Int4Linear's groups of 32 with the same scale, so the codes go into the int4
kernels unchanged. The tensors of a layer `P` (safetensors):

- GPTQ (AutoGPTQ / GPTQModel / optimum): `P.qweight` int32 `[K/8, N]` (nibble t of row r: column
  k = 8r + t), `P.qzeros` int32 `[G, N/8]` (nibble t of column c: row n = 8c + t; the "gptq"
  checkpoint format stores z - 1, "gptq_v2" z), `P.scales` `[G, N]`, `P.g_idx` int32 `[K]` (the
  group of each input column). With act-order (`desc_act`) the groups are not runs of columns:
  the columns are then sorted by group and the layer permutes its input the same way
  (`QuantizedWeight.perm`); layers that share an input (q, k, v; gate, up) share that order.
- AWQ (AutoAWQ, "gemm" version): `P.qweight` int32 `[K, N/8]` and `P.qzeros` int32 `[G, N/8]`,
  the 8 nibbles of a word holding columns 0, 2, 4, 6, 1, 3, 5, 7 of its 8; `P.scales` `[G, N]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..layers.quantization import INT4_GROUP_SIZE, QuantizedWeight

SERVED = (
    "float checkpoints, GPTQ (4-bit, any group size a multiple of 32, act-order or not) and AWQ (4-bit, "
    "gemm) ones, and GGUF files"
)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column _AWQ_ORDER[i]
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}


def checkpoint_quantization(config) -> dict | None:
    """The checkpoint's quantization_config as plait reads it ({"method", "group_size", "v1_zeros"}),
    None for a float checkpoint; a ValueError naming what is not served."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = str(quant.get("quant_method") or "an unnamed method").lower()
    if method not in _PARTS:
        raise ValueError(f"the checkpoint is quantized with {method!r}; plait loads {SERVED}")
    if quant.get("bits", 4) != 4:
        raise ValueError(f"the {method} checkpoint has {quant.get('bits')}-bit weights; plait loads {SERVED}")
    if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"the AWQ checkpoint's version is {quant.get('version')!r}; plait loads {SERVED}")
    if method == "awq" and not quant.get("zero_point", True):
        raise ValueError(f"the AWQ checkpoint has no zero points; plait loads {SERVED}")
    group = int(quant.get("group_size", 128))
    if group != -1 and group % INT4_GROUP_SIZE:
        raise ValueError(f"the {method} checkpoint's group size is {group}; plait loads {SERVED}")
    v1 = method == "gptq" and str(quant.get("checkpoint_format", "gptq")).lower() == "gptq"
    return {"method": method, "group_size": group, "v1_zeros": v1}


def assemble(
    weights: Iterable[tuple[str, torch.Tensor]], quant: dict
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized layer's parts (held until all have come) made
    into one `P.weight` `QuantizedWeight`; other tensors pass through."""
    parts = _PARTS[quant["method"]]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in parts:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor
        if len(got) == len(parts):
            del pending[prefix]
            yield f"{prefix}.weight", _unpack(got, quant)
    if pending:
        prefix, got = next(iter(pending.items()))
        missing = sorted(set(parts) - set(got))
        raise ValueError(f"the {quant['method']} checkpoint's layer {prefix} lacks {', '.join(missing)}")


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (bits 4t..4t+3 as entry t), interleaved along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    n = ((packed.unsqueeze(-1) >> shifts) & 15).to(torch.uint8)  # [..., 8]
    if dim == 0:  # [R, C, 8] -> [R * 8, C]
        return n.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return n.reshape(packed.shape[0], -1)


def _unpack(t: dict[str, torch.Tensor], quant: dict) -> QuantizedWeight:
    scales = t["scales"].float()  # [G, N]
    if quant["method"] == "gptq":
        codes = _nibbles(t["qweight"], 0)  # [K, N]
        zeros = _nibbles(t["qzeros"], 1)[:, : scales.shape[1]].float() + (1 if quant["v1_zeros"] else 0)
        g_idx = t["g_idx"].long()
    else:
        order = torch.tensor(_AWQ_ORDER)
        codes = _nibbles(t["qweight"], 1).reshape(t["qweight"].shape[0], -1, 8)[..., order.argsort()]
        codes = codes.reshape(t["qweight"].shape[0], -1)  # [K, N]
        zeros = _nibbles(t["qzeros"], 1).reshape(scales.shape[0], -1, 8)[..., order.argsort()]
        zeros = zeros.reshape(scales.shape[0], -1)[:, : scales.shape[1]].float()
        g_idx = None
    k = codes.shape[0]
    group = k if quant["group_size"] == -1 else quant["group_size"]
    perm = None
    if g_idx is not None and not torch.equal(g_idx, torch.arange(k) // group):
        perm = torch.argsort(g_idx, stable=True)  # act-order: runs of columns per group
        codes, g_idx = codes[perm], g_idx[perm]
        if not torch.equal(g_idx, torch.arange(k) // group):
            raise ValueError(f"the {quant['method']} checkpoint's g_idx does not give groups of {group}")
    # per group of 32 columns: each checkpoint group's scale and -scale * zero
    sub = torch.arange(0, k, INT4_GROUP_SIZE) // group  # [K/32]: the checkpoint group of each
    scale = scales[sub].t().contiguous()  # [N, K/32]
    minimum = (-scales * zeros)[sub].t().contiguous()
    return QuantizedWeight("int4", codes.t().contiguous(), scale, minimum, quant["method"].upper(), perm)
