"""CPU weight prepacking: linear layers run through oneDNN with weights reordered once at load.

On this class of CPU a prepacked oneDNN matmul is 1.3-2.3x faster than `F.linear` (MKL) for the
small-M shapes of decoding (measured for M=8..256, K=576, float32 and bfloat16), the same trick
torch.compile's freezing pass uses. Decode's few rows (`GEMV_MAX_ROWS`) only stream the weight,
which oneDNN does on one core: those go through `cpu_kernels.gemv` on the plain weight instead. Only the CPU path; GPUs
keep `nn.Linear`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

logger = logging.getLogger(__name__)


def prepack_available() -> bool:
    """True when this torch build has oneDNN and its prepacked linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# Up to this many rows (decode's batch sizes) `cpu_kernels.gemv` streams the plain weight; above,
# oneDNN's prepacked GEMM. Whole SmolLM2 decode steps, arms alternating in one process (2 threads,
# load 0.9-1.5), ms gemv vs oneDNN: float32 batch 1 15.5 vs 17.4, 2 15.7 vs 18.1, 3 18.0 vs 19.6,
# 4 17.9 vs 18.2-18.3, 6 20.9 vs 19.7, 8 28.2 vs 21.4; bfloat16 (dot-product instructions) 1 9.5 vs
# 11.6, 2 9.7 vs 11.9, 4 11.2-11.6 vs 12.8-13.1, 6 12.9 vs 14.6, 8 14.1 vs 16.0.
GEMV_MAX_ROWS = {torch.float32: 4, torch.bfloat16: 8}


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's blocked layout, and (`small_rows`) also as it
    is, for decode's few rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, small_rows: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().clone()
        # A GEMV only streams the weight, and oneDNN's (and MKL's) runs on one core or reorders
        # for compute: up to GEMV_MAX_ROWS rows go through `cpu_kernels.gemv` on the plain weight
        # (a second copy of it; none for a tied LM head, which is the embedding). Without that
        # kernel, a float32 single row goes through bmm with the weight viewed as [2, N/2, K],
        # whose two halves run on two cores (46 -> 38 ms a batch-1 step, on an earlier machine).
        self.rows_weight = weight.detach().contiguous() if small_rows else None
        gemv = small_rows and weight.dtype in GEMV_MAX_ROWS and cpu_kernels.gemv_available()
        self.gemv_rows = GEMV_MAX_ROWS[weight.dtype] if gemv else 0
        # the kernel adds a float32 bias: converted once here, not on every call
        self.gemv_bias = None if self.bias is None or not gemv else self.bias.float()
        self.halves = None
        if (small_rows and not gemv and weight.dtype == torch.float32 and self.out_features % 2 == 0
                and torch.get_num_threads() > 1):
            self.halves = self.rows_weight.view(2, self.out_features // 2, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2   # the model's case: no reshapes (at batch 1 every op here costs)
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if 1 <= rows <= self.gemv_rows:
            y = torch.ops.plait_cpu.gemv(x2, self.rows_weight, self.gemv_bias)
        elif self.halves is not None and rows == 1 and x2.is_contiguous():
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
