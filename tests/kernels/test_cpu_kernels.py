"""The fused CPU kernels (runtime/kernels/cpu/csrc/) against the eager PyTorch ops they replace:
bfloat16 bit for bit where nothing is summed (HF's rounding at every step), float32 and the
norms to summation-order noise, decode
attention against SDPA over padded rows and strided views, for the vectorized (head_dim 64) and
the plain (head_dim 8) paths, serial and split across threads. Every test runs once for each ISA
path this host can execute (`cpu_kernels.host_paths()`: native, then AVX-512, AVX2, scalar builds as
the CPU allows), each build loaded side by side under its own op namespace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import decode_logits, require_kernels, skip_without_fused_op

from plait.runtime.kernels.cpu import cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True, params=cpu_kernels.host_paths())
def kernels(request):
    """The module's tests on the build for one `-march` path. Where no build is wanted (kernels
    off, not x86-64) or no compiler is found, they skip with the reason; a build that fails on a
    host with a compiler is a failure, not a silent fallback."""
    require_kernels(request.param)
    with cpu_kernels.use(request.param):
        yield request.param


def eager(fn, *args):
    """`fn` through its eager PyTorch fallback."""
    saved = cpu_kernels._state["ok"]
    cpu_kernels._state["ok"] = False
    try:
        return fn(*args)
    finally:
        cpu_kernels._state["ok"] = saved


def assert_same(got: torch.Tensor, ref: torch.Tensor, reduced: bool = False) -> None:
    """bfloat16: equal; after a reduction (`reduced`), whose float32 sum runs in another order,
    a value may sit a bfloat16 step or two away (the step, then the weight), rarely. float32:
    summation-order noise."""
    if got.dtype != torch.bfloat16:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    elif not reduced:
        assert torch.equal(got, ref), f"{(got != ref).sum().item()} of {got.numel()} bfloat16 values differ"
    else:
        off = got != ref
        assert off.float().mean() < 1e-3, f"{off.sum().item()} of {got.numel()} bfloat16 values differ"
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-6, atol=0)  # <= 2 steps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 300])  # 300: split across threads
def test_rms_norm_and_residual_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=g)).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    assert_same(cpu_kernels.rms_norm(x, w, 1e-5), eager(cpu_kernels.rms_norm, x, w, 1e-5), reduced=True)
    x_kernel, x_eager = x.clone(), x.clone()
    y = cpu_kernels.add_rms_norm_(x_kernel, delta, w, 1e-5)
    assert_same(y, eager(cpu_kernels.add_rms_norm_, x_eager, delta, w, 1e-5), reduced=True)
    assert torch.equal(x_kernel, x_eager) and torch.equal(x_kernel, x + delta)  # the residual, in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 200])
def test_rope_in_place_on_q_and_k_only(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (tokens,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    got, ref = qkv.clone(), qkv.clone()
    cpu_kernels.rope_(got, cos, sin, heads + kv_heads, d)
    eager(cpu_kernels.rope_, ref, cos, sin, heads + kv_heads, d)
    assert_same(got, ref)
    assert torch.equal(got[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])  # v untouched
    assert not torch.equal(got[:, :d], qkv[:, :d])


def sdpa_reference(q, k, v, lens, scale):
    """Per row: plain SDPA over its first lens[b] keys, KV heads repeated (no GQA folding)."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        keys = k[b, :, :n].float().repeat_interleave(groups, 0)
        values = v[b, :, :n].float().repeat_interleave(groups, 0)
        out.append(F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 8])  # the AVX-512 paths and the plain one
@pytest.mark.parametrize("rows,length", [(1, 37), (1, 700), (3, 300), (8, 1000)])  # (1, 700): keys split in two
# queries per KV head: 3 (SmolLM2), 1, 2, and 8 (scores in blocks of 3 + 3 + 2; values unrolled or not)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 4), (16, 2)])
def test_decode_attention_matches_sdpa(kv_dtype, head_dim, rows, length, heads, kv_heads):
    g = torch.Generator().manual_seed(rows * length + head_dim)
    # Views into larger buffers, as the decode mirror hands them over: strided rows and positions.
    big_k = torch.randn(rows + 2, kv_heads, length + 50, head_dim, generator=g).to(kv_dtype)
    big_v = torch.randn(rows + 2, kv_heads, length + 50, head_dim, generator=g).to(kv_dtype)
    k, v = big_k[:rows, :, :length], big_v[:rows, :, :length]
    q = torch.randn(rows, heads, head_dim, generator=g)
    lens = torch.randint(1, length + 1, (rows,), generator=g)
    lens[0] = length
    scale = head_dim**-0.5
    got = cpu_kernels.decode_attention(q, k, v, lens, scale)
    torch.testing.assert_close(got, sdpa_reference(q, k, v, lens, scale), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        eager(cpu_kernels.decode_attention, q, k, v, lens, scale),
        sdpa_reference(q, k, v, lens, scale),
        rtol=1e-5,
        atol=1e-5,
    )


def test_decode_attention_split_keys_merge_exactly_enough():
    """Few (row, KV head) tasks for the threads: keys split into up to 8 parts, merged by their
    softmax statistics; parts with no keys (a short row next to a long one) count for nothing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        g = torch.Generator().manual_seed(5)
        k, v = (torch.randn(2, 1, 1100, 64, generator=g) for _ in range(2))
        q = torch.randn(2, 2, 64, generator=g)
        lens = torch.tensor([1100, 3])
        got = cpu_kernels.decode_attention(q, k, v, lens, 0.125)
        torch.testing.assert_close(got, sdpa_reference(q, k, v, lens, 0.125), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


# (64, 9, 3): SmolLM2; (128, 6, 2) and (64, 16, 2): other widths and groups; (1, 700): keys split
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 6, 2), (64, 16, 2)])
@pytest.mark.parametrize("rows,length", [(1, 37), (3, 301), (1, 700)])
def test_decode_attention_in_bfloat16_matches_sdpa(head_dim, heads, kv_heads, rows, length):
    """bfloat16 q and K/V (a bfloat16 model's): the scores by bfloat16 dot products, exact products
    summed in float32, so the output is the float32 result rounded (to within a step)."""
    g = torch.Generator().manual_seed(rows * length + head_dim + heads)
    k, v = (torch.randn(rows, kv_heads, length + 9, head_dim, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(rows, heads, head_dim, generator=g).bfloat16()
    lens = torch.randint(1, length + 1, (rows,), generator=g)
    lens[0] = length
    scale = head_dim**-0.5
    got = cpu_kernels.decode_attention(q, k, v, lens, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), sdpa_reference(q.float(), k, v, lens, scale), rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_each_rows_own_kv_row(dtype):
    """`rows`: batch row b attends K/V row rows[b] with lens[rows[b]], as a decode mirror holding
    the batch in another order hands them over."""
    g = torch.Generator().manual_seed(9)
    k, v = (torch.randn(6, 3, 60, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(4, 9, 64, generator=g).to(dtype)
    lens = torch.tensor([50, 7, 33, 1, 20, 45])
    rows = torch.tensor([3, 0, 5, 2])
    want = cpu_kernels.decode_attention(q, k[rows], v[rows], lens[rows], 0.125)
    assert torch.equal(cpu_kernels.decode_attention(q, k, v, lens, 0.125, rows), want)
    torch.testing.assert_close(
        eager(cpu_kernels.decode_attention, q, k, v, lens, 0.125, rows),
        want,
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
    )
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.decode_attention(q, k, v, lens, 0.125, torch.tensor([3, 0, 6, 2]))


def test_decode_attention_rejects_bad_lengths():
    q, k = torch.randn(1, 9, 64), torch.randn(1, 3, 10, 64)
    with pytest.raises(RuntimeError, match="exceeds its keys"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([11]), 0.125)


def test_non_contiguous_and_other_devices_fall_back():
    x = torch.randn(4, 2 * 576)[:, ::2]  # a strided view: the eager op takes it
    w = torch.rand(576)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5))
    assert not cpu_kernels.enabled(torch.randn(2, dtype=torch.float16))
    assert not cpu_kernels.enabled(torch.randn(2, device="meta"))


@pytest.mark.parametrize("q_dtype", DTYPES)
def test_decode_attention_takes_strided_queries_and_keeps_their_dtype(q_dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 15 * 64, generator=g).to(q_dtype)  # q is the first 9 heads of each row
    q = qkv[:, : 9 * 64].view(4, 9, 64)
    k, v = torch.randn(4, 3, 40, 64, generator=g), torch.randn(4, 3, 40, 64, generator=g)
    lens = torch.tensor([40, 3, 17, 1])
    got = cpu_kernels.decode_attention(q, k, v, lens, 0.125)
    assert got.dtype == q_dtype and got.shape == (4, 9, 64)
    ref = sdpa_reference(q.float(), k, v, lens, 0.125).to(q_dtype)
    torch.testing.assert_close(got, ref, rtol=1e-5 if q_dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("model_dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("mirror", [True, False])
def test_kv_write_matches_index_copy(model_dtype, kv_dtype, mirror):
    g = torch.Generator().manual_seed(2)
    tokens, heads, d = 5, 3, 64
    qkv = torch.randn(tokens, 15 * d, generator=g).to(model_dtype)  # k, v as views, like the model's
    k, v = qkv[:, 9 * d : 12 * d].view(tokens, heads, d), qkv[:, 12 * d :].view(tokens, heads, d)
    slots = torch.tensor([7, 0, 99, 3, 42])
    at = torch.randperm(6 * heads * 16, generator=g)[: tokens * heads] if mirror else None
    outs = []
    for fn in (cpu_kernels.kv_write_, lambda *a: eager(cpu_kernels.kv_write_, *a)):
        pool_k, pool_v = torch.zeros(100, heads, d, dtype=kv_dtype), torch.zeros(100, heads, d, dtype=kv_dtype)
        mk, mv = (torch.zeros(6, heads, 16, d, dtype=kv_dtype) for _ in range(2))
        fn(pool_k, pool_v, slots, k, v, mk if mirror else None, mv if mirror else None, at)
        outs.append((pool_k, pool_v, mk, mv))
    for got, ref in zip(*outs):
        assert torch.equal(got, ref)
    pool_k, _, mk, _ = outs[0]
    assert torch.equal(pool_k[slots], k.to(kv_dtype))
    if mirror:
        assert torch.equal(mk.view(-1, d)[at], k.to(kv_dtype).reshape(-1, d))


def test_kv_write_rejects_out_of_range_slots():
    pool = torch.zeros(4, 3, 64)
    k = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.kv_write_(pool, pool.clone(), torch.tensor([4]), k, k)


@pytest.mark.parametrize("rows", [1, 3, 8, 19])  # past 8: blocks of 8 rows, then the rest
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_int8_gemv_is_the_exact_product_up_to_int16_activations(rows, x_dtype):
    if not cpu_kernels.int8_gemv_available():
        pytest.skip("no AVX512-VNNI or AVX2")
    g = torch.Generator().manual_seed(rows)
    w = torch.randint(-127, 128, (1000, 576), dtype=torch.int8, generator=g)
    scale = torch.rand(1000, generator=g) / 50
    x = (torch.randn(rows, 576, generator=g) * torch.rand(576, generator=g) * 10).to(x_dtype)  # uneven channels
    got = cpu_kernels.ops.int8_gemv(x, w, scale)
    ref = (x.double() @ w.double().t()) * scale.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 1e-4  # bfloat16 activations: ~4e-3


@pytest.mark.parametrize("rows", [1, 6, 9, 33])  # blocks of 6 rows, then the rest
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_int8_rows_is_int8_gemv_in_another_layout(rows, x_dtype):
    if not cpu_kernels.int8_rows_available():
        pytest.skip("int8_rows: AVX2 without AVX-512 only")
    g = torch.Generator().manual_seed(rows)
    w = torch.randint(-127, 128, (96, 640), dtype=torch.int8, generator=g)
    scale = torch.rand(96, generator=g) / 50
    x = (torch.randn(rows, 640, generator=g) * torch.rand(640, generator=g) * 10).to(x_dtype)
    packed = cpu_kernels.int8_rows_pack(w)
    assert packed.shape == (6, 320, 32) and torch.equal(packed[1, 3, 4:6], w[18, 6:8])  # output 16 + 2, k 6-7
    got = cpu_kernels.ops.int8_rows(x, packed, scale)
    ref = (x.double() @ w.double().t()) * scale.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 1e-4  # int16 activations, as int8_gemv
    # the same int32 block sums as int8_gemv's: equal up to float32 summation order
    torch.testing.assert_close(
        got, cpu_kernels.ops.int8_gemv(x, w, scale), rtol=1e-5, atol=1e-5 * ref.abs().max().item()
    )
    with pytest.raises(RuntimeError, match=r"\[M >= 1, K\]"):
        cpu_kernels.ops.int8_rows(x[:, :64], packed, scale)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.int8_rows_pack(w[:40])


def test_int8_linear_vnni_gemv_rows():
    from plait.runtime.layers.quantization import Int8Linear

    lin = Int8Linear(torch.randn(256, 128), None)
    x = torch.randn(2, 128)
    weight_only = lin(x.bfloat16()).float()
    if not lin.use_vnni_gemv():
        pytest.skip("no AVX512-VNNI or AVX2")
    got = lin(x)
    ref = x @ lin.dequantized().t()
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * (weight_only - ref).abs().max()  # closer than bf16 activations
    many = torch.randn(9, 128)  # int8_rows, where it runs, takes every row count (the bf16 copy is dropped)
    assert (lin.packed_rows is not None) == cpu_kernels.int8_rows_available() and (lin.packed_bf16 is None) == (
        lin.packed_rows is not None
    )
    if lin.packed_rows is not None:
        ref9 = many @ lin.dequantized().t()
        assert (lin(many) - ref9).abs().max() < 1e-4 * ref9.abs().max()
    assert lin(many).shape == (9, 256) and lin(many.reshape(3, 3, 128)).shape == (3, 3, 256)
    assert lin(torch.randn(0, 128)).shape == (0, 256)  # no rows (a step with no logits to take)


@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 32, 64, 200])  # row blocks of up to 12: 1, 2, 3, 6, 17
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(96, 64), (1000, 200), (64, 576), (48, 63)])  # 1000: a last panel of 8 columns
def test_small_gemm_matches_linear(rows, dtype, n, k):
    if not cpu_kernels.small_gemm_available(dtype):
        pytest.skip("no AVX512BW/VL (or BF16) or AVX2")
    if k % 2 and dtype == torch.bfloat16 and cpu_kernels.ops.bf16_panels_k_pairs():
        pytest.skip("AVX512-BF16's panels hold pairs of k")
    g = torch.Generator().manual_seed(rows * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    panels = cpu_kernels.pack_panels(w)
    assert panels.shape[0] == -(-n // 32) and panels.numel() == panels.shape[0] * 32 * k
    for b in (None, bias):
        got = cpu_kernels.ops.small_gemm(x, panels, b, n)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == dtype and got.shape == (rows, n)
        if dtype == torch.float32:  # float32 sums in another order
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
        else:  # exact products, float32 sums, one bfloat16 rounding of the output
            torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-3)
        widened = cpu_kernels.ops.small_gemm(x, panels, b, n, True)  # the same values, as float32
        assert widened.dtype == torch.float32 and torch.equal(widened, got.float())


def test_small_gemm_rejects_what_it_does_not_take():
    w = torch.randn(40, 64)
    panels = cpu_kernels.pack_panels(w)
    assert panels.shape == (2, 64, 32) and (panels[1, :, 8:] == 0).all()  # padding columns
    with pytest.raises(RuntimeError, match=r"\[M >= 1, K\]"):
        cpu_kernels.ops.small_gemm(torch.randn(0, 64), panels, None, 40)
    with pytest.raises(RuntimeError, match="N does not fit"):
        cpu_kernels.ops.small_gemm(torch.randn(1, 64), panels, None, 70)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.ops.small_gemm(torch.randn(1, 64).bfloat16(), panels, None, 40)
    with pytest.raises(RuntimeError, match="panels"):
        cpu_kernels.ops.small_gemm(torch.randn(1, 64), w, None, 40)
    if cpu_kernels.ops.bf16_panels_k_pairs():  # AVX512-BF16's pairs of k
        with pytest.raises(ValueError, match="even K"):
            cpu_kernels.pack_panels(torch.randn(32, 63).bfloat16())
    else:  # AVX2's one k a row: any K
        assert cpu_kernels.pack_panels(torch.randn(32, 63).bfloat16()).shape == (1, 63, 32)


def _int4_weight(n: int, k: int, g: torch.Generator):
    """Random Q4_1-style codes with fp16 scales and minimums, and the weight they stand for."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) / 100).half().float()
    minimum = (-8 * scale + torch.randn(n, k // 32, generator=g) / 1000).half().float()
    w = q.double().reshape(n, k // 32, 32) * scale.double()[..., None] + minimum.double()[..., None]
    return q, scale, minimum, w.reshape(n, k)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 37])  # past 8: blocks of 8 rows, then the rest
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("k", [32, 576, 1536])
def test_int4_gemv_matches_linear(rows, x_dtype, k):
    if not cpu_kernels.int4_gemv_available():
        pytest.skip("no AVX512-VNNI or AVX2")
    g = torch.Generator().manual_seed(rows * k)
    q, scale, minimum, w = _int4_weight(96, k, g)
    packed = cpu_kernels.int4_gemv_pack(q, scale, minimum)
    assert packed.shape == (6, k // 32, 320) and packed.dtype == torch.uint8
    x = (torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 10).to(x_dtype)  # uneven channels
    bias = torch.randn(96, generator=g)
    for b in (None, bias):
        got = cpu_kernels.ops.int4_gemv(x, packed, b)
        ref = F.linear(x.double(), w, None if b is None else b.double())
        assert got.dtype == x_dtype and got.shape == (rows, 96)
        err = (got.double() - ref).abs().max() / ref.abs().max()
        # int16 activations: ~1e-5; then one bfloat16 rounding of the output
        assert err < (1e-4 if x_dtype == torch.float32 else 2**-8), err
        if rows > 8:  # a row's result does not depend on the rows beside it
            assert torch.equal(got[8:9], cpu_kernels.ops.int4_gemv(x[8:9], packed, b))


def test_int4_gemv_rejects_what_it_does_not_take():
    q, scale, minimum, _ = _int4_weight(16, 64, torch.Generator().manual_seed(0))
    packed = cpu_kernels.int4_gemv_pack(q, scale, minimum)
    with pytest.raises(RuntimeError, match=r"\[M >= 1, K\]"):
        cpu_kernels.ops.int4_gemv(torch.randn(0, 64), packed, None)
    with pytest.raises(RuntimeError, match=r"\[M >= 1, K\]"):
        cpu_kernels.ops.int4_gemv(torch.randn(1, 96), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.ops.int4_gemv(torch.randn(1, 64), packed, torch.randn(15))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.int4_gemv_pack(q[:8], scale[:8], minimum[:8])


def _int8g_weight(n: int, k: int, group: int, g: torch.Generator, minimum: bool = True):
    """Random int8 codes with float32 scales (and minimums) per group, as GGUF's K-quants give them
    (an fp16 times a 6-bit scale), and the weight they stand for."""
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // group, generator=g) / 1000).half().float()
    scale = d * torch.randint(1, 64, d.shape, generator=g)
    low = -(d * torch.randint(0, 64, d.shape, generator=g)) if minimum else None
    w = q.double().reshape(n, k // group, group) * scale.double()[..., None]
    if minimum:
        w = w + low.double()[..., None]
    return q, scale, low, w.reshape(n, k)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 37])  # past 8: blocks of 8 rows, then the rest
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("k,group", [(32, 32), (576, 32), (576, 16), (1536, 16)])
def test_int8g_gemv_matches_linear(rows, x_dtype, k, group):
    if not cpu_kernels.int4_gemv_available():
        pytest.skip("no AVX512-VNNI or AVX2")
    g = torch.Generator().manual_seed(rows * k + group)
    for has_min in (True, False):
        q, scale, low, w = _int8g_weight(96, k, group, g, has_min)
        packed = cpu_kernels.int8g_gemv_pack(q, scale, low)
        assert packed.shape == (6, k // group, 16 * group + 128) and packed.dtype == torch.uint8
        x = (torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 10).to(x_dtype)  # uneven channels
        bias = torch.randn(96, generator=g)
        for b in (None, bias):
            ref = F.linear(x.double(), w, None if b is None else b.double())
            for widen in (False, True):
                got = cpu_kernels.ops.int8g_gemv(x, packed, b, widen)
                assert got.shape == (rows, 96) and got.dtype == (torch.float32 if widen else x_dtype)
                err = (got.double() - ref).abs().max() / ref.abs().max()
                # int16 activations: ~1e-5; then (not widened) one bfloat16 rounding of the output
                assert err < (1e-4 if got.dtype == torch.float32 else 2**-8), err
            if rows > 8:  # a row's result does not depend on the rows beside it
                got = cpu_kernels.ops.int8g_gemv(x, packed, b)
                assert torch.equal(got[8:9], cpu_kernels.ops.int8g_gemv(x[8:9], packed, b))


def test_int8g_gemv_rejects_what_it_does_not_take():
    q, scale, low, _ = _int8g_weight(16, 64, 32, torch.Generator().manual_seed(0))
    packed = cpu_kernels.int8g_gemv_pack(q, scale, low)
    with pytest.raises(RuntimeError, match=r"\[M >= 1, K\]"):
        cpu_kernels.ops.int8g_gemv(torch.randn(0, 64), packed, None)
    with pytest.raises(RuntimeError, match=r"\[M >= 1, K\]"):
        cpu_kernels.ops.int8g_gemv(torch.randn(1, 96), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.ops.int8g_gemv(torch.randn(1, 64), packed, torch.randn(15))
    with pytest.raises(RuntimeError, match="packed"):
        cpu_kernels.ops.int8g_gemv(torch.randn(1, 64), packed[..., :-1].contiguous(), None)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.int8g_gemv_pack(q[:8], scale[:8], low[:8])
    with pytest.raises(ValueError, match="16 or 32"):
        cpu_kernels.int8g_gemv_pack(q, scale[:, :1], low[:, :1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 40)])  # 40: a tail after the 16-wide loop
def test_silu_mul_matches_eager(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails and zero
    got = cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert got.dtype == dtype and got.shape == (rows, inter)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    else:  # silu rounded to bfloat16 before the product, as eager does; exp's last bits may flip one
        close = (got.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-6
        assert close.all() and (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize(
    "dtype,quantization,rows",
    [
        ("float32", None, 1),
        ("float32", None, 3),
        ("bfloat16", None, 2),
        ("bfloat16", "int4", 1),
        ("bfloat16", "int4", 11),  # int4_gemv; 11 (then 10) rows: its blocks of 8 rows
        # (with bf16 dot products: the bfloat16 panels)
        ("bfloat16", "int8", 5),
        ("bfloat16", "int8", 11),
    ],
)  # int8_rows (AVX2) or int8_gemv; 11: int8_rows or the panels
def test_decode_layers_equals_the_layer_loop(tiny_model_dirs, arch, dtype, quantization, rows):
    """One op for all layers of a steady decode step runs the loop's kernels in its order: the very
    same logits at every step, and every steady step takes it (all but the prefill, the first
    decode step and the one after a request left, which copy rows into the mirror)."""
    skip_without_fused_op(dtype, quantization)
    args = dict(dtype=dtype, quantization=quantization)
    got, fused_steps = decode_logits(tiny_model_dirs[arch], True, rows, **args)
    ref, none = decode_logits(tiny_model_dirs[arch], False, rows, **args)
    assert none == 0 and fused_steps == len(got) - (2 if rows == 1 else 3), f"{fused_steps} of {len(got)} steps fused"
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_bfloat16_kv_cache_under_a_float32_model(tiny_model_dirs, rows):
    """`kv_cache_dtype="bfloat16"` on a float32 model: the pool and the decode mirror hold bfloat16
    (half the bytes a step reads), the steady steps still take the fused op, which equals the layer
    loop bit for bit; the logits move from a float32 cache's by K/V's rounding only (float16's
    finer rounding: less)."""
    skip_without_fused_op("float32")
    from plait.cli import _ENGINE_OPTIONS, build_parser
    from plait.runtime.server_args import ServerArgs

    path, keep = tiny_model_dirs["llama"], {}
    args = dict(dtype="float32", kv_cache_dtype="bfloat16")
    got, fused_steps = decode_logits(path, True, rows, keep=keep, **args)
    runner = keep["sched"].runner
    assert runner.kv_dtype == runner.pool.k[0].dtype == runner.backend.mirror.dtype == torch.bfloat16
    assert runner.dtype == torch.float32 and all(x.dtype == torch.float32 for x in got)
    ref, _ = decode_logits(path, False, rows, **args)
    assert fused_steps == len(got) - (2 if rows == 1 else 3)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    f32, _ = decode_logits(path, True, rows, dtype="float32")
    first = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(got[:2], f32[:2])]
    assert all(0 < d < 2e-2 for d in first), first  # rounded (not equal), and by little
    # float16: no fused kernels for it on the CPU, the eager ops over it; closer than bfloat16
    half, half_fused = decode_logits(path, True, rows, dtype="float32", kv_cache_dtype="float16")
    closer = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(half[:2], f32[:2])]
    assert half_fused == 0 and all(0 < c < d for c, d in zip(closer, first)), (closer, first)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServerArgs(kv_cache_dtype="int8")
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    assert "kv_cache_dtype" in _ENGINE_OPTIONS


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("rows", [1, 3])
def test_an_fp8_kv_cache_under_a_bfloat16_model(tiny_model_dirs, kv, rows):
    """`kv_cache_dtype="fp8_e4m3"` / `"fp8_e5m2"` on a bfloat16 model: pool and mirror hold one
    byte a value (half a bfloat16 cache's), the steady steps still take the fused op, equal to the
    layer loop bit for bit; the logits move from a bfloat16 cache's by K/V's rounding only, e4m3's
    3 mantissa bits less than e5m2's 2."""
    skip_without_fused_op("bfloat16")
    from plait.cli import build_parser

    path, keep = tiny_model_dirs["llama"], {}
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    got, fused_steps = decode_logits(path, True, rows, keep=keep, dtype="bfloat16", kv_cache_dtype=kv)
    runner = keep["sched"].runner
    assert runner.kv_dtype == runner.pool.k[0].dtype == runner.backend.mirror.dtype == fp8
    assert runner.pool.k[0].element_size() == 1
    ref, _ = decode_logits(path, False, rows, dtype="bfloat16", kv_cache_dtype=kv)
    assert fused_steps == len(got) - (2 if rows == 1 else 3)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    bf16, _ = decode_logits(path, True, rows, dtype="bfloat16")
    # the prefill's logits (attention over the pool's rounded K/V): later steps may follow other
    # greedy tokens
    moved = (got[0] - bf16[0]).abs().max().item() / bf16[0].abs().max().item()
    assert 0 < moved < 0.25, moved  # rounded (not equal), and by little
    assert all(bool(x.isfinite().all()) for x in got)
    if kv == "fp8_e5m2":
        finer, _ = decode_logits(path, True, rows, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
        closer = (finer[0] - bf16[0]).abs().max().item() / bf16[0].abs().max().item()
        assert closer < moved, (closer, moved)
    assert keep["sched"].kv_slots_in_use() == 0
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", kv]).kv_cache_dtype == kv
    if rows == 3:  # the eager ops (no kernels): the pool's and mirror's writes as bytes, SDPA widening
        plain, none = eager(lambda: decode_logits(path, True, rows, dtype="bfloat16", kv_cache_dtype=kv))
        assert none == 0 and len(plain) == len(got)
        assert (plain[0] - got[0]).abs().max().item() / got[0].abs().max().item() < 0.02


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_kernels_read_and_write_exactly(kv):
    """The fp8 K/V kernels: kv_write_ rounds as torch's conversion does (pool and mirror alike, from
    float32 or bfloat16 k/v); decode_attention widens every fp8 value exactly, so over fp8 K/V it
    equals the same kernel over those values in float32, for float32 and bfloat16 queries."""
    torch.manual_seed(0)
    pool_k, pool_v = torch.zeros(10, 3, 64, dtype=kv), torch.zeros(10, 3, 64, dtype=kv)
    mirror_k, mirror_v = torch.zeros(4, 3, 8, 64, dtype=kv), torch.zeros(4, 3, 8, 64, dtype=kv)
    for src in (torch.float32, torch.bfloat16):
        k, v = (torch.randn(2, 3, 64) * 8).to(src), (torch.randn(2, 3, 64) * 1e-2).to(src)
        at = torch.tensor([0, 9, 17, 30, 50, 95])
        cpu_kernels.ops.kv_write_(pool_k, pool_v, torch.tensor([4, 7]), k, v, mirror_k, mirror_v, at)
        for got, want in (
            (pool_k[[4, 7]], k),
            (pool_v[[4, 7]], v),
            (mirror_k.view(-1, 64)[at].view(2, 3, 64), k),
            (mirror_v.view(-1, 64)[at].view(2, 3, 64), v),
        ):
            assert torch.equal(got.view(torch.uint8), want.float().to(kv).view(torch.uint8))
    # every byte but NaN, as the values of one-key rows (softmax of one key is 1: the output is V)
    values = torch.arange(256, dtype=torch.uint8).view(kv)
    values = values[~values.float().isnan()]
    values = torch.cat([values, torch.zeros(-len(values) % 64, dtype=kv)]).reshape(4, 1, 1, 64)
    out = cpu_kernels.ops.decode_attention(
        torch.zeros(4, 1, 64), torch.zeros_like(values), values, torch.ones(4, dtype=torch.int64), 1.0, None
    )
    assert torch.equal(out.view(4, 64), values.float().view(4, 64))
    k, v = (torch.randn(3, 3, 70, 64) * 3).to(kv), torch.randn(3, 3, 70, 64).to(kv)
    lens, rows = torch.tensor([70, 33, 1]), torch.tensor([2, 0, 1])
    for q in (torch.randn(3, 9, 64), torch.randn(3, 9, 64).bfloat16()):
        for r in (None, rows):
            got = cpu_kernels.decode_attention(q, k, v, lens, 0.125, r)
            assert torch.equal(got, cpu_kernels.decode_attention(q, k.float(), v.float(), lens, 0.125, r))


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", "int4")])
def test_decode_layers_with_the_head_outside_the_op(tiny_model_dirs, dtype, quantization):
    """Where the LM head's kernel is not one of the op's (tensor parallel, another kernel), the
    layers still run in one op and the head after it in Python: the same logits."""
    skip_without_fused_op(dtype, quantization)
    args = dict(dtype=dtype, quantization=quantization)
    got, fused_steps = decode_logits(tiny_model_dirs["llama"], True, 2, head_in_op=False, **args)
    ref, _ = decode_logits(tiny_model_dirs["llama"], False, 2, **args)
    assert fused_steps == len(got) - 3 and len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("rows", [1, 2])
def test_decode_layers_follow_the_mirror_when_it_grows(tiny_model_dirs, monkeypatch, rows):
    """The op's fixed arguments are held across steps (a DecodePlan): when the mirror's blocks are
    reallocated (a context outgrowing its 256 keys, rows kept), the very next step, still fused,
    attends the new blocks, and no plan keeps the old ones (2 rows: the first request leaves
    before the growth, its row count's plan must go too)."""
    skip_without_fused_op("float32")
    from plait.runtime.mem_cache.decode_mirror import DecodeMirror

    grown, resize = [], DecodeMirror._resize
    monkeypatch.setattr(
        DecodeMirror, "_resize", lambda self, rows, length: grown.append(length) or resize(self, rows, length)
    )
    keep = {}
    got, fused_steps = decode_logits(
        tiny_model_dirs["llama"], True, rows, prompt=248, new=16, keep=keep, dtype="float32"
    )
    assert len(grown) == 2 and grown[0] < grown[1], grown  # the first fill, then one growth mid-run
    mirror = keep["sched"].runner.backend.mirror  # no plan holds the replaced blocks (their memory)
    assert [h[0] for h in keep["sched"].runner.model._decode_handles.values()] == [(mirror, mirror.generation)]
    assert fused_steps == len(got) - (2 if rows == 1 else 3)  # not the prefill, the first decode step, a refill
    ref, _ = decode_logits(tiny_model_dirs["llama"], False, rows, prompt=248, new=16, dtype="float32")
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.integration
@pytest.mark.parametrize(
    "dtype,quantization,rows", [("bfloat16", "int4", 2), ("bfloat16", None, 3), ("bfloat16", "gguf", 2)]
)  # gguf: the file's Q8_0 head by int8g_gemv
def test_decode_layers_equal_the_layer_loop_on_smollm2(smollm2_path, dtype, quantization, rows):
    """The same on the real model's shapes (head_dim 64, 9 query / 3 KV heads, int4 groups of 32)."""
    skip_without_fused_op(dtype, quantization)
    args = dict(dtype=dtype, quantization=quantization)
    got, fused_steps = decode_logits(smollm2_path, True, rows, **args)
    ref, _ = decode_logits(smollm2_path, False, rows, **args)
    assert fused_steps >= 4 and len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_decode_layers_leave_out_what_they_do_not_run(tiny_model_dirs):
    """qk-norm layers (Qwen3) are not among the op's: every step runs the layer loop."""
    _, fused_steps = decode_logits(tiny_model_dirs["qwen3"], True, 2, dtype="float32")
    assert fused_steps == 0


@pytest.mark.parametrize("rows,n", [(1, 49152), (3, 1000), (2, 15), (1, 1), (40, 17)])
def test_argmax_rows_is_torch_argmax(rows, n):
    """The first index of each row's maximum, ties, -inf and NaN (which counts as the maximum) as
    torch.argmax has them."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=g)
    x[0, n // 2] = x[0].max() + 1  # one maximum
    if n > 5:
        x[-1, 1::3] = 7.0  # ties: the first wins
        x[-1, -1] = float("inf")
    got = cpu_kernels.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    x[:, :] = float("-inf")
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))
    x[0, n - 1] = float("nan")
    x[-1, n // 3] = float("nan")
    if n > 1:
        x[-1, n - 1] = float("nan")  # the first NaN of the row counts
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,width", [(49152, 1536), (100, 3), (70, 4)])  # mask shorter / longer than V
def test_bitmask_fill_is_the_grammar_mask(dtype, vocab, width):
    """-inf exactly where the packed mask's bit is 0 (and past the mask), on the chosen logits rows
    only, the other values untouched: what `apply_token_bitmask_` gives those rows. Words at all
    ones, at zero and mixed, bit 31 included."""
    from plait.grammar import apply_token_bitmask_

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, width), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0, :] = -1  # everything allowed
    mask[1, 1::2] = 0
    mask[2, 0] = -(2**31)  # bit 31 alone
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    for j, r in enumerate(rows.tolist()):
        apply_token_bitmask_(want[r : r + 1], mask[j : j + 1])
    got = logits.clone()
    assert cpu_kernels.bitmask_fill_(got, mask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    if vocab > width * 32:
        assert bool((got[rows, width * 32 :] == float("-inf")).all())
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.bitmask_fill_(got, mask, torch.tensor([0, 1, 5]))


def test_mirror_steady_appends_or_changes_nothing():
    """The decode mirror's steady step: rows whose mirror equals the pool get their new token
    recorded at their mirror rows (here batch row 0 at mirror row 2, row 1 at row 0) and its K/V
    rows' places returned; one stale entry anywhere, or a target out of range, and nothing changes."""
    cap, kv_heads = 8, 3
    ids = torch.zeros(3, cap, dtype=torch.int64)
    stamps = torch.full((3, cap), -1, dtype=torch.int64)
    lens = torch.zeros(3, dtype=torch.int64)
    slot_stamp = torch.zeros(100, dtype=torch.int64)
    kv = torch.tensor([[5, 6, 7, 0], [9, 10, 11, 12]])  # two rows, prefixes 2 and 3
    pre = torch.tensor([2, 3])
    targets = torch.tensor([2, 0])
    ids[2, :2], ids[0, :3] = kv[0, :2], kv[1, :3]
    stamps[2, :2], stamps[0, :3] = 4, 3
    slot_stamp[[5, 6]], slot_stamp[[9, 10, 11]] = 4, 3
    lens[2], lens[0] = 2, 3
    before = (ids.clone(), stamps.clone(), lens.clone())
    slot_stamp[10] = 7  # slot 10 rewritten since it was copied
    out = cpu_kernels.ops.mirror_steady_(ids, stamps, lens, slot_stamp, kv, pre, targets, 9, kv_heads)
    assert out.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip((ids, stamps, lens), before))
    slot_stamp[10] = 3
    for bad in ([0, 2], [2, 3]):  # each row's mirror checked where it lies
        out = cpu_kernels.ops.mirror_steady_(ids, stamps, lens, slot_stamp, kv, pre, torch.tensor(bad), 9, kv_heads)
        assert out.numel() == 0
        assert all(torch.equal(a, b) for a, b in zip((ids, stamps, lens), before))
    out = cpu_kernels.ops.mirror_steady_(ids, stamps, lens, slot_stamp, kv, pre, targets, 9, kv_heads)
    assert out.tolist() == [(t * kv_heads + h) * cap + p for t, p in ((2, 2), (0, 3)) for h in range(kv_heads)]
    assert ids[2, 2] == 7 and ids[0, 3] == 12 and stamps[2, 2] == stamps[0, 3] == 9 and lens.tolist() == [4, 0, 3]


@pytest.mark.parametrize("n,min_share,chunk", [(1000, 1, 7), (64, 4, 1), (5, 1, 3), (1, 1, 1), (0, 1, 1)])
def test_parallel_shares_run_every_index_once(n, min_share, chunk):
    """The GEMVs' split: each thread runs its own share front to back, then takes chunks from the
    back of a slower thread's; every index runs exactly once, and a slow thread's share is taken
    over (thread 0 sleeps 3 ms in each chunk it runs)."""
    who = cpu_kernels.ops.shares_coverage(n, min_share, chunk, 3000)
    assert who.shape == (n,) and (who >= 0).all()  # -1: never ran, -2: ran twice
    threads = min(torch.get_num_threads(), max(1, n // min_share))
    if threads > 1 and n // threads > chunk:  # share 0 has chunks thread 0 did not get to
        assert (who[: n // threads] > 0).any()
