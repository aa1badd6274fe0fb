"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral, the Llama / Qwen decoder with a
top-k routed MLP in its sparse layers.

Each sparse layer's experts are plain linears per expert (so --quantization int8 / int4 and CPU
prepacking take them as any projection) and a step runs only the experts its tokens chose: tokens
are sorted by expert, and each chosen expert multiplies its own rows once (decode at batch 1 reads
k of E experts). Tensor parallelism splits every
expert's intermediate features across the ranks, as the dense MLP's are split, and sums the partial
outputs with one all-reduce. Checkpoints come per expert (`experts.{e}.gate_proj`, hub files) or
stacked (`experts.gate_up_proj`, as transformers 5 saves them); Mixtral's `block_sparse_moe` /
`w1 w3 w2` names are the same tensors under other names.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.parallel import all_reduce, balanced_split, tp_size
from ..layers.quantization import as_float
from .llama import MLP, DecoderLayer, LlamaForCausalLM

# Mixtral's names -> Qwen's
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class Experts(nn.Module):
    """E SwiGLU experts, each a pair of plain linears (`gate_up[e]`: [gate; up] rows, `down[e]`), so
    that --quantization and CPU prepacking treat every expert as any other projection; this rank
    holds its share of each expert's intermediate features."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.first, self.inter = balanced_split(inter, "moe_intermediate_size")
        self.gate_up = nn.ModuleList(nn.Linear(hidden, 2 * self.inter, bias=False) for _ in range(num_experts))
        self.down = nn.ModuleList(nn.Linear(self.inter, hidden, bias=False) for _ in range(num_experts))
        self.filled: set[tuple[int, str]] = set()

    def load_expert(self, e: int, which: str, w: torch.Tensor) -> None:
        """One expert's HF tensor (`gate_proj` / `up_proj` [I, H], `down_proj` [H, I]): this rank's part."""
        a, n = self.first, self.inter
        if which == "down_proj":
            self.down[e].weight.data.copy_(w[:, a : a + n])
        else:
            rows = slice(0, n) if which == "gate_proj" else slice(n, 2 * n)
            self.gate_up[e].weight.data[rows].copy_(w[a : a + n])
        self.filled.add((e, which))

    def load_stacked(self, which: str, w: torch.Tensor) -> None:
        """transformers' stacked tensors: `gate_up_proj` [E, 2I, H] ([gate; up] rows), `down_proj` [E, H, I]."""
        for e in range(w.shape[0]):
            if which == "down_proj":
                self.load_expert(e, "down_proj", w[e])
            else:
                gate, up = w[e].chunk(2, dim=0)
                self.load_expert(e, "gate_proj", gate)
                self.load_expert(e, "up_proj", up)

    def missing(self) -> list[tuple[int, str]]:
        want = {(e, w) for e in range(len(self.down)) for w in ("gate_proj", "up_proj", "down_proj")}
        return sorted(want - self.filled)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of weight * expert(x) (this rank's partial sum)."""
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        token_of = order // k
        weight_of = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows = token_of[start : start + c]
            gate, up = self.gate_up[e](x.index_select(0, rows)).chunk(2, dim=-1)
            y = self.down[e](F.silu(gate) * up)
            out.index_add_(0, rows, y * weight_of[start : start + c])
            start += c
        return out


class RouterLinear(nn.Linear):
    """The router's projection: kept in the model's dtype (not a plain `nn.Linear` to --quantization,
    which would move tokens between experts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """The router (replicated on every rank), its experts and, for Qwen2-MoE, a gated shared expert."""

    def __init__(self, config):
        super().__init__()
        num = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        # Mixtral softmaxes the top-k logits: the top-k probabilities renormalized
        self.renormalize = bool(getattr(config, "norm_topk_prob", config.model_type == "mixtral"))
        self.gate = RouterLinear(config.hidden_size, num, bias=False)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.experts = Experts(num, config.hidden_size, inter)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = MLP(config, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights.to(x.dtype), chosen)
        if tp_size() > 1:
            all_reduce(out)
        if self.shared_expert is not None:  # (its down projection does its own all-reduce)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is sparse where the config says (every `decoder_sparse_step`-th
    layer, not in `mlp_only_layers`)."""

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        if layer_id not in (getattr(config, "mlp_only_layers", None) or []) and (layer_id + 1) % step == 0:
            return SparseMoE(config)
        return MLP(config)


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE / Qwen2-MoE / Mixtral. Decode steps run the layer loop (`_decode_plan`: the fused
    decode op knows dense MLPs only)."""

    layer_class = MoEDecoderLayer
    data_dependent_step = True  # which experts run depends on the batch (no CUDA graph)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors; expert tensors (per expert or stacked) go to their `Experts`."""
        experts = {name: m for name, m in self.named_modules() if isinstance(m, Experts)}

        def dense(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                for theirs, ours in _MIXTRAL_NAMES:
                    name = name.replace(theirs, ours)
                short = name.removeprefix("model.")
                if m := _PER_EXPERT.match(short):
                    experts[m[1]].load_expert(int(m[2]), m[3], as_float(tensor))
                elif m := _STACKED_EXPERTS.match(short):
                    experts[m[1]].load_stacked(m[2], as_float(tensor))
                else:
                    yield name, tensor

        super().load_weights(dense(weights))
        for name, module in experts.items():
            if module.missing():
                raise ValueError(f"checkpoint is missing expert weights of {name}: {module.missing()[:5]}")

    def _expected_fills(self) -> list[str]:
        return [n for n in super()._expected_fills() if ".experts." not in n]
