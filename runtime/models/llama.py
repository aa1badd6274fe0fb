"""The Llama decoder family: Llama (SmolLM2), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Weights arrive with HF names and are mapped onto merged projections (qkv, gate_up) so each
layer runs two fewer matmuls. Attention goes through an `AttentionBackend`, which owns the KV pool.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..forward_batch import ForwardBatch


def rope_parameters(config) -> dict:
    """RoPE settings across transformers versions (`rope_parameters` in 5.x, `rope_scaling` before)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def rope_cos_sin(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[max_positions, head_dim]` in float32, as HF computes them."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        # llama3 / linear / yarn ...: reuse transformers' own definitions of the frequencies.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, H, D]`, cos/sin `[T, 1, D]`: rotate-half RoPE (HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(backend.forward(q, k, v.contiguous(), self.layer_id, batch, self.scale))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over the paged KV pool. `forward` returns logits at `batch.logits_index`."""

    def __init__(self, config, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head = None
        head_dim = self.layers[0].self_attn.head_dim
        cos, sin = rope_cos_sin(config, head_dim, max_positions or config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos = self.rope_cos[batch.positions].to(x.dtype)[:, None, :]
        sin = self.rope_sin[batch.positions].to(x.dtype)[:, None, :]
        for layer in self.layers:
            x = layer(x, cos, sin, batch, backend)
        x = self.norm(x.index_select(0, batch.logits_index))
        if self.packed_lm_head is not None:
            return self.packed_lm_head(x).float()
        return F.linear(x, self.lm_head_weight()).float()

    def prepack_for_cpu(self) -> bool:
        """Reorder every projection (and the LM head, also when tied) for oneDNN; CPU only."""
        from ..prepack import PackedLinear, prepack_available, prepack_linears
        if not prepack_available() or self.embed_tokens.weight.device.type != "cpu":
            return False
        self.packed_lm_head = PackedLinear(self.lm_head_weight(), None)
        if not self.tie_word_embeddings:
            del self.lm_head
        prepack_linears(self)
        return True

    # --- weights -------------------------------------------------------------------------------
    _STACKED = (  # (our param, HF name piece, shard index)
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for ours, theirs, shard in self._STACKED:
                if f".{theirs}." in name:
                    target = name.replace(theirs, ours)
                    param = params[target]
                    start, size = self._shard_range(ours, shard, param.shape[0])
                    param.data[start:start + size].copy_(tensor)
                    filled.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                params[name].data.copy_(tensor)
                filled.add(name)
        missing = [n for n in self._expected_fills(params) if n not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _shard_range(self, ours: str, shard: int, total: int) -> tuple[int, int]:
        if ours == "gate_up_proj":
            size = total // 2
            return shard * size, size
        attn = self.layers[0].self_attn
        sizes = (attn.q_size, attn.kv_size, attn.kv_size)
        return sum(sizes[:shard]), sizes[shard]

    def _expected_fills(self, params: dict) -> list[str]:
        out = []
        for name in params:
            if ".qkv_proj." in name:
                out += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                out += [f"{name}#{i}" for i in range(2)]
            else:
                out.append(name)
        return out
