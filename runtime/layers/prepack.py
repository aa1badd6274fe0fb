"""CPU weight prepacking: linear layers run through oneDNN with weights reordered once at load.

On this class of CPU a prepacked oneDNN matmul is 1.3-2.3x faster than `F.linear` (MKL) for the
small-M shapes of decoding (measured for M=8..256, K=576, float32 and bfloat16), the same trick
torch.compile's freezing pass uses. Decode's batch sizes (up to `SMALL_GEMM_MAX_ROWS` rows) go
through `cpu_kernels.small_gemm` on a second copy of the weight in 32-column panels instead: it
streams the weight at the machine's bandwidth at one row (oneDNN runs that on one core) and runs
faster than oneDNN's GEMM up to 64 float32 / 128 bfloat16 rows (14-30% at 8-32). Only the CPU path; GPUs keep `nn.Linear`.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import cpu_kernels

logger = logging.getLogger(__name__)


def prepack_available() -> bool:
    """True when this torch build has oneDNN and its prepacked linear ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.lru_cache(maxsize=None)
def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs `dtype` on this CPU: its bfloat16 path needs AVX-512
    (BW/VL/DQ) or AVX-NE-CONVERT and raises elsewhere (an AVX2-only CPU)."""
    if not prepack_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), w, None, "none", [], "")
        return True
    except Exception:  # RuntimeError here; whatever another build raises, the answer is the same
        return False


# Up to this many rows (decode's batch sizes) `cpu_kernels.small_gemm` on the weight's panels; above,
# oneDNN's prepacked GEMM (prefill). Each limit is about where small_gemm stops beating oneDNN, over
# SmolLM2's matrices and in whole decode steps; the batches up to it also take the fused decode step.
SMALL_GEMM_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 128}


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's blocked layout, and (`small_rows`) also in
    `small_gemm`'s panels, for decode's batch sizes. `panels_only`: one copy, the panels, for
    every number of rows where `small_gemm` runs (quantized layers' bfloat16 copy: those rows are
    the ones their own kernels do not take), also where oneDNN does not take the dtype; oneDNN's
    elsewhere, or `F.linear` where neither runs."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, small_rows: bool = True, panels_only: bool = False
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().clone()
        small = (
            (small_rows or panels_only)
            and cpu_kernels.small_gemm_available(weight.dtype)
            and (weight.dtype == torch.float32 or self.in_features % 2 == 0)
        )
        onednn = onednn_takes(weight.dtype)
        panels_only = panels_only or (small and not onednn)
        self.panels = cpu_kernels.pack_panels(weight) if small else None
        self.small_rows = 0 if not small else sys.maxsize if panels_only else SMALL_GEMM_MAX_ROWS[weight.dtype]
        self.packed = (
            None
            if (small and panels_only) or not onednn
            else torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        )
        # neither kernel runs this dtype here: the plain weight, for F.linear
        self.weight = None if self.packed is not None or (small and panels_only) else weight.detach()
        # the kernel adds a float32 bias: converted once here, not on every call
        self.small_bias = None if self.bias is None or not small else self.bias.float()
        # Without that kernel, a float32 single row goes through bmm with the weight viewed as
        # [2, N/2, K], whose two halves run on two cores (oneDNN's GEMV runs on one).
        self.halves = None
        if (
            small_rows
            and not panels_only
            and not small
            and weight.dtype == torch.float32
            and self.out_features % 2 == 0
            and torch.get_num_threads() > 1
        ):
            self.halves = weight.detach().contiguous().view(2, self.out_features // 2, self.in_features)

    def decode_kernel(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """What `forward` runs for `rows` rows of `dtype` as `cpu_kernels.decode_layers_` takes it:
        (kind 0 = small_gemm, panels, float32 bias or None, out_features); None if not small_gemm."""
        return (0, self.panels, self.small_bias, self.out_features) if self._small_takes(rows, dtype) else None

    def _small_takes(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `small_gemm` runs these rows (`forward` and `decode_kernel` agree through this)."""
        return 1 <= rows <= self.small_rows and dtype == self.panels.dtype

    widens = True  # forward takes `widen`

    def forward(self, x: torch.Tensor, widen: bool = False) -> torch.Tensor:
        """`widen`: a bfloat16 product may come back as float32 holding the bfloat16 results (the
        LM head's logits, which the caller widens anyway: a pass over them less)."""
        flat = x.dim() == 2  # the model's case: no reshapes (at batch 1 every op here costs)
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if self._small_takes(rows, x2.dtype):
            y = cpu_kernels.ops.small_gemm(x2, self.panels, self.small_bias, self.out_features, widen)
        elif self.halves is not None and rows == 1 and x2.is_contiguous():
            # [2, N/2, K] @ [2, K, 1] -> [2, N/2, 1], which is the [1, N] row as it lies
            # (x as [K, 1] with strides (1, K): the layout bmm's fast path takes)
            y = torch.bmm(self.halves, x2.t().unsqueeze(0).expand(2, -1, -1)).view(1, self.out_features)
            if self.bias is not None:
                y = y + self.bias
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x2, self.weight, self.bias)
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
