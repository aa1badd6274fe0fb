"""The Llama decoder family: Llama (SmolLM2), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Weights arrive with HF names and are mapped onto merged projections (qkv, gate_up) so each
layer runs two fewer matmuls; with tensor parallelism each rank keeps its shard of every piece
(see `parallel.py`). Attention goes through an `AttentionBackend`, which owns the KV pool.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..distributed.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_split,
    unwrap_single_rank,
)
from ..kernels.cpu import cpu_kernels
from ..layers.quantization import as_float
from ..model_executor.attention import AttentionBackend
from ..model_executor.forward_batch import ForwardBatch


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """RoPE settings across transformers versions (`rope_parameters` in 5.x, `rope_scaling` before);
    with `layer_type`, that type's own where the config keeps them per type (Gemma 3)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}  # Gemma 3, transformers 4.x
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if params["rope_type"] == "su":  # Phi-3's early name for longrope
        params["rope_type"] = "longrope"
    return params


def rope_cos_sin(
    config, head_dim: int, max_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[max_positions, rotary_dim]` in float32, as HF computes them (rotary_dim <
    head_dim under a `partial_rotary_factor`).

    longrope (Phi-3): HF picks the long factors for a whole forward when the sequence outgrows
    `original_max_position_embeddings`, the short ones otherwise, and recomputes the cache when a
    sequence crosses. A paged, prefix-shared cache cannot re-rotate keys already stored, so (as vLLM)
    the choice is fixed at load from the served context: long factors when `max_positions` exceeds
    the original length, short ones otherwise; the attention factor scales both."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        dim = int(head_dim * params["partial_rotary_factor"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        # llama3 / linear / yarn / longrope ...: reuse transformers' own definitions of the frequencies.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        seq_len = max_positions if params["rope_type"] == "longrope" else None
        per_type = {"layer_type": layer_type} if layer_type in (getattr(config, "rope_parameters", None) or {}) else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, seq_len=seq_len, **per_type)
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, H, D]`, cos/sin `[T, 1, R]`: rotate-half RoPE (HF layout) on the first R <= D dims."""
    rot = cos.shape[-1]
    part = x[..., :rot]
    half = rot // 2
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    out = part * cos + rotated * sin
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


# model types whose `sliding_window` applies to every layer (HF's masks for them)
SLIDING_WINDOW_TYPES = ("mistral", "phi3", "mixtral")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) with HF's rounding; with `residual_delta`, first `x += residual_delta` in
        place (x is the residual stream), fused into the same kernel."""
        if residual_delta is None:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        return cpu_kernels.add_rms_norm_(x, residual_delta, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them at tp_size 1); KV heads are replicated
    on several ranks when there are fewer of them than ranks."""

    # soft-capping / sliding window for the backend (Gemma): {} keeps the backend's fast paths
    mask_kwargs: dict = {}

    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        total_heads = config.num_attention_heads
        total_kv = config.num_key_value_heads or total_heads
        (q_first, self.num_heads), (kv_first, self.kv_heads) = head_split(total_heads, total_kv)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type in ("qwen2", "qwen2_moe")
        d = self.head_dim
        q_rows, kv_rows = (q_first * d, self.q_size), (kv_first * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [total_heads * d, total_kv * d, total_kv * d],
            bias=bias,
            shards=[q_rows, kv_rows, kv_rows],
        )
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size, shard=q_rows)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        # partial rotary (Phi-4-mini): only the first rotary_dim dims of each head turn
        self.rotary_dim = int(d * rope_parameters(config)["partial_rotary_factor"])
        self.eager_rope = self.qk_norm or self.rotary_dim != d
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """cos/sin: float32 `[T, head_dim]` at the tokens' positions."""
        qkv = self.qkv_proj(x)
        if self.eager_rope:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(-1, self.num_heads, self.head_dim)
            k = k.reshape(-1, self.kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
            q, k = apply_rope(q, c, s), apply_rope(k, c, s)
            v = v.reshape(-1, self.kv_heads, self.head_dim)
        else:  # q and k are adjacent in qkv (a fresh tensor): rotate both heads' sets in place
            cpu_kernels.rope_(qkv, cos, sin, self.num_heads + self.kv_heads, self.head_dim)
            heads = qkv.view(-1, self.num_heads + 2 * self.kv_heads, self.head_dim)
            q, k, v = heads[:, : self.num_heads], heads[:, self.num_heads : -self.kv_heads], heads[:, -self.kv_heads :]
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch, self.scale, **self.mask_kwargs))


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], name="intermediate_size")
        self.down_proj = RowParallelLinear(inter, config.hidden_size, shard=self.gate_up_proj.pieces[0][:2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu_kernels.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        """The layer's MLP (a mixture of experts in the MoE models' sparse layers)."""
        return MLP(config)

    def forward(self, x, delta, cos, sin, batch, backend):
        """The residual stream `x` takes the previous layer's output `delta` in place (fused into
        the norm); returns (x, this layer's output), added by the next norm."""
        h = self.input_layernorm(x, delta)
        h = self.post_attention_layernorm(x, self.self_attn(h, cos, sin, batch, backend))
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over the paged KV pool. `forward` returns logits at `batch.logits_index`
    (on rank 0; None on the other tensor-parallel ranks)."""

    layer_class: type = DecoderLayer
    norm_class: type = RMSNorm

    def __init__(self, config, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tied=self.embed_tokens if self.tie_word_embeddings else None
        )
        head_dim = self.layers[0].self_attn.head_dim
        window = getattr(config, "sliding_window", None) if config.model_type in SLIDING_WINDOW_TYPES else None
        if window and window < (max_positions or config.max_position_embeddings):
            # every layer sees the last `window` keys (Mistral v0.1, Phi-3 mini 4k): the backend's
            # masked eager path; below the context length the window changes nothing
            for layer in self.layers:
                layer.self_attn.mask_kwargs = {"window": window}
        cos, sin = self._rope_tables(config, head_dim, max_positions or config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._decode_plans: dict[tuple[int, torch.dtype], tuple | None] = {}
        self._decode_handles: dict[tuple[int, torch.dtype], tuple] = {}  # (blocks' key, DecodePlan)

    def _rope_tables(self, config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `rope_cos` / `rope_sin` buffers: `[max_positions, rotary_dim]` here."""
        return rope_cos_sin(config, head_dim, max_positions)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor | None:
        fused = None if batch.keep_hidden else self._begin_fused_decode(batch, backend)
        if fused is not None and fused[2] and batch.logits_all:  # token ids to logits in one op
            return cpu_kernels.ops.decode_step(batch.input_ids, batch.positions, fused[0], *fused[1])
        x, delta = self._embed(batch.input_ids), None
        # (tables `[types, positions, dim]` index positions on their second axis)
        pos = batch.positions if self.rope_cos.dim() == 2 else (slice(None), batch.positions)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        if fused is not None:
            delta = cpu_kernels.ops.decode_layers_(x, fused[0], cos, sin, *fused[1])
        else:
            for layer in self.layers:
                x, delta = layer(x, delta, cos, sin, batch, backend)
        if batch.logits_all:  # every row's logits (decode): no gather of 2 x [rows, hidden]
            hidden = self.norm(x, delta)
        else:
            idx = batch.logits_index
            hidden = self.norm(x.index_select(0, idx), delta.index_select(0, idx))
        if batch.keep_hidden:
            self.last_hidden = hidden  # read right after this step by the scheduler (embeddings)
        return self._head(hidden)

    def _begin_fused_decode(self, batch: ForwardBatch, backend: AttentionBackend) -> tuple | None:
        """A steady decode step runs its layers in one `cpu_kernels.decode_layers_` call (the kernels
        the layer loop would run, in its order, without ~10 Python module calls a layer between them:
        the same results, a shorter step), and where the LM head's kernel is
        one of the op's, from token ids to logits in one `decode_step` call. Returns (the op's
        `DecodePlan`, this step's tensors, whether the plan has the step's ends), the step begun;
        None where the layer loop must run (prefill, drafts, a mirror row refilled, a projection
        whose kernel is not one of the op's), the step then begun or not as the loop expects."""
        begin = getattr(backend, "begin_fused_decode", None)
        embed = self.embed_tokens.weight
        if begin is None or not cpu_kernels.enabled(embed) or torch.compiler.is_compiling():
            return None
        key = (batch.input_ids.shape[0], embed.dtype)
        if key not in self._decode_plans:
            self._decode_plans[key] = self._decode_plan(*key)
        plan = self._decode_plans[key]
        state = begin(batch) if plan is not None else None
        if state is None:
            return None
        blocks, (pool_k, pool_v, mirror_k, mirror_v), per_step = state
        held = self._decode_handles.get(key)
        if held is None or held[0] != blocks:  # the op's fixed arguments, held in C++ across steps
            # (a handle of replaced blocks would keep their memory: all such go, of every row count)
            self._decode_handles = {k: h for k, h in self._decode_handles.items() if h[0] == blocks}
            held = self._decode_handles[key] = (blocks, *self._make_decode_handle(key, plan, state[1]))
        return held[1], per_step, held[2]

    def _make_decode_handle(self, key: tuple[int, torch.dtype], plan: tuple, blocks: tuple) -> tuple:
        """(a `DecodePlan` of `plan`'s weights and the backend's `blocks`, whether it has the ends)."""
        attn = self.layers[0].self_attn
        handle = cpu_kernels.plan_class()(
            plan[0],
            plan[1],
            *blocks,
            attn.num_heads,
            attn.kv_heads,
            attn.head_dim,
            self.layers[0].input_layernorm.eps,
            attn.scale,
        )
        head = self.lm_head.decode_kernel(*key)
        embed = self.embed_tokens.weight
        ends = (
            head is not None
            and self.norm.weight.dtype == key[1]
            and embed.is_contiguous()
            and embed.shape[0] == self.config.vocab_size
        )
        if ends:
            kind, a, b, n = head
            handle.set_ends(
                embed,
                self.rope_cos,
                self.rope_sin,
                self.norm.weight,
                self.norm.eps,
                kind,
                n,
                a,
                torch.empty(0) if b is None else b,
            )
        return handle, ends

    def forget_decode_plans(self) -> None:
        """Drop the cached `decode_layers_` plans (they hold the projections' tensors): call after
        replacing projections."""
        self._decode_plans.clear()
        self._decode_handles.clear()

    def _decode_plan(self, rows: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | None:
        """`decode_layers_`'s weights and kinds for `rows` rows of `dtype`, or None where a layer
        has a piece the op does not run."""
        empty = torch.empty(0)
        weights, kinds = [], []
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer) or type(layer.mlp) is not MLP:
                return None  # the op runs Llama's layer (not Gemma's norms, GeGLU or experts)
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if attn.eager_rope or attn.mask_kwargs or any(w.dtype != dtype for w in norms):
                return None  # (nor eager RoPE or masked attention)
            specs = []
            for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                spec = proj.decode_kernel(rows, dtype) if hasattr(proj, "decode_kernel") else None
                if spec is None:
                    return None
                specs.append(spec)
            (qkv, o, gu, down) = [(a, empty if b is None else b) for _, a, b, _ in specs]
            weights += [norms[0], *qkv, *o, norms[1], *gu, *down]
            kinds += [v for kind, _, _, n in specs for v in (kind, n)]
        return weights, kinds

    def prepack_for_cpu(self) -> bool:
        """Reorder every projection (and the LM head, also when tied) for oneDNN; CPU only."""
        from ..layers.prepack import prepack_available, prepack_linears

        if not prepack_available() or self.embed_tokens.weight.device.type != "cpu":
            return False
        self.forget_decode_plans()
        self.lm_head.prepack()
        prepack_linears(self)
        return True

    # --- weights -------------------------------------------------------------------------------
    _STACKED = (  # (our module, HF module, piece)
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (each rank keeps its shard); every parameter must be filled
        exactly once."""
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            module_name, _, param = name.rpartition(".")
            piece = 0
            for ours, theirs, shard in self._STACKED:
                if module_name.endswith("." + theirs):
                    module_name, piece = module_name[: -len(theirs)] + ours, shard
                    break
            module = modules.get(module_name)
            if hasattr(module, "load_weight"):  # a parallel layer: it picks this rank's shard
                module.load_weight(param, tensor, piece)
                filled.add(f"{module_name}.{param}#{piece}")
            elif name in params:
                params[name].data.copy_(as_float(tensor))
                filled.add(name)
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
        missing = [n for n in self._expected_fills() if n not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        self.forget_decode_plans()
        unwrap_single_rank(self)  # tp_size 1: plain nn.Linear projections, no wrappers in the hot path

    def _expected_fills(self) -> list[str]:
        out, owned = [], []
        for name, module in self.named_modules():
            if hasattr(module, "weight_keys"):
                out += [f"{name}.{key}" for key in module.weight_keys()]
                owned.append(name + ".")
        out += [n for n, _ in self.named_parameters() if not n.startswith(tuple(owned))]
        return out
