"""Fused CPU kernels for the decoder's small ops (`csrc/cpu_kernels.cpp`): RMSNorm (with the residual
add), RoPE, the step's K/V writes into the pool and the decode mirror, decode attention (queries and
output in the model's dtype: no copies around it) and the MLP's silu(gate) * up, each one op instead
of 3-10 aten ops; `small_gemm`, the float32 / bfloat16 projections at decode's batch sizes
(weights in panels of 32 output columns, 12 rows of x against a panel at a time, bfloat16 by AVX512-BF16
dot products; `prepack.py`);
`int8_gemv`, AVX512-VNNI int8 layers and LM head, and `int4_gemv`, int4 (GGUF Q4_1) layers at decode's few
rows on int16 activations, also by VNNI (`quantization.py`); where the CPU has no bfloat16 dot products,
`int4_gemv` takes every row count, and `int8_rows` (AVX2) int8's (for them: no bfloat16 copy). On a CPU with AVX2 but no AVX-512 (AMD before
Zen 4, Intel client cores) each of these has an 8-wide AVX2 path (small_gemm: half panels of 16 columns,
6 rows of x a pass, bfloat16 weights widened by shifts; the integer GEMVs by vpmaddwd), so the
same kernels run there (oneDNN has no bfloat16 path on such a CPU: `prepack.onednn_takes`); `decode_layers_`, a steady decode step's
decoder layers in one op (the same kernels as the layer loop, in its order: models/llama.py), its
fixed arguments in a `DecodePlan` held across steps, and `decode_step`, such a step from token ids
to logits (embedding, layers, final norm, LM head);
`mirror_steady_`, the decode mirror's book-keeping for such a step (decode_mirror.py); `argmax_rows`,
greedy sampling.

At decode batch sizes these ops touch a few KB each, so in eager PyTorch their cost is dispatch
and OpenMP wake-ups; decode attention streams each row's K/V once for all the queries sharing a KV
head (SDPA: 3 queries per head on SmolLM2, ~2x slower at every size measured: 1 row x 80 keys
22 vs 11 us, 8 x 200 156 vs 70, 32 x 200 478 vs 207, 32 x 1000 3125 vs 1937; float32, 2 threads).
Whole SmolLM2 decode steps, kernels off vs on in one process (rounds alternating, load 1.2-1.6):
float32 batch 1 26.5 -> 24.1 ms, batch 32 100.2 -> 83.6; bfloat16 + int4 batch 1 17.5 -> 13.9,
batch 32 70.9 -> 57.3. The C++ source is compiled
once per machine on first use (`torch.utils.cpp_extension`, ~12 s here, cached under
`~/.cache/torch_extensions`; `make setup` does it ahead of time). Where it cannot be built (no
compiler), on other devices, or with `PLAIT_CPU_KERNELS=0`, every function here falls back to the
eager PyTorch ops that compute the same thing — the reference the kernels are tested against.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .memory_pool import FP8_DTYPES, index_copy_bits_

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}
_DTYPES = (torch.float32, torch.bfloat16)
_KV_DTYPES = _DTYPES + FP8_DTYPES   # what the pool and the mirror may hold


def _cpu_tag() -> str:
    """The build uses -march=native: a cache shared by different CPUs must not share the binary."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def load() -> bool:
    """Build (once per machine) and load the kernels; False, with a warning logged once, when
    they cannot be used. Thread-safe; concurrent processes wait on torch's build lock."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if os.environ.get("PLAIT_CPU_KERNELS", "1") == "0":
            logger.info("fused CPU kernels disabled (PLAIT_CPU_KERNELS=0)")
        else:
            try:
                from torch.utils import cpp_extension
                cpp_extension.load(
                    name=f"plait_cpu_kernels_{_cpu_tag()}", sources=[str(_SOURCE)], is_python_module=False,
                    # -fopenmp: at::parallel_for is inline and runs serially without it; the
                    # library then binds to the libgomp.so.1 torch already loaded (one thread pool)
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
                ok = hasattr(torch.ops.plait_cpu, "decode_attention")
            except Exception as e:   # no compiler / ninja / headers: the eager ops still work
                logger.warning("fused CPU kernels unavailable (%s: %s); using eager PyTorch ops",
                               type(e).__name__, str(e).strip().splitlines()[-1:] or "")
        _state["ok"] = ok
        return ok


def enabled(x: torch.Tensor) -> bool:
    """Whether `x`'s op can take the fused kernel: a CPU float32/bfloat16 tensor, kernels built."""
    return x.is_cpu and x.dtype in _DTYPES and _state.get("ok", False) is True   # ~270 calls a step


def kv_enabled(pool: torch.Tensor) -> bool:
    """Whether the kernels that read or write K/V (`kv_write_`, `decode_attention`) take a pool or
    mirror tensor `pool`: on the CPU, float32, bfloat16 or fp8 (e4m3fn, e5m2), kernels built."""
    return pool.is_cpu and pool.dtype in _KV_DTYPES and _state.get("ok", False) is True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with HF's rounding in bfloat16 (normalize in float32, round,
    then scale by the weight in the model's dtype)."""
    if enabled(x) and x.is_contiguous() and weight.dtype == x.dtype:
        return torch.ops.plait_cpu.rms_norm(x, weight, eps)
    return _rms_norm_eager(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += delta` in place (the residual stream), then `rms_norm(x)`."""
    if enabled(x) and x.is_contiguous() and delta.is_contiguous() and delta.dtype == weight.dtype == x.dtype:
        return torch.ops.plait_cpu.add_rms_norm_(x, delta, weight, eps)
    x.add_(delta)
    return _rms_norm_eager(x, weight, eps)


def _rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate-half RoPE (HF layout), in place, on the first `heads` heads of each row of `x`
    `[tokens, width]`; `cos`/`sin` are float32 `[tokens, head_dim]` (rounded to `x`'s dtype
    first, as HF does)."""
    if enabled(x) and x.stride(-1) == 1:
        torch.ops.plait_cpu.rope_(x, cos, sin, heads, head_dim)
        return
    part = x[:, :heads * head_dim].view(-1, heads, head_dim)
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    half = head_dim // 2
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    part.copy_(part * c + rotated * s)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                     scale: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row: q `[n, H, D]` (float32 or bfloat16, any strides), k/v
    `[>=n, KVH, >=L, D]` (views allowed; rows past n are ignored), row b attending to its first
    `lens[b]` keys (`lens` may be longer than n); with `rows` (int64 `[n]`), row b attends K/V row
    `rows[b]` and its first `lens[rows[b]]` keys. Sums in float32 (bfloat16 q and keys: the scores
    by bfloat16 dot products, exact products); returns `[n, H, D]` in q's dtype."""
    if kv_enabled(k) and enabled(q):
        return torch.ops.plait_cpu.decode_attention(q, k, v, lens, scale, rows)
    n, heads, dim = q.shape
    if rows is None:
        k, v, lens = k[:n], v[:n], lens[:n]
    else:
        k, v, lens = k[rows], v[rows], lens[rows]
    length = int(lens.max()) if lens.numel() else 0
    keys, values = k[:, :, :length].float(), v[:, :, :length].float()
    mask = torch.zeros((n, 1, 1, length))
    mask.masked_fill_(torch.arange(length)[None, None, None, :] >= lens[:, None, None, None], float("-inf"))
    q4 = q.float().reshape(n, k.shape[1], heads // k.shape[1], dim)   # GQA: a KV head's queries as its query length
    out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=mask, scale=scale)
    return out.view(n, heads, dim).to(q.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the merged projection's output `[T, 2I]` (gate then up) -> `[T, I]`,
    with the eager model's rounding in bfloat16 (silu rounded before the product)."""
    if enabled(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return torch.ops.plait_cpu.silu_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def kv_write_(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mirror_k: torch.Tensor | None = None, mirror_v: torch.Tensor | None = None,
              mirror_at: torch.Tensor | None = None) -> None:
    """Write this step's k/v `[T, KVH, D]` into pool slots `slots` (cast to the pool's dtype) and,
    with `mirror_at`, also into the contiguous mirror buffers viewed as rows of D: token t's head h
    to row `mirror_at[t * KVH + h]`. One op instead of six."""
    if enabled(k) and kv_enabled(pool_k):
        torch.ops.plait_cpu.kv_write_(pool_k, pool_v, slots, k, v, mirror_k, mirror_v, mirror_at)
        return
    index_copy_bits_(pool_k, slots, k.to(pool_k.dtype))
    index_copy_bits_(pool_v, slots, v.to(pool_v.dtype))
    if mirror_at is not None:
        dim = k.shape[-1]
        index_copy_bits_(mirror_k.view(-1, dim), mirror_at, k.to(mirror_k.dtype).reshape(-1, dim))
        index_copy_bits_(mirror_v.view(-1, dim), mirror_at, v.to(mirror_v.dtype).reshape(-1, dim))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of float32 logits `[rows, n]` (the first index of each row's maximum, NaN
    counting as the maximum), ~5x faster than torch's on the CPU."""
    if _state.get("ok", False) is True and x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 \
            and x.is_contiguous() and 0 < x.shape[1] < 2 ** 31:
        return torch.ops.plait_cpu.argmax_rows(x)
    return x.argmax(dim=-1)


# decode_layers_'s parts, in the order `decode_profile` returns them
DECODE_PARTS = ("norms", "qkv", "rope+kv", "attention", "o", "gate_up", "silu", "down")


def decode_profile_start() -> bool:
    """Start timing `decode_layers_` by part (zeroed); False where the kernels do not run."""
    if _state.get("ok", False) is not True:
        return False
    torch.ops.plait_cpu.decode_profile_(True)
    return True


def decode_profile_stop() -> tuple[int, dict[str, float]]:
    """Stop timing; (`decode_layers_` calls timed, seconds per part summed over them)."""
    got = torch.ops.plait_cpu.decode_profile().tolist()
    torch.ops.plait_cpu.decode_profile_(False)
    return int(got[0]), {part: us / 1e6 for part, us in zip(DECODE_PARTS, got[1:])}


def int8_gemv_available() -> bool:
    """Whether `torch.ops.plait_cpu.int8_gemv` runs here: kernels built (`load()` called) for a
    CPU with AVX512-VNNI or AVX2."""
    return _state.get("ok", False) is True and bool(torch.ops.plait_cpu.has_int_gemv())


def int4_gemv_available() -> bool:
    """Whether `torch.ops.plait_cpu.int4_gemv` (int4 weights packed by `int4_gemv_pack`, any rows)
    runs here: the same condition as `int8_gemv`'s."""
    return int8_gemv_available()


def int4_gemv_all_rows() -> bool:
    """Whether `int4_gemv` beats a bfloat16 copy of the weights at every row count here, not only at
    decode's few: where it runs and the CPU has no bfloat16 dot products (AVX512-BF16, AMX)."""
    return int4_gemv_available() and bool(torch.ops.plait_cpu.int4_gemv_all_rows())


def int8_rows_available() -> bool:
    """Whether `torch.ops.plait_cpu.int8_rows` (int8 weights packed by `int8_rows_pack`, any rows)
    runs here: kernels built for a CPU with AVX2 and no AVX-512 (there int8_gemv and the bfloat16
    copy serve)."""
    return _state.get("ok", False) is True and bool(torch.ops.plait_cpu.has_int8_rows())


def int8_rows_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 weights `[N, K]` (N a multiple of 16, K of 64) in `int8_rows`' layout: `[N/16, K/2, 32]`,
    per block of 16 outputs and pair of k, output i's two weights at bytes 2i, 2i + 1."""
    n, k = q.shape
    if n % 16 or k % 64:
        raise ValueError(f"int8_rows_pack: N ({n}) must be a multiple of 16 and K ({k}) of 64")
    return q.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()


def small_gemm_available(dtype: torch.dtype) -> bool:
    """Whether `torch.ops.plait_cpu.small_gemm` (any number of rows on weights packed by `pack_panels`)
    runs here for `dtype`: kernels built (`load()` called) for a CPU with AVX512BW/VL (and AVX512-BF16 for
    bfloat16) or with AVX2."""
    return (_state.get("ok", False) is True and dtype in _DTYPES
            and bool(torch.ops.plait_cpu.has_small_gemm(dtype == torch.bfloat16)))


def _bf16_k_pairs() -> bool:
    return not load() or bool(torch.ops.plait_cpu.bf16_panels_k_pairs())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 / bfloat16 weight `[N, K]` in `small_gemm`'s panels of 32 output columns, k-major:
    float32 `[ceil(N/32), K, 32]`; bfloat16 `[ceil(N/32), K/2, 32, 2]` (pairs of k, as AVX512-BF16's
    dot product takes them; K must be even) or, where small_gemm runs on AVX2, `[ceil(N/32), K, 32]`
    as float32's; the last panel's missing columns are zeros."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16 and _bf16_k_pairs()
    if pairs and k % 2:
        raise ValueError(f"pack_panels: a bfloat16 weight needs an even K, got {k}")
    w = weight.detach()
    pad = -n % 32
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    panels = w.reshape(-1, 32, k)
    if pairs:
        return panels.reshape(-1, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return panels.transpose(1, 2).contiguous()


def int4_gemv_pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The weight `W[n, k] = scale[n, g] * q[n, k] + minimum[n, g]` (4-bit codes `q` uint8 `[N, K]`,
    groups g of 32 along K, N a multiple of 16) in `int4_gemv`'s layout: uint8 `[N/16, K/32, 320]`,
    per block of 16 rows and group 256 bytes of codes then the 16 scales and 16 minimums as fp16
    (see the kernel's comment in csrc/cpu_kernels.cpp)."""
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"int4_gemv_pack: N ({n}) must be a multiple of 16 and K ({k}) of 32")
    g = k // 32
    # k = 32 g + 4 s + 2 half + i: byte (s, row j, i) holds half 0 in its low nibble, half 1 in its high
    q6 = q.reshape(n // 16, 16, g, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)          # [blocks, g, s, j, i, half]
    codes = (q6[..., 0] | (q6[..., 1] << 4)).reshape(n // 16, g, 256)

    def per_group(t: torch.Tensor) -> torch.Tensor:   # [N, G] -> [blocks, G, 32 bytes] of fp16
        return t.to(torch.float16).reshape(n // 16, 16, g).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([codes, per_group(scale), per_group(minimum)], dim=-1).contiguous()
