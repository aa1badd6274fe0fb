"""Fused CPU kernels for the decoder's small ops (`csrc/`): RMSNorm (with the residual
add), RoPE, the step's K/V writes into the pool and the decode mirror, decode attention (queries and
output in the model's dtype: no copies around it) and the MLP's silu(gate) * up, each one op instead
of 3-10 aten ops; `small_gemm`, the float32 / bfloat16 projections at decode's batch sizes
(weights in panels of 32 output columns, 12 rows of x against a panel at a time, bfloat16 by AVX512-BF16
dot products; `prepack.py`);
`int8_gemv`, AVX512-VNNI int8 layers and LM head, `int4_gemv`, int4 (GGUF Q4_1) layers at decode's few
rows on int16 activations, also by VNNI, and `int8g_gemv`, int8 codes with a scale and minimum per group
of 16 or 32 (GGUF's 5- to 8-bit types as the file has them) the same way (`quantization.py`); where the CPU has no bfloat16 dot products,
`int4_gemv` takes every row count, and `int8_rows` (AVX2) int8's (for them: no bfloat16 copy). On a CPU with AVX2 but no AVX-512 (AMD before
Zen 4, Intel client cores) each of these has an 8-wide AVX2 path (small_gemm: half panels of 16 columns,
6 rows of x a pass, bfloat16 weights widened by shifts; the integer GEMVs by vpmaddwd), so the
same kernels run there (oneDNN has no bfloat16 path on such a CPU: `prepack.onednn_takes`); `decode_layers_`, a steady decode step's
decoder layers in one op (the same kernels as the layer loop, in its order: models/llama.py), its
fixed arguments in a `DecodePlan` held across steps, and `decode_step`, such a step from token ids
to logits (embedding, layers, final norm, LM head);
`mirror_steady_`, the decode mirror's book-keeping for such a step (decode_mirror.py); `argmax_rows`,
greedy sampling; `bitmask_fill_`, grammar masks on the logits.

At decode batch sizes these ops touch a few KB each, so in eager PyTorch their cost is dispatch
and OpenMP wake-ups; decode attention streams each row's K/V once for all the queries sharing a KV
head (SDPA reads it once per query). The C++ (`csrc/`: `simd.h` shared, one file per kernel family,
`bindings.cpp`) is compiled on the user's machine on first use (`torch.utils.cpp_extension`, cached
under `~/.cache/torch_extensions`; `make setup` does it ahead of time) for `PLAIT_CPU_MARCH`
(default native), each `-march` a build of its own under its own op namespace, so that one process
can load several (the tests run every path the host executes). Where it cannot be built (no
compiler), off x86-64 (unless `PLAIT_CPU_KERNELS=1`), on other devices, or with
`PLAIT_CPU_KERNELS=0`, every function here falls back to the eager PyTorch ops that compute the same
thing — the reference the kernels are tested against. Measured gains: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ...mem_cache.memory_pool import FP8_DTYPES, index_copy_bits_

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()
# ok: the active build loaded; ns: its op namespace; error: why it is not; builds: march -> ns or error
_state: dict[str, object] = {"builds": {}}
_DTYPES = (torch.float32, torch.bfloat16)
_KV_DTYPES = _DTYPES + FP8_DTYPES  # what the pool and the mirror may hold

# The active build's ops (torch.ops.<namespace>); set by load() / use()
ops = None

# cpuinfo flags that select a kernel path (the C++ #if blocks), and what each x86-64 level implies
_V3 = frozenset({"avx2", "fma", "f16c"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512vl"}
_PATH_FLAGS = _V4 | {"avx512_bf16", "avx512_vnni", "amx_bf16"}
_LEVELS = {"x86-64-v4": _V4, "x86-64-v3": _V3, "x86-64": frozenset()}


def default_march() -> str:
    """The ISA the kernels compile for: `PLAIT_CPU_MARCH` (any `-march` value: native, x86-64-v4,
    x86-64-v3, x86-64, ...), native by default."""
    return os.environ.get("PLAIT_CPU_MARCH", "").strip() or "native"


def _cpu_features() -> str:
    """This CPU's feature line (x86 `flags`, ARM `Features`), or the machine name where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def host_paths() -> list[str]:
    """The `-march` values whose kernel paths this host can execute, each a different set of the
    C++ code's ISA blocks: the configured one first, then (on x86-64) every lower level that takes
    other blocks than it: on an AVX-512 host AVX-512 (with BF16 / VNNI where native has them),
    AVX2 and scalar; on an AVX2 host AVX2 and scalar."""
    first = default_march()
    if platform.machine() not in ("x86_64", "AMD64"):
        return [first]
    flags = set(_cpu_features().split())
    native = frozenset(flags & _PATH_FLAGS)
    chosen = [first]
    seen = {_LEVELS.get(first, native if first == "native" else None)}
    for march, need in [("native", native), *_LEVELS.items()]:
        if need <= flags and need not in seen:
            chosen.append(march)
            seen.add(need)
    return chosen


class Unavailable(RuntimeError):
    """The kernels are not built by choice or for want of a compiler (not a build that failed)."""


def _compiler() -> str:
    """The C++ compiler torch's build will run ($CXX, else c++): its first `--version` line."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"no C++ compiler ({cxx}: {e})") from None
    if out.returncode:
        raise Unavailable(f"no working C++ compiler ({cxx} --version exited {out.returncode})")
    return out.stdout.splitlines()[0] if out.stdout else cxx


def build_spec(march: str) -> tuple[str, str, list[str]]:
    """(build name, op namespace, compiler flags) of the kernels for `march`. The name hashes what
    the binary depends on: the sources, compiler, flags, torch and, for native, this CPU's features,
    so that a shared cache never hands one CPU's (or compiler's) build to another."""
    slug = re.sub(r"[^0-9a-zA-Z]+", "_", march).strip("_").lower()
    ns = f"plait_cpu_{slug}"
    cflags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", f"-DPLAIT_NS={ns}"]
    key = hashlib.sha1()
    for part in (_compiler(), " ".join(cflags), torch.__version__, _cpu_features() if march == "native" else ""):
        key.update(part.encode() + b"\0")
    for f in sorted(_CSRC.iterdir()):
        key.update(f.name.encode() + b"\0" + f.read_bytes())
    return f"{ns}_{key.hexdigest()[:10]}", ns, cflags


def _build(march: str) -> str:
    """Compile (once per build name) and load the kernels for `march`; returns their op namespace."""
    from torch.utils import cpp_extension

    name, ns, cflags = build_spec(march)
    sources = sorted(_CSRC.glob("*.cpp"))
    cpp_extension.load(
        name=name,
        sources=[str(f) for f in sources],
        is_python_module=False,
        # -fopenmp: at::parallel_for is inline and runs serially without it; the library then binds
        # to the libgomp.so.1 torch already loaded (one thread pool)
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(_CSRC)],
        verbose=False,
    )
    if not hasattr(getattr(torch.ops, ns), "decode_attention"):
        raise RuntimeError(f"the {march} build registered no ops")
    return ns


def _wanted() -> tuple[bool, str]:
    """Whether to build the kernels at all, and why not: PLAIT_CPU_KERNELS=0 turns them off, =1 on;
    unset they build on x86-64 only, the architecture whose paths the tests cover."""
    flag = os.environ.get("PLAIT_CPU_KERNELS", "auto").strip().lower()
    if flag in ("0", "false", "off", "no"):
        return False, "disabled (PLAIT_CPU_KERNELS=0)"
    if flag in ("auto", "") and platform.machine() not in ("x86_64", "AMD64"):
        return (
            False,
            f"not built on {platform.machine()} (only x86-64's paths are tested; PLAIT_CPU_KERNELS=1 builds them)",
        )
    return True, ""


def build(march: str) -> str | None:
    """The op namespace of the kernels built for `march` (built and loaded once a process), or
    None where they cannot be (the reason in `build_error(march)`)."""
    with _lock:
        builds: dict = _state["builds"]
        if march not in builds:
            wanted, why = _wanted()
            if not wanted:
                builds[march] = Unavailable(why)
            else:
                try:
                    builds[march] = _build(march)
                except Unavailable as e:
                    builds[march] = e
                except Exception as e:  # a failed build: the eager ops still work
                    builds[march] = RuntimeError(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}")
        got = builds[march]
        return got if isinstance(got, str) else None


def build_error(march: str | None = None) -> Exception | None:
    """Why the kernels for `march` (default: the configured one) did not load: an `Unavailable`
    (turned off, not x86-64, no compiler) or the error of a failed build; None if they loaded."""
    got = _state["builds"].get(march or default_march())
    return got if isinstance(got, Exception) else None


def _activate(ns: str | None) -> None:
    global ops
    _state["ok"], _state["ns"] = ns is not None, ns
    ops = getattr(torch.ops, ns) if ns else None


def load() -> bool:
    """Build (once per machine and cache key) and load the kernels for `default_march()`; False,
    with a warning logged once, when they cannot be used. Thread-safe; concurrent processes wait on
    torch's build lock."""
    if "ok" in _state:
        return bool(_state["ok"])
    march = default_march()
    ns = build(march)
    with _lock:
        if "ok" not in _state:
            _activate(ns)
            if ns is None:
                why = build_error(march)
                (logger.info if isinstance(why, Unavailable) else logger.warning)(
                    "fused CPU kernels unavailable (%s); using eager PyTorch ops", why
                )
    return bool(_state["ok"])


@contextlib.contextmanager
def use(march: str) -> Iterator[bool]:
    """Run the block on the kernels built for `march` (for tests: each path this host executes);
    yields whether they loaded. Weights packed for one build (`pack_panels`) must be packed again
    under another: the layouts differ between paths."""
    load()
    before = _state["ns"]
    ns = build(march)
    _activate(ns)
    try:
        yield ns is not None
    finally:
        _activate(before)


def plan_class():
    """The active build's `DecodePlan` class (decode_layers_'s fixed arguments)."""
    return getattr(torch.classes, _state["ns"]).DecodePlan


def enabled(x: torch.Tensor) -> bool:
    """Whether `x`'s op can take the fused kernel: a CPU float32/bfloat16 tensor, kernels built."""
    return x.is_cpu and x.dtype in _DTYPES and _state.get("ok", False) is True  # ~270 calls a step


def kv_enabled(pool: torch.Tensor) -> bool:
    """Whether the kernels that read or write K/V (`kv_write_`, `decode_attention`) take a pool or
    mirror tensor `pool`: on the CPU, float32, bfloat16 or fp8 (e4m3fn, e5m2), kernels built."""
    return pool.is_cpu and pool.dtype in _KV_DTYPES and _state.get("ok", False) is True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with HF's rounding in bfloat16 (normalize in float32, round,
    then scale by the weight in the model's dtype)."""
    if enabled(x) and x.is_contiguous() and weight.dtype == x.dtype:
        return ops.rms_norm(x, weight, eps)
    return _rms_norm_eager(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += delta` in place (the residual stream), then `rms_norm(x)`."""
    if enabled(x) and x.is_contiguous() and delta.is_contiguous() and delta.dtype == weight.dtype == x.dtype:
        return ops.add_rms_norm_(x, delta, weight, eps)
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
        ops.rope_(x, cos, sin, heads, head_dim)
        return
    part = x[:, : heads * head_dim].view(-1, heads, head_dim)
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    half = head_dim // 2
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    part.copy_(part * c + rotated * s)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row: q `[n, H, D]` (float32 or bfloat16, any strides), k/v
    `[>=n, KVH, >=L, D]` (views allowed; rows past n are ignored), row b attending to its first
    `lens[b]` keys (`lens` may be longer than n); with `rows` (int64 `[n]`), row b attends K/V row
    `rows[b]` and its first `lens[rows[b]]` keys. Sums in float32 (bfloat16 q and keys: the scores
    by bfloat16 dot products, exact products); returns `[n, H, D]` in q's dtype."""
    if kv_enabled(k) and enabled(q):
        return ops.decode_attention(q, k, v, lens, scale, rows)
    n, heads, dim = q.shape
    if rows is None:
        k, v, lens = k[:n], v[:n], lens[:n]
    else:
        k, v, lens = k[rows], v[rows], lens[rows]
    length = int(lens.max()) if lens.numel() else 0
    keys, values = k[:, :, :length].float(), v[:, :, :length].float()
    mask = torch.zeros((n, 1, 1, length))
    mask.masked_fill_(torch.arange(length)[None, None, None, :] >= lens[:, None, None, None], float("-inf"))
    q4 = q.float().reshape(n, k.shape[1], heads // k.shape[1], dim)  # GQA: a KV head's queries as its query length
    out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=mask, scale=scale)
    return out.view(n, heads, dim).to(q.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the merged projection's output `[T, 2I]` (gate then up) -> `[T, I]`,
    with the eager model's rounding in bfloat16 (silu rounded before the product)."""
    if enabled(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return ops.silu_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def kv_write_(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mirror_k: torch.Tensor | None = None,
    mirror_v: torch.Tensor | None = None,
    mirror_at: torch.Tensor | None = None,
) -> None:
    """Write this step's k/v `[T, KVH, D]` into pool slots `slots` (cast to the pool's dtype) and,
    with `mirror_at`, also into the contiguous mirror buffers viewed as rows of D: token t's head h
    to row `mirror_at[t * KVH + h]`. One op instead of six."""
    if enabled(k) and kv_enabled(pool_k):
        ops.kv_write_(pool_k, pool_v, slots, k, v, mirror_k, mirror_v, mirror_at)
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
    if (
        _state.get("ok", False) is True
        and x.is_cpu
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.is_contiguous()
        and 0 < x.shape[1] < 2**31
    ):
        return ops.argmax_rows(x)
    return x.argmax(dim=-1)


def bitmask_fill_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """In place: logits[rows[j], t] = -inf where bit t of packed int32 bitmask[j] is 0 (and for t
    past it), the other rows untouched: the grammar masks of a batch's constrained rows, several
    times faster than `plait.grammar.apply_token_bitmask_`'s table add over every row. False (and
    nothing done) where the kernels do not run: the caller applies the masks itself."""
    if not (
        _state.get("ok", False) is True
        and logits.is_cpu
        and logits.dtype in _DTYPES
        and logits.dim() == 2
        and logits.is_contiguous()
        and bitmask.is_cpu
        and bitmask.dtype == torch.int32
        and bitmask.is_contiguous()
        and rows.dtype == torch.int64
    ):
        return False
    ops.bitmask_fill_(logits, bitmask, rows)
    return True


# decode_layers_'s parts, in the order `decode_profile` returns them
DECODE_PARTS = ("norms", "qkv", "rope+kv", "attention", "o", "gate_up", "silu", "down")


def decode_profile_start() -> bool:
    """Start timing `decode_layers_` by part (zeroed); False where the kernels do not run."""
    if _state.get("ok", False) is not True:
        return False
    ops.decode_profile_(True)
    return True


def decode_profile_stop() -> tuple[int, dict[str, float]]:
    """Stop timing; (`decode_layers_` calls timed, seconds per part summed over them)."""
    got = ops.decode_profile().tolist()
    ops.decode_profile_(False)
    return int(got[0]), {part: us / 1e6 for part, us in zip(DECODE_PARTS, got[1:])}


def int8_gemv_available() -> bool:
    """Whether `ops.int8_gemv` runs here: kernels built (`load()` called) for a
    CPU with AVX512-VNNI or AVX2."""
    return _state.get("ok", False) is True and bool(ops.has_int_gemv())


def int4_gemv_available() -> bool:
    """Whether `ops.int4_gemv` (int4 weights packed by `int4_gemv_pack`, any rows)
    runs here: the same condition as `int8_gemv`'s."""
    return int8_gemv_available()


def int4_gemv_all_rows() -> bool:
    """Whether `int4_gemv` beats a bfloat16 copy of the weights at every row count here, not only at
    decode's few: where it runs and the CPU has no bfloat16 dot products (AVX512-BF16, AMX)."""
    return int4_gemv_available() and bool(ops.int4_gemv_all_rows())


def int8_rows_available() -> bool:
    """Whether `ops.int8_rows` (int8 weights packed by `int8_rows_pack`, any rows)
    runs here: kernels built for a CPU with AVX2 and no AVX-512 (there int8_gemv and the bfloat16
    copy serve)."""
    return _state.get("ok", False) is True and bool(ops.has_int8_rows())


def int8_rows_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 weights `[N, K]` (N a multiple of 16, K of 64) in `int8_rows`' layout: `[N/16, K/2, 32]`,
    per block of 16 outputs and pair of k, output i's two weights at bytes 2i, 2i + 1."""
    n, k = q.shape
    if n % 16 or k % 64:
        raise ValueError(f"int8_rows_pack: N ({n}) must be a multiple of 16 and K ({k}) of 64")
    return q.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()


def small_gemm_available(dtype: torch.dtype) -> bool:
    """Whether `ops.small_gemm` (any number of rows on weights packed by `pack_panels`)
    runs here for `dtype`: kernels built (`load()` called) for a CPU with AVX512BW/VL (and AVX512-BF16 for
    bfloat16) or with AVX2."""
    return _state.get("ok", False) is True and dtype in _DTYPES and bool(ops.has_small_gemm(dtype == torch.bfloat16))


def _bf16_k_pairs() -> bool:
    return not load() or bool(ops.bf16_panels_k_pairs())


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
    q6 = q.reshape(n // 16, 16, g, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)  # [blocks, g, s, j, i, half]
    codes = (q6[..., 0] | (q6[..., 1] << 4)).reshape(n // 16, g, 256)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [blocks, G, 32 bytes] of fp16
        return t.to(torch.float16).reshape(n // 16, 16, g).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([codes, per_group(scale), per_group(minimum)], dim=-1).contiguous()


def int8g_gemv_pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> torch.Tensor:
    """The weight `W[n, k] = scale[n, g] * q[n, k] + minimum[n, g]` (int8 codes `q` `[N, K]`, groups g
    of G = 16 or 32 along K, G = K / scale columns, N a multiple of 16; no minimum: zeros) in
    `int8g_gemv`'s layout: uint8 `[N/16, K/G, 16 G + 128]`, per block of 16 rows and group the codes
    (chunks of 32 bytes, row i's codes for k = 2p, 2p + 1 at bytes 2i, 2i + 1 of chunk p), then the 16
    scales and 16 minimums as float32."""
    n, k = q.shape
    groups = scale.shape[1]
    g = k // groups if groups else 0
    if n % 16 or g not in (16, 32) or g * groups != k:
        raise ValueError(f"int8g_gemv_pack: N ({n}) must be a multiple of 16 and K ({k}) of 16 or 32 scales")
    codes = (
        q.view(torch.uint8)
        .reshape(n // 16, 16, groups, g // 2, 2)
        .permute(0, 2, 3, 1, 4)
        .reshape(n // 16, groups, 16 * g)
    )

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [blocks, G, 64 bytes] of float32
        return t.float().reshape(n // 16, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)

    low = torch.zeros_like(scale) if minimum is None else minimum
    return torch.cat([codes, per_group(scale), per_group(low)], dim=-1).contiguous()


def main() -> None:
    """`python -m plait.runtime.kernels.cpu.cpu_kernels`: build the kernels for every path this host executes
    (`make setup` does, so that neither a server's start nor the tests wait on the compiler)."""
    for march in host_paths():
        ok = build(march) is not None
        print(f"fused CPU kernels, -march={march}: {'built' if ok else build_error(march)}", flush=True)


if __name__ == "__main__":
    main()
