"""Weight quantization, applied to a loaded model: every plain `nn.Linear` (and the LM head) is
replaced by a module holding quantized weights.

`int8`: symmetric per-output-channel int8 weights, `W ~= q * scale[:, None]` with `q` in
[-127, 127] and one float32 scale per output row. The matmul kernel depends on the device:

- CPU, `int8pack` (default): weight-only. Below 4 rows (batch-1 / small-batch decode, where
  reading the weights is the cost) `torch._weight_int8pack_mm` reads the int8 weights with
  bfloat16 activations; from 4 rows on, where compute is the cost and that kernel (which does not
  reuse a weight across rows) falls behind, a bfloat16 copy of the *dequantized* int8 weights,
  prepacked for oneDNN, computes the same product. So int8 on the CPU holds 1.5 bytes a weight.
  Measured on SmolLM2-135M's shapes (2 cores, 30 layers + LM head, weights out of cache, load ~15):
  M=1: 89 ms vs 183 ms float32 prepacked; M=4: 92 vs 188 (int8pack alone 125); M=32: 238 vs 372
  (int8pack alone 658).
- `w8a8` (opt-in, `PLAIT_INT8_KERNEL=w8a8`): activations quantized to int8 per token, then
  `torch._int_mm` (int8 x int8 -> int32): 2.2x faster than float32 at M=32, but on SmolLM2 it costs
  perplexity 24.08 -> 25.51 and 94% teacher-forced top-1 agreement (the weight-only default:
  24.09, 97%; tests/test_quantization.py), so it is not the default. (fbgemm's dynamic int8 linear, per-tensor activations, was
  faster still and worse: perplexity 39.6.)
- `dequant`: dequantize then `F.linear`; the CUDA int8 path and the reference.

`fp8` (CUDA only, compute capability >= 9.0): float8 e4m3 weights with per-row scales and
per-token activation scales through `torch._scaled_mm`; other GPUs fall back to int8 dequant.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "fp8")
INT8_KERNELS = ("int8pack", "w8a8", "dequant")
_FP8_MAX = 448.0   # largest finite float8_e4m3fn
_INT8PACK_MAX_ROWS = 4   # CPU: from this many rows, the bf16 copy of the dequantized weight is faster


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: returns (q int8 `[N, K]`, scale float32 `[N]`)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def default_int8_kernel(device: torch.device) -> str:
    """The fastest int8 kernel available on `device`; `$PLAIT_INT8_KERNEL` overrides it on the CPU
    (for comparing kernels in benchmarks)."""
    if device.type == "cpu":
        forced = os.environ.get("PLAIT_INT8_KERNEL")
        if forced:
            return forced
        return "int8pack" if hasattr(torch, "_weight_int8pack_mm") else "dequant"
    return "dequant"


class Int8Linear(nn.Module):
    """`y = x @ (q * scale).T + b` with int8 `q`; see the module docstring for the kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel or default_int8_kernel(weight.device)
        if self.kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(INT8_KERNELS)}, got {self.kernel!r}")
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16) if self.kernel == "int8pack" else None,
                             persistent=False)
        self.packed_bf16 = self._pack_bf16() if self.kernel == "int8pack" else None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the int8 values stand for, `[N, K]`."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kernel == "int8pack" and x2.shape[0] < _INT8PACK_MAX_ROWS:
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight, self.scale_bf16)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif self.kernel == "int8pack" and self.packed_bf16 is not None:
            y = self.packed_bf16(x2.to(torch.bfloat16))
        elif self.kernel == "int8pack":   # no oneDNN: dequantize per call (amortized over the rows)
            bias = None if self.bias is None else self.bias.to(torch.bfloat16)
            y = F.linear(x2.to(torch.bfloat16), self.dequantized(torch.bfloat16), bias)
        elif self.kernel == "w8a8":
            y = self._w8a8(x2)
        else:
            y = F.linear(x2, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _pack_bf16(self) -> nn.Module | None:
        """The dequantized weight in bfloat16, prepacked for oneDNN (None where that is unavailable)."""
        from .prepack import PackedLinear, prepack_available
        if not prepack_available() or self.qweight.device.type != "cpu":
            return None
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return PackedLinear(self.dequantized(torch.bfloat16), bias)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """int8 x int8 -> int32 GEMM with activations quantized per row (token), symmetric."""
        x = x.float()
        x_scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        xq = torch.round(x / x_scale).to(torch.int8)
        y = torch._int_mm(xq, self.qweight.t()).float() * x_scale * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def fp8_supported(device: torch.device) -> bool:
    """Row-wise scaled float8 matmuls: CUDA with compute capability >= 9.0 (Hopper) and a torch
    that has `_scaled_mm` and float8_e4m3fn."""
    return (device.type == "cuda" and torch.cuda.is_available() and hasattr(torch, "_scaled_mm")
            and hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability(device) >= (9, 0))


class Fp8Linear(nn.Module):
    """CUDA: `y = x @ W.T + b` with W in float8 e4m3 (one scale per output row) and x quantized
    per token on the fly; `torch._scaled_mm` with row-wise scales, bfloat16 output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.device.type != "cuda":
            raise ValueError("fp8 weights need a CUDA device")
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)          # [N, 1]
        self.register_buffer("qweight", (w / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale.t().contiguous())                             # [1, N]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        x_scale = (x2.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)        # [M, 1]
        xq = (x2 / x_scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).contiguous()
        # qweight.t() is [K, N] column-major, the layout _scaled_mm wants for its second operand.
        y = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def _fp8_shape_ok(weight: torch.Tensor) -> bool:
    # _scaled_mm needs both dimensions of the weight to be multiples of 16.
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def make_quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str,
                          kernel: str | None = None) -> nn.Module:
    """One quantized replacement for `F.linear(., weight, bias)`."""
    if method == "fp8" and fp8_supported(weight.device) and _fp8_shape_ok(weight):
        return Fp8Linear(weight, bias)
    return Int8Linear(weight, bias, kernel)


def _is_plain_linear(mod: nn.Module) -> bool:
    # A subclass with its own forward (e.g. one that all-reduces) is not ours to replace.
    return isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward


def quantize_model(model: nn.Module, method: str, kernel: str | None = None) -> int:
    """Replace every plain `nn.Linear` of `model` by its quantized version, and quantize the LM
    head of models that expose one (a module with `local_weight()` and a `packed` slot that its
    forward uses, as `parallel.ParallelLMHead`). Returns the number of layers quantized."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    device = next(model.parameters()).device
    if method == "fp8" and not fp8_supported(device):
        logger.warning("fp8 needs a CUDA GPU with compute capability >= 9.0; using int8 weights instead")
    targets = [(name, mod) for name, mod in model.named_modules() if _is_plain_linear(mod)]
    heads = [mod for mod in model.modules() if hasattr(mod, "local_weight") and hasattr(mod, "packed")]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make_quantized_linear(mod.weight, mod.bias, method, kernel))
    for head in heads:
        head.packed = make_quantized_linear(head.local_weight(), None, method, kernel)
    count = len(targets) + len(heads)
    logger.info("quantized %d linear layers to %s", count, method)
    return count
