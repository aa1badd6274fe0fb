"""Weight quantization, applied to a loaded model: every plain `nn.Linear` (and the LM head) is
replaced by a module holding quantized weights.

`int8`: symmetric per-output-channel int8 weights, `W ~= q * scale[:, None]` with `q` in
[-127, 127] and one float32 scale per output row. The matmul kernel depends on the device:

- CPU, `int8pack` (default): weight-only. Up to 8 rows (decode's batches), on a CPU with
  AVX512-VNNI or AVX2, `cpu_kernels.int8_gemv` (int16 activations in blocks of 64, exact int32 dot
  products; see the LM head below; whole decode steps run faster than with torch's kernel).
  Without either, below 4 rows (batch-1 / small-batch decode, where reading the weights is the
  cost) `torch._weight_int8pack_mm` reads the int8 weights with bfloat16 activations; from 4 rows
  on (from 9 with that kernel), where compute is the cost and that kernel (which does not reuse a
  weight across rows) falls behind, a bfloat16 copy of the *dequantized* int8 weights computes the
  same product: in `cpu_kernels.small_gemm`'s panels where that kernel runs (faster there than
  oneDNN's GEMM), else prepacked for oneDNN. So int8 on the CPU holds 3 bytes a weight (2 where
  `int8_rows` takes the many rows, below: its packed copy instead of the bfloat16 one).
- `w8a8` (opt-in, `PLAIT_INT8_KERNEL=w8a8`): activations quantized to int8 per token, then
  `torch._int_mm` (int8 x int8 -> int32): 2.2x faster than float32 at M=32, but on SmolLM2 it is
  clearly less accurate than the weight-only default, so it is not the default. (fbgemm's dynamic
  int8 linear, per-tensor activations, was faster still and worse.)
- `dequant`: dequantize then `F.linear`; the CUDA int8 path and the reference.

`int4`: GGUF Q4_1's scheme, asymmetric 4-bit codes in groups of 32 along K (`quantize_int4`).
Each group's minimum gets code 0 and its maximum code 15, so for a model loaded from a Q4_1 GGUF
(the default SmolLM2: every attention and MLP matrix) re-quantizing the dequantized float32
weights gives back the file's codes, d and m exactly (held as float16, as the file does): int4
*is* the file's model, while int8 re-rounds it (on SmolLM2 int4's logits are the closer of the
two to float32's). Kernels:

- CPU, `int4pack` (default): up to 8 rows (decode's batches, a request's speculative drafts),
  `cpu_kernels.int4_gemv` on a CPU with AVX512-VNNI or AVX2: x quantized to int16 per group of 32,
  code x activation products summed exactly in int32 (vpdpwssd; AVX2: vpmaddwd), Q4_1's float16
  scales and minimums applied once per group, 16 output rows to a vector; it reads the weights at
  close to the machine's bandwidth where torch's kernel (float32 FMAs on converted codes) is
  compute-bound, and its results are closer to float32's than that kernel's (bfloat16 activations
  and scales). Without either, torch's `_weight_int4pack_mm_for_cpu` with bfloat16 activations
  (float32 ones are ~20x slower) up to 9 rows. From there on the bfloat16 copy of the dequantized
  weight, as int8 does (see `_INT4PACK_MAX_ROWS`) - except on a CPU without bfloat16 dot products
  (AVX2, AVX-512 without BF16: `cpu_kernels.int4_gemv_all_rows`), where `int4_gemv` takes every
  row count, 8 rows of x at a time over each ~32 KB of weights while it is in L1/L2 (faster there
  than the copy's small_gemm at every row count, prefill included), and no bfloat16 copy is made.
  Both kernels need N % 16 == 0 (else the bf16 copy serves every row); a layer whose K is not a
  multiple of 32 is int8 instead. So int4 on the CPU holds 3.25 bytes a weight (codes and scales,
  the kernel's layout, the bf16 copy; 1.25 without the copy), 0.625 of them read at batch 1.
- `dequant`: dequantize then `F.linear`; other devices and torch builds without the kernel.

The LM head stays int8 with `int4`: it is the matrix whose error lands on the logits directly,
and the GGUF stores it (the tied token embedding) as Q8_0, not 4-bit; llama.cpp's 4-bit mixes keep
it at 6-8 bits as well. On SmolLM2 an int4 head moves the logits much further from float32's (KL,
top-1 agreement) for a small saving per step. Up to 8 rows, an int8 LM head on a CPU with
AVX512-VNNI or AVX2 runs through `cpu_kernels` `int8_gemv` (`Int8Linear.use_vnni_gemv`):
activations as int16 in blocks of 64, exact int32 dot products, float32 logits: faster than
`_weight_int8pack_mm`, and closer to the float32 head than bfloat16 activations. On a CPU with AVX2
and no AVX-512, int8 layers and head go through `cpu_kernels` `int8_rows` instead, at every row
count (`Int8Linear.use_vnni_gemv`): the same int16 activations and int32 block sums, with the
weight packed so that 16 outputs share a vector (no horizontal sum per output), 6 rows of x a
pass: faster than int8_gemv at 1-8 rows and than the bfloat16 copy past them. The bfloat16 copy is
then dropped.

`gguf` (a GGUF only): each tensor as the file stores it. The 4-bit types' codes go into
`Int4Linear`; the 5- to 8-bit ones (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) into `GroupInt8Linear`: int8
codes with a float32 scale and minimum per group of 16 or 32, exactly the file's weights, by
`cpu_kernels.int8g_gemv` (as `int4_gemv`, with 8-bit codes); the head too, from the file's
embedding or output codes.

`fp8` (CUDA only, compute capability >= 9.0): float8 e4m3 weights with per-row scales and
per-token activation scales through `torch._scaled_mm`; other GPUs fall back to int8 dequant.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import cpu_kernels
from ..server_args import QUANTIZATIONS

logger = logging.getLogger(__name__)

INT8_KERNELS = ("int8pack", "w8a8", "dequant")
INT4_KERNELS = ("int4pack", "dequant")
INT4_GROUP_SIZE = 32  # GGUF Q4_1's block
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INT8PACK_MAX_ROWS = 4  # CPU: from this many rows, the bf16 copy of the dequantized weight is faster
# CPU: below this many rows the int4 kernel, from it the bf16 copy: about where they cross over in
# whole bf16+int4 decode steps.
_INT4PACK_MAX_ROWS = 10
_INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel accepts
# cpu_kernels.int4_gemv (AVX512-VNNI or AVX2) up to this many rows; past them the bf16 copy, except
# where int4_gemv_all_rows() (no bf16 dot products): there int4_gemv takes every row count
_INT4_GEMV_MAX_ROWS = 8


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


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows (the model's own inputs already are)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _bf16_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x as the weight-only kernels take it; no op when it already is."""
    return x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()


class _WeightOnlyLinear(nn.Module):
    """What the CPU int8 and int4 layers share: many rows go through a bfloat16 copy of the
    dequantized weight, prepacked for oneDNN (the weight-only kernels do not reuse a weight row
    across input rows, so they fall behind once compute, not reading, is the cost)."""

    qweight: torch.Tensor
    bias: torch.Tensor | None
    packed_bf16: nn.Module | None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the weight lives."""
        return self.qweight.device

    def _pack_bf16(self) -> nn.Module | None:
        """The dequantized weight in bfloat16, in `small_gemm`'s panels (or, where that kernel does
        not run, prepacked for oneDNN); None where neither is available. Many rows only: the
        panels are ~25% faster than oneDNN's GEMM at 16-32 rows, 8% slower at 512 (prefill)."""
        from .prepack import PackedLinear, prepack_available

        if not prepack_available() or self.device.type != "cpu":
            return None
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return PackedLinear(self.dequantized(torch.bfloat16), bias, small_rows=False, panels_only=True)

    def _output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (rows of `_rows(x)`) in x's dtype and leading shape; no op where nothing changes
        (at batch 1 every op is a cost)."""
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _copy_kernel(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """The bfloat16 copy's `decode_kernel`: only for a bfloat16 model (no casts around it)."""
        if self.packed_bf16 is None or dtype != torch.bfloat16:
            return None
        return self.packed_bf16.decode_kernel(rows, dtype)

    def _bf16_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """`x2 @ W.T + b` in bfloat16: the prepacked copy, or (no oneDNN) the weight dequantized
        per call, amortized over the rows."""
        if self.packed_bf16 is not None:
            return self.packed_bf16(x2.to(torch.bfloat16))
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x2.to(torch.bfloat16), self.dequantized(torch.bfloat16), bias)


class Int8Linear(_WeightOnlyLinear):
    """`y = x @ (q * scale).T + b` with int8 `q`; see the module docstring for the kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None):
        super().__init__()
        self._build(*quantize_int8(weight), bias, kernel)

    @classmethod
    def from_codes(
        cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, kernel: str | None = None
    ) -> Int8Linear:
        """The layer of `W = q * scale[:, None]` as given (int8 `q` `[N, K]`, float32 `scale` `[N]`)."""
        self = cls.__new__(cls)
        _WeightOnlyLinear.__init__(self)
        self._build(q.contiguous(), scale.float(), bias, kernel)
        return self

    def _build(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: str | None) -> None:
        self.out_features, self.in_features = q.shape
        self.kernel = kernel or default_int8_kernel(q.device)
        if self.kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(INT8_KERNELS)}, got {self.kernel!r}")
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer(
            "scale_bf16", scale.to(torch.bfloat16) if self.kernel == "int8pack" else None, persistent=False
        )
        self.packed_bf16 = self._pack_bf16() if self.kernel == "int8pack" else None
        self.vnni_gemv = False  # set by use_vnni_gemv()
        self.packed_rows: torch.Tensor | None = None  # int8_rows' layout, set by use_vnni_gemv()

    def use_vnni_gemv(self) -> bool:
        """From here on, up to 8 rows go through `cpu_kernels.int8_gemv` (activations as int16 in
        blocks of 64, AVX512-VNNI or AVX2 int16 x int8 dot products, float32 out) where it runs, or
        every row count through `cpu_kernels.int8_rows` where that runs (AVX2 without AVX-512: there
        it is faster than int8_gemv at 1-8 rows and than the bfloat16 copy past them, which is then
        dropped); False where neither does (the weight-only kernels stay)."""
        from ..kernels.cpu import cpu_kernels

        self.vnni_gemv = (
            self.kernel == "int8pack"
            and self.bias is None
            and self.in_features % 64 == 0
            and self.qweight.device.type == "cpu"
            and cpu_kernels.int8_gemv_available()
        )
        if self.vnni_gemv and self.out_features % 16 == 0 and cpu_kernels.int8_rows_available():
            self.packed_rows = cpu_kernels.int8_rows_pack(self.qweight)
            self.packed_bf16 = None
        return self.vnni_gemv

    def decode_kernel(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """What `forward` runs for `rows` rows of `dtype`, as `cpu_kernels.decode_layers_` takes it
        (kind 2 = int8_gemv, weight, scales, out_features; kind 3 = int8_rows, its packed weight,
        scales, out_features); None where it is none of its kernels."""
        if self._vnni_takes(rows):
            return 2, self.qweight, self.scale, self.out_features
        if self._rows_takes(rows):
            return 3, self.packed_rows, self.scale, self.out_features
        return self._copy_kernel(rows, dtype) if self.kernel == "int8pack" and rows >= _INT8PACK_MAX_ROWS else None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the int8 values stand for, `[N, K]`."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def _vnni_takes(self, rows: int) -> bool:
        """Whether `int8_gemv` runs these rows (`forward` and `decode_kernel` agree through this)."""
        return self.vnni_gemv and self.packed_rows is None and 1 <= rows <= 8

    def _rows_takes(self, rows: int) -> bool:
        """Whether `int8_rows` runs these rows: all of them where it runs."""
        return self.packed_rows is not None and rows >= 1

    widens = True  # forward takes `widen`

    def forward(self, x: torch.Tensor, widen: bool = False) -> torch.Tensor:
        """`widen`: the result may come back as float32 (an LM head's logits: int8_gemv computes
        them in float32, and the caller widens them anyway)."""
        if x.dim() == 2 and self._vnni_takes(x.shape[0]):
            y = cpu_kernels.ops.int8_gemv(x, self.qweight, self.scale)  # float32 out
            return y if widen else self._output(x, y)
        x2 = _rows(x)
        if self._rows_takes(x2.shape[0]):
            y = cpu_kernels.ops.int8_rows(x2, self.packed_rows, self.scale)  # float32 out
            return y if widen and x.dim() == 2 else self._output(x, y)
        if self.kernel == "int8pack" and x2.shape[0] < _INT8PACK_MAX_ROWS:
            y = torch._weight_int8pack_mm(_bf16_contiguous(x2), self.qweight, self.scale_bf16)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif self.kernel == "int8pack":
            y = self._bf16_rows(x2)
        elif self.kernel == "w8a8":
            y = self._w8a8(x2)
        else:
            y = F.linear(x2, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self._output(x, y)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """int8 x int8 -> int32 GEMM with activations quantized per row (token), symmetric."""
        x = x.float()
        x_scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        xq = torch.round(x / x_scale).to(torch.int8)
        y = torch._int_mm(xq, self.qweight.t()).float() * x_scale * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1's asymmetric 4-bit quantization, per group of `group_size` along K:
    `W ~= scale * q + minimum` with `q` in 0..15, `minimum` the group's minimum and `scale` its
    range / 15. Returns (q uint8 `[N, K]`, scale float32 `[N, K/G]`, minimum float32 `[N, K/G]`).

    Each group's minimum gets code 0 and its maximum code 15, so re-quantizing weights that were
    dequantized from Q4_1 gives back the file's codes exactly (and its d, m up to float rounding)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: in_features ({k}) must be a multiple of the group size ({group_size})")
    groups = w.reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # a constant group: all codes 0
    # ggml rounds with trunc(x + 0.5); the argument is never negative, so that is floor.
    q = torch.floor((groups - lo[..., None]) * inv[..., None] + 0.5).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo


def int4pack_available() -> bool:
    """True when this torch build has the CPU int4 weight-only matmul and its packing op."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def default_int4_kernel(device: torch.device) -> str:
    """`int4pack` on a CPU whose torch has the int4 kernel, else `dequant`."""
    return "int4pack" if device.type == "cpu" and int4pack_available() else "dequant"


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[N, K]` (K even) -> `[N, K/2]`, even k in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


class Int4Linear(_WeightOnlyLinear):
    """`y = x @ W.T + b` with W in group-wise asymmetric 4-bit (GGUF Q4_1's scheme, `quantize_int4`).

    The weight is held as 4-bit codes plus one (scale, minimum) pair per group in float16, Q4_1's
    own form: `W[n, k] = q[n, k] * scale[n, g] + minimum[n, g]` (for a model read from a Q4_1 GGUF,
    the file's weights exactly). Kernels: `int4pack` (CPU) runs `cpu_kernels.int4_gemv` (int16
    activations, AVX512-VNNI or AVX2) up to `_INT4_GEMV_MAX_ROWS` rows (every row count where
    `cpu_kernels.int4_gemv_all_rows()`: no bfloat16 copy then); where that kernel does not run,
    torch's `_weight_int4pack_mm_for_cpu` (bfloat16 activations and bfloat16 scales, at most ~1.6%
    of a quantization step away) below `_INT4PACK_MAX_ROWS` rows; from there on a bfloat16 copy
    of W (`small_gemm` panels, else oneDNN's; neither int4 kernel reuses a weight across rows). Both kernels need N % 16 == 0,
    else the copy serves every row. `dequant` computes `F.linear` with W dequantized in the input's
    dtype (other devices, the reference)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group_size: int = INT4_GROUP_SIZE,
        kernel: str | None = None,
    ):
        super().__init__()
        self._build(*quantize_int4(weight, group_size), bias, kernel)

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernel: str | None = None,
    ) -> Int4Linear:
        """The layer of `W[n, k] = q[n, k] * scale[n, g] + minimum[n, g]` as given (uint8 codes 0..15
        `[N, K]`, float `[N, K/G]` scales and minimums, held as float16; G = K / scale columns):
        a quantized checkpoint's own codes, with no float weight in between."""
        self = cls.__new__(cls)
        _WeightOnlyLinear.__init__(self)
        self._build(q, scale, minimum, bias, kernel)
        return self

    def _build(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: str | None,
    ) -> None:
        self.out_features, self.in_features = q.shape
        group_size = self.group_size = self.in_features // scale.shape[1]
        self.kernel = kernel or default_int4_kernel(q.device)
        if self.kernel not in INT4_KERNELS:
            raise ValueError(f"int4 kernel must be one of {', '.join(INT4_KERNELS)}, got {self.kernel!r}")
        if self.kernel == "int4pack" and not int4pack_available():
            raise ValueError("the int4pack kernel needs torch's _weight_int4pack_mm_for_cpu")
        scale, minimum = scale.to(torch.float16), minimum.to(torch.float16)
        self.register_buffer("qweight", _pack_nibbles(q))
        self.register_buffer("scale_min", torch.stack([scale, minimum], dim=-1))  # [N, K/G, 2] float16
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        on_cpu = self.kernel == "int4pack" and q.device.type == "cpu" and self.out_features % 16 == 0
        use_gemv = on_cpu and group_size == 32 and cpu_kernels.int4_gemv_available()
        self.register_buffer(
            "packed_gemv", cpu_kernels.int4_gemv_pack(q, scale, minimum) if use_gemv else None, persistent=False
        )
        self.gemv_bias = None if bias is None or not use_gemv else bias.detach().float().contiguous()
        # where int4_gemv is the fastest at every row count, it takes them all (and no bf16 copy is kept)
        self.gemv_all_rows = use_gemv and cpu_kernels.int4_gemv_all_rows()
        # torch's int4 kernel only where ours does not run (not a third copy of the weight)
        use_int4mm = on_cpu and not use_gemv and group_size in _INT4PACK_GROUP_SIZES
        self.register_buffer(
            "packed_int4",
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            if use_int4mm
            else None,
            persistent=False,
        )
        # its form: W = (q - 8) * scale + zero, zero = minimum + 8 * scale, [K/G, N, 2] bfloat16
        zeros = minimum.float() + 8 * scale.float()
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([scale.float(), zeros], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
            if use_int4mm
            else None,
            persistent=False,
        )
        self.packed_bf16 = self._pack_bf16() if self.kernel == "int4pack" and not self.gemv_all_rows else None

    def decode_kernel(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """What `forward` runs for `rows` rows of `dtype`, as `cpu_kernels.decode_layers_` takes it
        (kind 1 = int4_gemv, packed codes, float32 bias or None, out_features); None where it is
        none of its kernels."""
        if self._gemv_takes(rows):
            return 1, self.packed_gemv, self.gemv_bias, self.out_features
        if self._int4mm_takes(rows):
            return None
        return self._copy_kernel(rows, dtype) if self.kernel == "int4pack" else None

    # which rows each kernel runs (`forward` and `decode_kernel` agree through these)
    def _gemv_takes(self, rows: int) -> bool:
        return self.packed_gemv is not None and rows >= 1 and (rows <= _INT4_GEMV_MAX_ROWS or self.gemv_all_rows)

    def _int4mm_takes(self, rows: int) -> bool:
        return self.packed_int4 is not None and rows < _INT4PACK_MAX_ROWS

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for, `[N, K]` (what `int4_gemv` computes with)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        sm = self.scale_min.float()  # [N, K/G, 2]
        q = _unpack_nibbles(self.qweight).reshape(n, k // g, g).float()
        return (q * sm[..., :1] + sm[..., 1:]).reshape(n, k).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x)
        if self._gemv_takes(x2.shape[0]):
            return self._output(x, cpu_kernels.ops.int4_gemv(x2, self.packed_gemv, self.gemv_bias))
        if self._int4mm_takes(x2.shape[0]):
            # bfloat16 activations: with float32 ones the kernel is ~20x slower.
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                _bf16_contiguous(x2), self.packed_int4, self.group_size, self.scales_and_zeros
            )
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif self.kernel == "int4pack":
            y = self._bf16_rows(x2)
        else:
            y = F.linear(x2, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self._output(x, y)

    def extra_repr(self) -> str:
        copy_only = self.kernel == "int4pack" and self.packed_int4 is None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"kernel={self.kernel}{' (bf16 copy only)' if copy_only else ''}"
        )


class GroupInt8Linear(_WeightOnlyLinear):
    """`y = x @ W.T + b` with `W[n, k] = q[n, k] * scale[n, g] + minimum[n, g]`: int8 codes with a
    float32 scale (and minimum) per group of 16 or 32 along K, the form of GGUF's 5- to 8-bit types
    (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K; see gguf_weights.py): float32 holds each of their scales (an
    fp16 times a 6- or 8-bit sub-block scale) exactly, so the layer computes with the file's weights.

    On a CPU with AVX512-VNNI or AVX2 (N a multiple of 16) `cpu_kernels.int8g_gemv` runs up to
    `_INT4_GEMV_MAX_ROWS` rows (int16 activations, exact int32 sums, as `int4_gemv`), every row count
    where `cpu_kernels.int4_gemv_all_rows()`; the codes are then held only in its layout. Other rows
    take a bfloat16 copy of W (`small_gemm` panels, else oneDNN's), other devices W dequantized per
    call. `widens`: as an LM head its logits may come back float32 (the kernel writes them so)."""

    widens = True

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, bias: torch.Tensor | None = None
    ):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        scale = scale.float().contiguous()
        minimum = None if minimum is None else minimum.float().contiguous()
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        use_gemv = (
            q.device.type == "cpu"
            and self.out_features % 16 == 0
            and self.group_size in (16, 32)
            and cpu_kernels.int4_gemv_available()
        )
        packed = cpu_kernels.int8g_gemv_pack(q, scale, minimum) if use_gemv else None
        self.register_buffer("packed_gemv", packed, persistent=False)
        # the codes once: in the kernel's layout where it runs (`dequantized` reads them back from it)
        self.register_buffer("qweight", None if use_gemv else q.to(torch.int8).contiguous())
        self.register_buffer("scale", None if use_gemv else scale)
        self.register_buffer("minimum", None if use_gemv else minimum)
        self.gemv_bias = None if bias is None or not use_gemv else bias.detach().float().contiguous()
        self.gemv_all_rows = use_gemv and cpu_kernels.int4_gemv_all_rows()
        on_cpu = q.device.type == "cpu"
        self.packed_bf16 = self._pack_bf16() if on_cpu and not self.gemv_all_rows else None

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes int8 `[N, K]`, scale, minimum `[N, K/G]`) from whichever form the layer holds."""
        if self.packed_gemv is None:
            return self.qweight, self.scale, self.minimum
        n, k, g = self.out_features, self.in_features, self.group_size
        p = self.packed_gemv
        codes = p[..., : 16 * g].reshape(n // 16, k // g, g // 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k)

        def per_group(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous().view(torch.float32).transpose(1, 2).reshape(n, k // g)

        return codes.view(torch.int8), per_group(p[..., 16 * g : 16 * g + 64]), per_group(p[..., 16 * g + 64 :])

    @property
    def device(self) -> torch.device:
        return (self.packed_gemv if self.packed_gemv is not None else self.qweight).device

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for, `[N, K]` (what `int8g_gemv` computes with)."""
        q, scale, minimum = self._codes()
        n, k, g = self.out_features, self.in_features, self.group_size
        w = q.reshape(n, k // g, g).float() * scale[..., None]
        if minimum is not None:
            w = w + minimum[..., None]
        return w.reshape(n, k).to(dtype)

    def _gemv_takes(self, rows: int) -> bool:
        """Whether `int8g_gemv` runs these rows (`forward` and `decode_kernel` agree through this)."""
        return self.packed_gemv is not None and rows >= 1 and (rows <= _INT4_GEMV_MAX_ROWS or self.gemv_all_rows)

    def decode_kernel(self, rows: int, dtype: torch.dtype) -> tuple | None:
        """What `forward` runs for `rows` rows of `dtype`, as `cpu_kernels.decode_layers_` takes it
        (kind 4 = int8g_gemv, packed codes, float32 bias or None, out_features); None where it is
        none of its kernels."""
        if self._gemv_takes(rows):
            return 4, self.packed_gemv, self.gemv_bias, self.out_features
        return self._copy_kernel(rows, dtype)

    def forward(self, x: torch.Tensor, widen: bool = False) -> torch.Tensor:
        x2 = _rows(x)
        if self._gemv_takes(x2.shape[0]):
            y = cpu_kernels.ops.int8g_gemv(x2, self.packed_gemv, self.gemv_bias, widen)
            return y if widen and x.dim() == 2 else self._output(x, y)
        if self.device.type == "cpu":
            return self._output(x, self._bf16_rows(x2))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return self._output(x, F.linear(x2, self.dequantized(x.dtype), bias))

    def extra_repr(self) -> str:
        kernel = "int8g_gemv" if self.packed_gemv is not None else "bf16 copy"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"kernel={kernel}"
        )


def fp8_supported(device: torch.device) -> bool:
    """Row-wise scaled float8 matmuls: CUDA with compute capability >= 9.0 (Hopper) and a torch
    that has `_scaled_mm` and float8_e4m3fn."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and hasattr(torch, "_scaled_mm")
        and hasattr(torch, "float8_e4m3fn")
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


class Fp8Linear(nn.Module):
    """CUDA: `y = x @ W.T + b` with W in float8 e4m3 (one scale per output row) and x quantized
    per token on the fly; `torch._scaled_mm` with row-wise scales, bfloat16 output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.device.type != "cuda":
            raise ValueError("fp8 weights need a CUDA device")
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)  # [N, 1]
        self.register_buffer("qweight", (w / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale.t().contiguous())  # [1, N]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        x_scale = (x2.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)  # [M, 1]
        xq = (x2 / x_scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).contiguous()
        # qweight.t() is [K, N] column-major, the layout _scaled_mm wants for its second operand.
        y = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def _fp8_shape_ok(weight: torch.Tensor) -> bool:
    # _scaled_mm needs both dimensions of the weight to be multiples of 16.
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def make_quantized_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, method: str, kernel: str | None = None
) -> nn.Module:
    """One quantized replacement for `F.linear(., weight, bias)`. `kernel` is the int8 kernel (of
    int8 layers, and of int4 layers' int8 fallback)."""
    if method == "fp8" and fp8_supported(weight.device) and _fp8_shape_ok(weight):
        return Fp8Linear(weight, bias)
    if method == "int4" and weight.shape[1] % INT4_GROUP_SIZE == 0:
        return Int4Linear(weight, bias)
    return Int8Linear(weight, bias, kernel)  # (int4 with K not a multiple of the group: int8)


@dataclasses.dataclass
class QuantizedWeight:
    """A checkpoint's 2-D weight kept quantized on its way into a layer (a GGUF tensor read as the
    file stores it): `kind` "int4", `W[n, k] = codes[n, k] * scale[n, g] + minimum[n, g]` over groups
    of 32 (or a multiple of 32) along K (uint8 codes 0..15); "int8g", the same with int8 codes over
    groups of 16 or 32 and `minimum` possibly None (zeros); or "int8", `W = codes * scale[:, None]`
    (int8 codes, one scale a row). The parallel layers narrow it to their shard and
    `build_quantized_layers` turns it into an `Int4Linear` / `GroupInt8Linear` / `Int8Linear`;
    anything else takes `dequantize()`."""

    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None
    source: str = ""  # the checkpoint's type, for messages ("GGUF Q4_K")
    # the input columns' order in `codes` where it is not the weight's (GPTQ act-order: sorted by
    # group): codes[:, j] is column perm[j], and the layer computes with x[..., perm]
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group_size(self) -> int:
        """Values per scale along K (K for "int8": one scale a row)."""
        return self.codes.shape[1] if self.kind == "int8" else self.codes.shape[1] // self.scale.shape[1]

    def as_int8g(self, group: int) -> QuantizedWeight:
        """The same weight as "int8g" over groups of `group` (which must divide this one's): the
        codes as int8, each scale (and minimum) repeated over its pieces; exact."""
        n, k = self.codes.shape
        if self.group_size % group or self.perm is not None:
            raise ValueError(f"{self.kind} over groups of {self.group_size} is not int8g over groups of {group}")
        if self.kind == "int8":
            scale, minimum = self.scale[:, None].expand(n, k // group).contiguous(), None
        else:
            again = self.group_size // group
            scale = self.scale.repeat_interleave(again, dim=1)
            minimum = None if self.minimum is None else self.minimum.repeat_interleave(again, dim=1)
        return dataclasses.replace(self, kind="int8g", codes=self.codes.to(torch.int8), scale=scale, minimum=minimum)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for (its columns in their own order)."""
        if self.kind == "int8":
            return self.codes.float() * self.scale[:, None]
        n, k = self.codes.shape
        w = self.codes.reshape(n, self.scale.shape[1], -1).float() * self.scale[..., None]
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        w = w.reshape(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight | torch.Tensor:
        """Rows (dim 0) or columns (dim 1) of the weight; columns that split an int4 group (or of a
        permuted weight) come back dequantized (a float tensor)."""
        if start == 0 and length == self.shape[dim]:
            return self
        if dim == 0:
            return self.map(lambda t: t.narrow(0, start, length), perm=self.perm)
        codes = self.codes.narrow(1, start, length)
        if self.kind == "int8" and self.perm is None:
            return dataclasses.replace(self, codes=codes)
        g = self.codes.shape[1] // self.scale.shape[1]
        if self.perm is not None or start % g or length % g:
            return self.dequantize().narrow(1, start, length)
        groups = lambda t: None if t is None else t.narrow(1, start // g, length // g)  # noqa: E731
        return dataclasses.replace(self, codes=codes, scale=groups(self.scale), minimum=groups(self.minimum))

    def map(self, fn, perm: torch.Tensor | None = None) -> QuantizedWeight:
        """`fn` applied to the codes, scales and minimums (`perm` given anew: `fn` may not fit it)."""
        return dataclasses.replace(
            self,
            codes=fn(self.codes),
            scale=fn(self.scale),
            minimum=None if self.minimum is None else fn(self.minimum),
            perm=perm,
        )

    def split(self, sizes: list[int]) -> list[QuantizedWeight]:
        """Consecutive row blocks (a fused checkpoint tensor's pieces), as `torch.Tensor.split`."""
        out, start = [], 0
        for size in sizes:
            out.append(self.narrow(0, start, size))
            start += size
        return out


def as_float(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """A checkpoint tensor as float: a `QuantizedWeight` dequantized, a tensor as it is."""
    return t.dequantize() if isinstance(t, QuantizedWeight) else t


def _cat_quantized(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Pieces of one fused layer (q, k, v) stacked by rows; pieces of different kinds or groups all
    go int8g over groups of 32 (16 where a piece has groups of 16), exactly: a Q4_K_M file's attn_v
    is often Q6_K (groups of 16) beside Q4_K q and k. None where the pieces order their input
    columns differently (they cannot share one input)."""
    perms = [p.perm for p in parts]
    if any(q is None for q in perms) != all(q is None for q in perms) or (
        perms[0] is not None and not all(torch.equal(perms[0], q) for q in perms)
    ):
        return None
    if len({(p.kind, p.group_size) for p in parts}) > 1:
        group = next((g for g in (32, 16) if all(p.group_size % g == 0 for p in parts)), None)
        if group is None or perms[0] is not None:
            parts = [p if p.kind == "int8" else QuantizedWeight("int8", *quantize_int8(p.dequantize())) for p in parts]
        else:
            parts = [p.as_int8g(group) for p in parts]
    minimum = None
    if any(p.minimum is not None for p in parts):  # (Q6_K has none, Q5_K has)
        minimum = torch.cat([torch.zeros_like(p.scale) if p.minimum is None else p.minimum for p in parts])
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return dataclasses.replace(
        parts[0], codes=cat([p.codes for p in parts]), scale=cat([p.scale for p in parts]), minimum=minimum
    )


class InputPermuted(nn.Module):
    """A layer whose weight holds its input columns in `perm`'s order (a GPTQ act-order
    checkpoint's, sorted by group): `y = inner(x[..., perm])`."""

    def __init__(self, inner: nn.Module, perm: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.register_buffer("perm", perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


def quantized_layer(w: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module:
    """The layer that computes with `w`'s own codes."""
    if w.kind == "int4":
        layer = Int4Linear.from_codes(w.codes.contiguous(), w.scale, w.minimum, bias)
    elif w.kind == "int8g":
        layer = GroupInt8Linear(w.codes.contiguous(), w.scale, w.minimum, bias)
    else:
        layer = Int8Linear.from_codes(w.codes, w.scale, bias)
    return layer if w.perm is None else InputPermuted(layer, w.perm)


def keep_quantized(linear: nn.Linear, w: QuantizedWeight, rows: tuple[int, int] | None = None) -> None:
    """Hold `w` (a checkpoint's quantized weight) for `linear`, at rows (offset, count) of a fused
    layer; `build_quantized_layers` later makes the layer from the codes, so its float weight is
    never written."""
    pieces = linear.__dict__.setdefault("quantized_pieces", {})
    pieces[rows or (0, w.shape[0])] = w


def _fill_float(linear: nn.Linear, pieces: list) -> None:
    """The pieces dequantized into the layer's float weight (it stays a float layer)."""
    with torch.no_grad():
        for (offset, rows), w in pieces:
            linear.weight[offset : offset + rows].copy_(w.dequantize())


def build_quantized_layers(model: nn.Module) -> int:
    """Replace every linear that holds its checkpoint's quantized pieces (`keep_quantized`) by the
    layer computing with those codes (`quantized_layer`); a layer whose pieces do not cover its rows
    (some came as float tensors) takes the pieces dequantized into its float weight instead.
    Returns the number of layers built."""
    built = 0
    targets = [(name, mod) for name, mod in model.named_modules() if "quantized_pieces" in mod.__dict__]
    for name, mod in targets:
        pieces = sorted(mod.__dict__.pop("quantized_pieces").items())
        if sum(rows for (_, rows), _ in pieces) != mod.out_features:
            _fill_float(mod, pieces)
            continue
        bias = None if mod.bias is None else mod.bias.detach()
        w = _cat_quantized([w for _, w in pieces])
        if w is None:
            _fill_float(mod, pieces)
            continue
        device = mod.weight.device
        w = w.map(lambda t: t.to(device), perm=None if w.perm is None else w.perm.to(device))
        _replace_module(model, name, quantized_layer(w, bias))
        built += 1
    return built


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _is_plain_linear(mod: nn.Module) -> bool:
    # A subclass with its own forward (e.g. one that all-reduces) is not ours to replace.
    return isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward


def quantize_model(model: nn.Module, method: str, kernel: str | None = None) -> int:
    """Replace every plain `nn.Linear` of `model` by its quantized version, and quantize the LM
    head of models that expose one (a module with `local_weight()` and a `packed` slot that its
    forward uses, as `parallel.ParallelLMHead`). Returns the number of layers quantized.

    With `int4` the LM head is int8: see the module docstring. With `gguf` the layers were built
    from the file's codes (`build_quantized_layers`) and float ones stay float; the head computes
    with the file's codes where it has them (Q8_0, Q6_K, ...: `GroupInt8Linear`; the rarer types
    int8), and stays float where the file's head is float."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    device = next(model.parameters()).device
    if method == "fp8" and not fp8_supported(device):
        logger.warning("fp8 needs a CUDA GPU with compute capability >= 9.0; using int8 weights instead")
    targets = [(name, mod) for name, mod in model.named_modules() if _is_plain_linear(mod)]
    heads = [mod for mod in model.modules() if hasattr(mod, "local_weight") and hasattr(mod, "packed")]
    if method == "gguf":
        targets, heads = [], [h for h in heads if getattr(h, "checkpoint_quantized", False)]
    for name, mod in targets:
        _replace_module(model, name, make_quantized_linear(mod.weight, mod.bias, method, kernel))
    head_method = "int8" if method in ("int4", "gguf") else method
    for head in heads:
        codes = head.take_checkpoint_codes() if hasattr(head, "take_checkpoint_codes") else None  # (taken: freed)
        if method != "gguf":
            codes = None
        if codes is not None and codes.kind == "int4":  # (a 4-bit head is rare: as int8g, exactly)
            codes = codes.as_int8g(16 if codes.group_size % 32 else 32)
        if codes is not None:  # the file's own codes
            head.packed = quantized_layer(codes.map(lambda t: t.to(device)), None)
        else:
            head.packed = make_quantized_linear(head.local_weight(), None, head_method, kernel)
    for mod in model.modules():  # layers and LM head: int16 activations, exact-er than bf16 ones,
        if isinstance(mod, Int8Linear):  # and faster at batch 1 (the head and the whole step)
            mod.use_vnni_gemv()
    if hasattr(model, "forget_decode_plans"):  # its cached plans hold the replaced projections
        model.forget_decode_plans()
    count = len(targets) + len(heads)
    logger.info("quantized %d linear layers to %s", count, method)
    return count
