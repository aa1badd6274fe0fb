"""CPU weight prepacking: linear layers run through oneDNN with weights reordered once at load.

On this class of CPU a prepacked oneDNN matmul is 1.3-2.3x faster than `F.linear` (MKL) for the
small-M shapes of decoding (measured for M=8..256, K=576, float32 and bfloat16), the same trick
torch.compile's freezing pass uses. Only the CPU path; GPUs keep `nn.Linear`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def prepack_available() -> bool:
    """True when this torch build has oneDNN and its prepacked linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().clone()
        # Batch-1 decode only streams the weight, and oneDNN's (and MKL's) float32 GEMV runs on one
        # core: there the plain weight viewed as [2, N/2, K] goes through bmm, whose two halves run
        # on two cores (SmolLM2's 121 matrices, 2 threads, quiet: 30.7 vs 37.5 ms; a whole batch-1
        # step 46 -> 38 ms). Not from 2 rows (slower in whole steps), nor in bfloat16 (2x slower).
        # Costs a second copy of the weight.
        self.halves = None
        if weight.dtype == torch.float32 and self.out_features % 2 == 0 and torch.get_num_threads() > 1:
            self.halves = weight.detach().contiguous().view(2, self.out_features // 2, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2   # the model's case: no reshapes (at batch 1 every op here costs)
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        if self.halves is not None and x2.shape[0] == 1 and x2.is_contiguous():
            # [2, N/2, K] @ [2, K, 1] -> [2, N/2, 1], which is the [1, N] row as it lies
            # (x as [K, 1] with strides (1, K): the layout bmm's fast path takes)
            y = torch.bmm(self.halves, x2.t().unsqueeze(0).expand(2, -1, -1)).view(1, self.out_features)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a CPU model by a PackedLinear; returns how many were replaced."""
    if not prepack_available():
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        if mod.weight.device.type != "cpu":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight, mod.bias))
    return len(targets)


def packed_or_linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedLinear | None) -> torch.Tensor:
    """`F.linear(x, weight)`, through `packed` when the weight was prepacked."""
    return packed(x) if packed is not None else F.linear(x, weight)
