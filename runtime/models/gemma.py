"""Gemma 2 and Gemma 3 text decoders (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`) on llama.py's parts.

What differs from Llama: embeddings scaled by sqrt(hidden); RMSNorms that scale by (1 + weight)
(folded into the weight at load, so the same norm kernels run); GeGLU (tanh-approximated GELU);
a norm after attention and another around the MLP; attention scaled by query_pre_attn_scalar^-0.5;
layers alternating between a sliding window and the whole context (`config.layer_types`), each
type with its own RoPE table (Gemma 3: base 10k for local layers); Gemma 2's attention-logit
soft-capping; final-logit soft-capping; Gemma 3's q/k norms. Soft-capped or windowed layers take the
attention backend's eager fallback (see attention.py); the fused one-op decode step is not used.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from .llama import MLP, Attention, LlamaForCausalLM, RMSNorm, rope_cos_sin


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight): `GemmaForCausalLM.load_weights` adds the 1 once."""


def layer_types(config) -> list[str]:
    """Each layer's attention type ("sliding_attention" / "full_attention")."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or 2  # Gemma 2: every other layer
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


class GemmaAttention(Attention):
    def __init__(self, config, layer_id: int):
        super().__init__(config, layer_id)
        self.scale = config.query_pre_attn_scalar**-0.5
        types = layer_types(config)
        self.rope_index = sorted(set(types)).index(types[layer_id])
        window = config.sliding_window if types[layer_id] == "sliding_attention" else None
        softcap = getattr(config, "attn_logit_softcapping", None)
        self.mask_kwargs = {k: v for k, v in (("softcap", softcap), ("window", window)) if v is not None}
        if config.model_type == "gemma3_text":
            self.qk_norm = self.eager_rope = True
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_id)
        self.mlp = GemmaMLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, delta, cos, sin, batch, backend):
        """As llama.DecoderLayer (the residual `x` takes `delta` in place); cos/sin hold every
        layer type's table, `[types, T, dim]`."""
        i = self.self_attn.rope_index
        h = self.input_layernorm(x, delta)
        h = self.pre_feedforward_layernorm(
            x, self.post_attention_layernorm(self.self_attn(h, cos[i], sin[i], batch, backend))
        )
        return x, self.post_feedforward_layernorm(self.mlp(h))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text) over the paged KV pool."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def _rope_tables(self, config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[types, max_positions, head_dim]`: one table per layer type, in sorted type order."""
        tables = [rope_cos_sin(config, head_dim, max_positions, t) for t in sorted(set(layer_types(config)))]
        return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if logits is None or cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As Llama's, then the norms' weights become (1 + weight)."""
        super().load_weights(weights)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.weight.add_(1.0)
