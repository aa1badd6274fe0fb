// A steady decode step in one op: the decode mirror's book-keeping (mirror_steady_), greedy argmax
// over the logits (argmax_rows), grammar masks on them (bitmask_fill_, scalar in every build), the decoder layers (decode_layers_) and the whole step from token ids
// to logits (decode_step). argmax has an AVX-512 path (16 running maxima) and an AVX2 one (PLAIT_AVX2,
// 8) before the scalar loop, which a -march=x86-64 build runs alone; mirror_steady_ is scalar in every
// build. decode_layers_ and decode_step call the other files' kernels, each with its own ISA paths;
// where this build lacks a projection's kernel (e.g. -march=x86-64: no small_gemm, no integer GEMVs)
// the Python side makes no plan and the model runs its layer loop.
#include "ops.h"

namespace PLAIT_NS {

// ---- the decode mirror's steady step ---------------------------------------------------------------
// DecodeMirror.plan's common case in one op (in place of its ~30 small tensor ops a step): every
// decode row b sits at its mirror row targets[b] (kept from an earlier step) and appends one token.
// Checks that each row's mirror still equals the pool (length >= prefix, and each of its first
// prefix entries the same slot, unwritten since it was copied: ids == kv and stamps ==
// slot_stamp[kv]); if every row does, records the new token (ids, stamps, lens) and returns where
// its K/V rows go (mirror_at, as kv_write_ takes it); else changes nothing and returns an empty
// tensor (the caller plans in full). The targets must be distinct (the caller's mapping is).
at::Tensor mirror_steady_(at::Tensor ids, at::Tensor stamps, at::Tensor lens, const at::Tensor& slot_stamp,
                          const at::Tensor& kv, const at::Tensor& pre, const at::Tensor& targets, int64_t clock,
                          int64_t kv_heads) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && stamps.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  slot_stamp.scalar_type() == at::kLong && kv.scalar_type() == at::kLong && pre.scalar_type() == at::kLong &&
                  targets.scalar_type() == at::kLong,
              "mirror_steady_: int64 tensors only");
  TORCH_CHECK(ids.dim() == 2 && ids.is_contiguous() && stamps.sizes() == ids.sizes() && stamps.is_contiguous() &&
                  lens.is_contiguous() && slot_stamp.is_contiguous() && kv.dim() == 2 && kv.is_contiguous() &&
                  pre.is_contiguous() && pre.numel() == kv.size(0) && targets.is_contiguous() &&
                  targets.numel() == kv.size(0) && lens.numel() >= ids.size(0) && kv.size(1) <= ids.size(1),
              "mirror_steady_: ids/stamps [rows, cap], lens [>= rows], kv [n, L <= cap], pre and targets [n]");
  const int64_t n = kv.size(0), L = kv.size(1), cap = ids.size(1), slots = slot_stamp.numel();
  int64_t* idp = ids.data_ptr<int64_t>();
  int64_t* stp = stamps.data_ptr<int64_t>();
  int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t *ssp = slot_stamp.data_ptr<int64_t>(), *kvp = kv.data_ptr<int64_t>(), *pp = pre.data_ptr<int64_t>();
  const int64_t* tp = targets.data_ptr<int64_t>();
  for (int64_t b = 0; b < n; ++b) {
    const int64_t p = pp[b], t = tp[b];
    if (t < 0 || t >= ids.size(0) || p < 0 || p >= L || lp[t] < p) return at::empty({0}, kv.options());
    const int64_t *ib = idp + t * cap, *sb = stp + t * cap, *kb = kvp + b * L;
    for (int64_t j = 0; j < p; ++j) {
      const int64_t slot = kb[j];
      if (ib[j] != slot || slot < 0 || slot >= slots || sb[j] != ssp[slot]) return at::empty({0}, kv.options());
    }
  }
  at::Tensor at_ = at::empty({n * kv_heads}, kv.options());
  int64_t* ap = at_.data_ptr<int64_t>();
  for (int64_t b = 0; b < n; ++b) {
    const int64_t p = pp[b], t = tp[b];
    idp[t * cap + p] = kvp[b * L + p];
    stp[t * cap + p] = clock;
    lp[t] = p + 1;
    for (int64_t h = 0; h < kv_heads; ++h) ap[b * kv_heads + h] = (t * kv_heads + h) * cap + p;
  }
  return at_;
}

// ---- greedy sampling: each row's argmax ----------------------------------------------------------
// torch's argmax reads float32 logits far below the memory's bandwidth; this keeps 16 running
// maxima and their indices. Same result: the first index of the maximum, and of the first NaN in a
// row that has one (NaN counts as the maximum).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float bv = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n && !nan; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);   // strictly greater: first index kept
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    if (nan) {   // rare: the first NaN, found by the scalar loop
      for (int64_t j = 0; j < n; ++j) if (std::isnan(x[j])) return j;
    }
    alignas(64) float mv[16];
    alignas(64) int32_t mi[16];
    _mm512_store_ps(mv, vmax);
    _mm512_store_si512(mi, vidx);
    bv = mv[0], best = mi[0];
    for (int l = 1; l < 16; ++l) {
      if (mv[l] > bv || (mv[l] == bv && mi[l] < best)) bv = mv[l], best = mi[l];
    }
  }
#elif defined(PLAIT_AVX2)
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);   // strictly greater: first index kept
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
    }
    if (_mm256_movemask_ps(nan)) {   // rare: the first NaN, found by the scalar loop
      for (int64_t j = 0; j < n; ++j) if (std::isnan(x[j])) return j;
    }
    alignas(32) float mv[8];
    alignas(32) int32_t mi[8];
    _mm256_store_ps(mv, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(mi), vidx);
    bv = mv[0], best = mi[0];
    for (int l = 1; l < 8; ++l) {
      if (mv[l] > bv || (mv[l] == bv && mi[l] < best)) bv = mv[l], best = mi[l];
    }
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > bv || i == 0) bv = x[i], best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) >= 1 &&
                  x.size(1) < (int64_t(1) << 31), "argmax_rows: x must be contiguous float32 [rows, n], 1 <= n < 2^31");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), grain(n, 1 << 18), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// ---- grammar masks on the logits ------------------------------------------------------------------
// logits[rows[j], t] = -inf where bit t & 31 of bitmask[j][t >> 5] is 0, and for every t past the
// bitmask; the other logits untouched. A word at all ones (everything allowed) is skipped and one at
// zero written as a run: a JSON grammar's mask allows a few tokens, a free row's all. The
// torch path adds a gathered 0 / -inf table over the whole [rows, V] (two passes and a temporary).
template <typename T> void bitmask_fill_row(T* x, const uint32_t* m, int64_t n, int64_t covered) {
  const T ninf = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t base = 0; base < covered; base += 32) {
    const uint32_t word = m[base >> 5];
    if (word == 0xFFFFFFFFu) continue;
    const int64_t lim = std::min<int64_t>(32, covered - base);
    if (word == 0) {
      std::fill(x + base, x + base + lim, ninf);
      continue;
    }
    for (int64_t b = 0; b < lim; ++b)
      if (!((word >> b) & 1u)) x[base + b] = ninf;
  }
  std::fill(x + covered, x + n, ninf);
}

void bitmask_fill_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_cpu(logits, "logits");
  check_cpu(bitmask, "bitmask");
  check_cpu(rows, "rows");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "bitmask_fill_: logits must be contiguous float32 or bfloat16 [B, V]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "bitmask_fill_: bitmask must be contiguous int32 [n, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong &&
                  rows.numel() == bitmask.size(0),
              "bitmask_fill_: rows must be int64 [n], one per bitmask row");
  const int64_t B = logits.size(0), n = logits.size(1), W = bitmask.size(1);
  const int64_t covered = std::min<int64_t>(n, W * 32);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.numel(); ++j)
    TORCH_CHECK(rp[j] >= 0 && rp[j] < B, "bitmask_fill_: row ", rp[j], " out of range for ", B, " logits rows");
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, rows.numel(), grain(n, 1 << 17), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      if (logits.scalar_type() == at::kFloat)
        bitmask_fill_row(logits.data_ptr<float>() + rp[j] * n, mp + j * W, n, covered);
      else
        bitmask_fill_row(logits.data_ptr<c10::BFloat16>() + rp[j] * n, mp + j * W, n, covered);
    }
  });
}

// ---- a whole decode step's decoder layers in one call ---------------------------------------------
// At batch 1 a layer's ten kernels are short, and reaching each from Python (module calls, argument
// checks, the dispatcher) added a cost of the same order as the kernels' own. Here the same
// kernels run in the same order from one op, so the results are those of the layer-by-layer path bit
// for bit. Per layer, `weights` holds 10 tensors: input norm, qkv (a, b), o (a, b), post-attention
// norm, gate_up (a, b), down (a, b); `kinds` 8 ints: (kind, out_features) per projection. A
// projection's kind: 0 small_gemm (a = panels, b = float32 bias or empty), 1 int4_gemv (a = packed
// codes, b = float32 bias or empty), 2 int8_gemv (a = int8 weight, b = float32 scales), 3 int8_rows
// (a = its packed int8 weight, b = float32 scales) or 4 int8g_gemv (a = packed codes, b = float32 bias
// or empty). Attention: this step's K/V to pool slots `slots`
// and mirror rows `mirror_at`, then decode attention over each layer's mirror with `lens`, batch row b
// at mirror row mirror_rows[b] (default b; see decode_mirror.py).
// y: contiguous [rows, out_features] in x's dtype; `widen` (the LM head): float32, small_gemm's
// bfloat16 products widened as written, the int8 kernels' output as they compute it (y made float32
// by the caller).
void project_into(const at::Tensor& x, const int64_t* kind, const at::Tensor& a, const at::Tensor& b, at::Tensor& y,
                  bool widen = false) {
  const c10::optional<at::Tensor> bias = b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt;
  switch (kind[0]) {
    case 0: return small_gemm_into(x, a, bias, kind[1], widen, y);
    case 1: return int4_gemv_into(x, a, bias, y);
    case 2: return int8_gemv_into(x, a, b, y);
    case 3: return int8_rows_into(x, a, b, y);
    case 4: return int8g_gemv_into(x, a, bias, widen, y);
  }
  TORCH_CHECK(false, "decode_layers_: unknown projection kind ", kind[0]);
}

// Where this step's K/V rows go in layer l's pool and mirror, fetched for writing ahead of
// kv_write_ (a layer's qkv projection earlier): otherwise each of those lines is a miss when written.
void prefetch_kv_targets(const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& mirror_k,
                         const at::Tensor& mirror_v, const int64_t* slots, const int64_t* mirror_at, int64_t tokens,
                         int64_t kv_heads, int64_t head_dim) {
  const int64_t row = head_dim * pool_k.element_size(), slot_bytes = kv_heads * row;
  const char *pk = static_cast<const char*>(pool_k.data_ptr()), *pv = static_cast<const char*>(pool_v.data_ptr());
  const char *mk = static_cast<const char*>(mirror_k.data_ptr()), *mv = static_cast<const char*>(mirror_v.data_ptr());
  const int64_t pool_end = pool_k.numel() * pool_k.element_size(), mirror_end = mirror_k.numel() * mirror_k.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t at = slots[t] * slot_bytes;
    for (int64_t b = 0; b < slot_bytes && at >= 0 && at + b < pool_end; b += 64) {
      __builtin_prefetch(pk + at + b, 1, 3);
      __builtin_prefetch(pv + at + b, 1, 3);
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t m = mirror_at[t * kv_heads + h] * row;
      for (int64_t b = 0; b < row && m >= 0 && m + b < mirror_end; b += 64) {
        __builtin_prefetch(mk + m + b, 1, 3);
        __builtin_prefetch(mv + m + b, 1, 3);
      }
    }
  }
}

// Where decode_layers_'s time goes, summed per part over its calls while on (`plait bench step_profile
// --breakdown`): a clock read between the parts (~9 a layer), none while off. One
// process-wide record: decode_layers_ runs on the scheduler's thread only.
constexpr int kDecodeParts = 8;   // norms, qkv, rope + K/V writes, attention, o, gate_up, silu, down
struct DecodeProfile {
  bool on = false;
  int64_t calls = 0;
  double us[kDecodeParts] = {};
  std::chrono::steady_clock::time_point last;
  void start() {
    if (!on) return;
    last = std::chrono::steady_clock::now();
    ++calls;
  }
  void lap(int part) {   // the time since the last lap goes to `part`
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    us[part] += std::chrono::duration<double, std::micro>(now - last).count();
    last = now;
  }
} g_decode_profile;

// Turns the profile on (zeroed) or off.
void decode_profile_(bool on) { g_decode_profile = DecodeProfile{}; g_decode_profile.on = on; }

// float64 [1 + kDecodeParts]: decode_layers_ calls profiled, then microseconds per part summed.
at::Tensor decode_profile() {
  at::Tensor out = at::empty({1 + kDecodeParts}, at::kDouble);
  double* p = out.data_ptr<double>();
  p[0] = static_cast<double>(g_decode_profile.calls);
  std::copy(g_decode_profile.us, g_decode_profile.us + kDecodeParts, p + 1);
  return out;
}


at::Tensor decode_layers_(at::Tensor x, const c10::intrusive_ptr<DecodePlan>& plan, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& mirror_at,
                          const at::Tensor& lens, const c10::optional<at::Tensor>& mirror_rows) {
  const std::vector<at::Tensor> &weights = plan->weights, &pool_k = plan->pool_k, &pool_v = plan->pool_v,
                                &mirror_k = plan->mirror_k, &mirror_v = plan->mirror_v;
  const int64_t* const kinds = plan->kinds.data();
  const int64_t layers = static_cast<int64_t>(pool_k.size()), heads = plan->heads, kv_heads = plan->kv_heads,
                head_dim = plan->head_dim;
  const double eps = plan->eps, scale = plan->scale;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers_: x must be contiguous [rows, hidden]");
  const int64_t rows = x.size(0), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  // The layers' intermediates, made once a step and rewritten by every layer (each is read before
  // the next layer writes it): ~8 allocations a layer less.
  struct Scratch {
    at::Tensor buf;
    at::Tensor& of(const at::Tensor& like, int64_t width) {   // [rows, width] in like's dtype
      if (!buf.defined() || buf.size(1) != width) buf = at::empty({like.size(0), width}, like.options());
      return buf;
    }
  } h, qkv, attn, o, gu, act, d;   // d: the previous layer's output, added to x by the next norm (none before layer 0)
  at::Tensor q, k, v, attn3;   // qkv's parts and attention's output as [rows, heads, head_dim]
  DecodeProfile& prof = g_decode_profile;
  prof.start();
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 10 * l;
    const int64_t* kind = kinds + 8 * l;
    prefetch_kv_targets(pool_k[l], pool_v[l], mirror_k[l], mirror_v[l], slots.data_ptr<int64_t>(),
                        mirror_at.data_ptr<int64_t>(), rows, kv_heads, head_dim);
    rms_norm_into(x, d.buf.defined() ? c10::optional<at::Tensor>(d.buf) : c10::nullopt, w[0], eps, h.of(x, x.size(1)));
    TORCH_CHECK(kind[1] == q_width + 2 * kv_width, "decode_layers_: qkv has the wrong width");
    prof.lap(0);
    project_into(h.buf, kind, w[1], w[2], qkv.of(x, kind[1]));
    prof.lap(1);
    rope_(qkv.buf, cos, sin, heads + kv_heads, head_dim);
    if (l == 0) {   // views of buffers every layer rewrites: made once (each a few dispatched ops)
      q = qkv.buf.narrow(1, 0, q_width).view({rows, heads, head_dim});
      k = qkv.buf.narrow(1, q_width, kv_width).view({rows, kv_heads, head_dim});
      v = qkv.buf.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads, head_dim});
      attn3 = attn.of(x, q_width).view({rows, heads, head_dim});
    }
    kv_write_(pool_k[l], pool_v[l], slots, k, v, mirror_k[l], mirror_v[l], mirror_at);
    prof.lap(2);
    decode_attention_into(q, mirror_k[l], mirror_v[l], lens, scale, mirror_rows, attn3);
    prof.lap(3);
    project_into(attn.buf, kind + 2, w[3], w[4], o.of(x, kind[3]));
    prof.lap(4);
    rms_norm_into(x, o.buf, w[5], eps, h.buf);
    prof.lap(0);
    project_into(h.buf, kind + 4, w[6], w[7], gu.of(x, kind[5]));
    prof.lap(5);
    silu_mul_into(gu.buf, act.of(x, kind[5] / 2));
    prof.lap(6);
    project_into(act.buf, kind + 6, w[8], w[9], d.of(x, kind[7]));
    prof.lap(7);
  }
  return d.buf;
}

// A steady decode step from token ids to float32 logits [rows, out_features]: the embedding rows and
// RoPE's rows at `positions` copied, decode_layers_, the final norm (the residual add fused) and the
// LM head, as the model's forward runs them (the same kernels: the same logits). In Python each of
// these ends' ops runs with cold caches after the weights' stream (the final norm many times slower
// than warm); here a bfloat16 batch-1 step is shorter.
at::Tensor decode_step(const at::Tensor& ids, const at::Tensor& positions, const c10::intrusive_ptr<DecodePlan>& plan,
                       const at::Tensor& slots, const at::Tensor& mirror_at, const at::Tensor& lens,
                       const c10::optional<at::Tensor>& mirror_rows) {
  TORCH_CHECK(!plan->head_kind.empty(), "decode_step: the plan has no ends (DecodePlan.set_ends)");
  TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && ids.dim() == 1 &&
                  ids.is_contiguous() && positions.is_contiguous() && positions.numel() == ids.numel(),
              "decode_step: ids and positions must be int64 [rows]");
  const at::Tensor &embed = plan->embed, &rope_cos = plan->rope_cos, &rope_sin = plan->rope_sin;
  const int64_t rows = ids.numel(), vocab = embed.size(0), hidden = embed.size(1), D = rope_cos.size(1);
  at::Tensor x = at::empty({rows, hidden}, embed.options());
  at::Tensor cos = at::empty({rows, D}, rope_cos.options()), sin = at::empty({rows, D}, rope_sin.options());
  const int64_t *ip = ids.data_ptr<int64_t>(), *pp = positions.data_ptr<int64_t>();
  const int64_t row_bytes = hidden * static_cast<int64_t>(embed.element_size());
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < vocab, "decode_step: token id ", ip[r], " out of range");
    TORCH_CHECK(pp[r] >= 0 && pp[r] < rope_cos.size(0), "decode_step: position ", pp[r], " out of range");
    std::memcpy(static_cast<char*>(x.data_ptr()) + r * row_bytes,
                static_cast<const char*>(embed.data_ptr()) + ip[r] * row_bytes, row_bytes);
    std::memcpy(cos.data_ptr<float>() + r * D, rope_cos.data_ptr<float>() + pp[r] * D, D * sizeof(float));
    std::memcpy(sin.data_ptr<float>() + r * D, rope_sin.data_ptr<float>() + pp[r] * D, D * sizeof(float));
  }
  const at::Tensor d = decode_layers_(x, plan, cos, sin, slots, mirror_at, lens, mirror_rows);
  at::Tensor h, logits;
  rms_norm_into(x, d, plan->final_norm, plan->final_eps, h);
  // float32 logits as the head module's forward(widen=True) returns them (small_gemm makes its own)
  const int64_t* kind = plan->head_kind.data();
  if (kind[0] != 0) logits = at::empty({rows, kind[1]}, h.options().dtype(at::kFloat));
  project_into(h, kind, plan->head_a, plan->head_b, logits, /*widen=*/true);
  return logits;
}

}  // namespace PLAIT_NS
