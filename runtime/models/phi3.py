"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): the Llama decoder with fused checkpoint tensors.

HF stores `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up] rows) fused; they are split
into their pieces at load so that each tensor-parallel rank keeps its rows of each piece, as for
Llama. longrope ("su") scaling and a partial rotary factor are handled by `rope_cos_sin` /
`Attention` in llama.py (see `rope_cos_sin` for how short and long factors are chosen), and a
sliding window shorter than the context (Phi-3 mini 4k) by `LlamaForCausalLM`.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family decoder; weights as `LlamaForCausalLM`'s once the fused tensors are split."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors, the fused `qkv_proj` / `gate_up_proj` split into Llama's pieces."""
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        config = self.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        q, kv = heads * head_dim, (config.num_key_value_heads or heads) * head_dim
        inter = config.intermediate_size
        for name, tensor in weights:
            prefix, _, param = name.rpartition(".")
            if prefix.endswith(".qkv_proj"):
                base = prefix.removesuffix("qkv_proj")
                yield from zip((f"{base}{p}_proj.{param}" for p in "qkv"), tensor.split([q, kv, kv]))
            elif prefix.endswith(".gate_up_proj"):
                base = prefix.removesuffix("gate_up_proj")
                yield from zip((f"{base}{p}_proj.{param}" for p in ("gate", "up")), tensor.split([inter, inter]))
            else:
                yield name, tensor
