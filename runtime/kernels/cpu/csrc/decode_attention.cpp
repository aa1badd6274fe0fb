// Decode attention: one query token per row against that row's K/V (the decode mirror, or any strided
// [n, KVH, L, D] view; float32, bfloat16 or fp8), each (row, KV head) task streaming its keys and values
// once for the queries that share them; with few tasks for the threads each splits its keys (as
// flash-decoding does).
// AVX-512: scores in blocks of 8 keys for up to 3 queries, bfloat16 q . k by AVX512-BF16 dot products
// in a build with AVX512-BF16 (kDotScores; else q widened to float32), the softmax by exp16, the values
// summed in registers for the common (G, D) shapes. AVX2 + FMA + F16C (PLAIT_AVX2): blocks of 4 keys
// on float32 q (bfloat16 q widened), values in passes of 32 or 16 dims, exp8. Both fetch K/V ahead,
// and the next task's short streams. Other shapes take the scalar loops, and a -march=x86-64 build
// runs only those (fetching nothing ahead).
#include "ops.h"

namespace PLAIT_NS {

// ---- decode attention: one query token per row, K/V of each row contiguous -----------------------
// q [n, H, D]; k, v [>=n, KVH, >=L, D] (unit stride in D; rows, heads and positions may be
// strided, e.g. the decode mirror as it lies); lens [>=n] int64: row b attends keys [0, lens[b]).
// Each (row, KV head) task streams its keys and values once for all H / KVH queries that share them.

// A row's K (then V) is a short stream (len x D, a few KB to ~100 KB) that the hardware prefetcher
// barely ramps up on before it ends: keys and values are fetched ~2 KB ahead (8 float32 rows of 64,
// 16 bfloat16 ones), the scores' last rows fetch the first values, and the next task's keys and
// values come in while this one runs (AheadRows).
template <typename KV>
inline int64_t prefetch_rows(int64_t D) {
  return std::max<int64_t>(8, 2048 / (D * static_cast<int64_t>(sizeof(KV))));
}

// bfloat16 q and keys (a bfloat16 model's): q . k by VDPBF16PS, 32 dims an instruction, instead of
// widening each key to float32 first; the products are exact either way, only the order of the
// float32 sums differs. (The same for p . v would need the probabilities rounded to bfloat16; that
// gained too little to be worth the precision.)
#if defined(__AVX512BF16__)
constexpr bool kDotScores = true;
#else
constexpr bool kDotScores = false;
#endif
// Whether the scores take q as bfloat16 dot products (QT = c10::BFloat16) or as float32 (QT = float).
template <typename QT, typename KV>
constexpr bool dot_scores() { return kDotScores && std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>; }

#if defined(__AVX512F__) || defined(PLAIT_AVX2)
template <typename KV>
inline void prefetch_row(const KV* p, int64_t D) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)

// The sums of 8 vectors' lanes, in key order: a transposing add tree (~3 instructions a vector)
// instead of 8 horizontal reductions (~8 each), which had made the scores compute-bound.
inline __m256 hsum8(const __m512* a) {
  __m512 t[4], u[2];
  for (int i = 0; i < 4; ++i)   // 128-bit quarters 0,1 of t[i]: a[2i]'s halves summed; 2,3: a[2i+1]'s
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)   // quarter q of u[i]: a[4i + q]'s 4 partial sums
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // quarter q: lanes (a[q], a[q+4], a[q], a[q+4]) with 2 partial sums each, then 1
  const __m512 v = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 w = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, w));
}

#if defined(__AVX512BF16__)
inline __m512bh load_bh(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
#endif

// scores of 8 keys for GN queries (rows of `scores`, stride len): each key chunk is loaded (and
// widened) once for all of them; GN * 8 independent accumulators keep the FMA units busy.
// DC: the head dim when known at compile time (else 0: `D`). With a run-time D, GCC keeps the
// accumulators on the stack (zeroed, stored and reloaded around the sums every 8 keys), which held
// the bfloat16 dot products back even with the keys in L2. Only the bfloat16 dot products take it:
// float32 K/V out of cache ran slower with it (see attention_scores).
template <int GN, int DC, typename QT, typename KV>
inline void scores_block8(const QT* q, const KV* k0, int64_t k_stride, int64_t D_, __m512 vscale, float* scores,
                          int64_t len) {
  const int64_t D = DC > 0 ? DC : D_;
  __m512 acc[GN][8];
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < 8; ++i) acc[g][i] = _mm512_setzero_ps();
  if constexpr (dot_scores<QT, KV>()) {
#if defined(__AVX512BF16__)
    for (int64_t d = 0; d < D; d += 32) {
      __m512bh qd[GN];
      for (int g = 0; g < GN; ++g) qd[g] = load_bh(q + g * D + d);
      for (int i = 0; i < 8; ++i) {
        const __m512bh kd = load_bh(k0 + i * k_stride + d);
        for (int g = 0; g < GN; ++g) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], qd[g], kd);
      }
    }
#endif
  } else {
    for (int64_t d = 0; d < D; d += 16) {
      for (int i = 0; i < 8; ++i) {
        const __m512 kd = load16(k0 + i * k_stride + d);
        for (int g = 0; g < GN; ++g) acc[g][i] = _mm512_fmadd_ps(load16(q + g * D + d), kd, acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    _mm256_storeu_ps(scores + g * len, _mm256_mul_ps(hsum8(acc[g]), _mm512_castps512_ps256(vscale)));
}

// One key's scores for G queries (the keys of a row shorter than a block of 8).
template <typename QT, typename KV>
inline void scores_one(const QT* q, const KV* kj, int64_t G, int64_t D, float scale, float* scores, int64_t len) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc = _mm512_setzero_ps();
    if constexpr (dot_scores<QT, KV>()) {
#if defined(__AVX512BF16__)
      for (int64_t d = 0; d < D; d += 32) acc = _mm512_dpbf16_ps(acc, load_bh(q + g * D + d), load_bh(kj + d));
#endif
    } else {
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load16(q + g * D + d), load16(kj + d), acc);
    }
    scores[g * len] = _mm512_reduce_add_ps(acc) * scale;
  }
}
#endif

#if defined(PLAIT_AVX2)
// scores of 4 keys for GN queries (rows of `scores`, stride len; q float32): 16 registers hold
// GN * 4 accumulators, each key chunk loaded (and widened) once for all queries.
template <int GN, typename KV>
inline void scores_block4(const float* q, const KV* k0, int64_t k_stride, int64_t D, float scale, float* scores,
                          int64_t len) {
  __m256 acc[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    for (int i = 0; i < 4; ++i) {
      const __m256 kd = load8(k0 + i * k_stride + d);
      for (int g = 0; g < GN; ++g) acc[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kd, acc[g][i]);
    }
  }
  for (int g = 0; g < GN; ++g) {   // the 4 keys' sums in order: per 128-bit half, then the halves added
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(scores + g * len, _mm_mul_ps(sum, _mm_set1_ps(scale)));
  }
}
#endif

constexpr int64_t kAheadMaxKeys = 256;   // longer next tasks are not fetched ahead (decode_attention_kernel)
// The next task's K or V rows [0, len), fetched a share at a time while this task's scores or values
// run: by the time this loop has done `done` of its `total` steps, rows up to len * done / total.
// (The hardware prefetcher barely ramps up on a task's few-KB streams: at 150 keys this beat
// fetching only the first rows ahead.)
template <typename KV>
struct AheadRows {
  const KV* p = nullptr;
  int64_t stride = 0, len = 0, D = 0, sent = 0;
  inline void upto(int64_t done, int64_t total) {
#if defined(__AVX512F__) || defined(PLAIT_AVX2)
    const int64_t r1 = p == nullptr ? 0 : len * done / total;
    for (; sent < r1; ++sent) prefetch_row(p + sent * stride, D);
#endif
  }
};

// scores[j] = scale * q . k_j for the G queries of one KV head (G rows of `scores`, stride len; q
// contiguous, float32, or bfloat16 with bfloat16 keys and D % 32 == 0: see dot_scores);
// `v` (may be null): the values that come next, whose first rows are prefetched at the end; `next`
// (may be null): the next task's keys, fetched a share per block of 8.
template <typename QT, typename KV>
void attention_scores(const QT* q, const KV* k, int64_t k_stride, int64_t len, int64_t G, int64_t D,
                      float scale, float* scores, const KV* v = nullptr, int64_t v_stride = 0,
                      AheadRows<KV>* next = nullptr) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    // Blocks of 8 keys for up to 3 queries at once: each key chunk is loaded (and widened) once
    // for all of them, 24 independent accumulators keep the FMA units busy.
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t ahead = prefetch_rows<KV>(D);
    auto keys = [&](auto dc) {   // the head dim as a compile-time constant where it is a common one
      constexpr int DC = decltype(dc)::value;
      auto block = [&](int64_t j0) {   // keys j0 .. j0 + 7
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
          const QT* qg = q + g0 * D;
          const KV* k0 = k + j0 * k_stride;
          float* sg = scores + g0 * len + j0;
          switch (std::min<int64_t>(3, G - g0)) {
            case 3: scores_block8<3, DC>(qg, k0, k_stride, D, vscale, sg, len); break;
            case 2: scores_block8<2, DC>(qg, k0, k_stride, D, vscale, sg, len); break;
            default: scores_block8<1, DC>(qg, k0, k_stride, D, vscale, sg, len); break;
          }
        }
      };
      int64_t j = 0;
      for (; j + 8 <= len; j += 8) {
        for (int64_t r = j + ahead; r < j + ahead + 8; ++r) {
          if (r < len) prefetch_row(k + r * k_stride, D);
          else if (v != nullptr && r - len < len) prefetch_row(v + (r - len) * v_stride, D);
        }
        if (next != nullptr) next->upto(j + 8, len);
        block(j);
      }
      if (j < len && len >= 8) {   // the last keys as one more block, overlapping the one before
        block(len - 8);
        j = len;
      }
      for (; j < len; ++j) scores_one(q, k + j * k_stride, G, D, scale, scores + j, len);
    };
    // the head dim as a constant (scores_block8's DC) sped up bfloat16 q and K (a bfloat16 model's
    // steps) and slowed float32 K/V, so that path keeps a run-time D
    if (dot_scores<QT, KV>() && D == 64) keys(std::integral_constant<int, 64>{});
    else if (dot_scores<QT, KV>() && D == 128) keys(std::integral_constant<int, 128>{});
    else keys(std::integral_constant<int, 0>{});
    return;
  }
#elif defined(PLAIT_AVX2)
  if constexpr (std::is_same_v<QT, float>) {
    if (D % 8 == 0 && len >= 4) {
      const int64_t ahead = prefetch_rows<KV>(D);
      auto block = [&](int64_t j0) {   // keys j0 .. j0 + 3, up to 3 queries at a time
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
          const float* qg = q + g0 * D;
          const KV* k0 = k + j0 * k_stride;
          float* sg = scores + g0 * len + j0;
          switch (std::min<int64_t>(3, G - g0)) {
            case 3: scores_block4<3>(qg, k0, k_stride, D, scale, sg, len); break;
            case 2: scores_block4<2>(qg, k0, k_stride, D, scale, sg, len); break;
            default: scores_block4<1>(qg, k0, k_stride, D, scale, sg, len); break;
          }
        }
      };
      int64_t j = 0;
      for (; j + 4 <= len; j += 4) {
        for (int64_t r = j + ahead; r < j + ahead + 4; ++r) {
          if (r < len) prefetch_row(k + r * k_stride, D);
          else if (v != nullptr && r - len < len) prefetch_row(v + (r - len) * v_stride, D);
        }
        if (next != nullptr && (j & 7) == 4) next->upto(j + 4, len);
        block(j);
      }
      if (j < len) block(len - 4);   // the last keys as one more block, overlapping the one before
      return;
    }
  }
#endif
  for (int64_t j = 0; j < len; ++j) {
    const KV* kj = k + j * k_stride;
    for (int64_t g = 0; g < G; ++g) {
      const QT* qg = q + g * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += f32(qg[d]) * f32(kj[d]);
      scores[g * len + j] = dot * scale;
    }
  }
}

// In place: s[0, len) -> exp(s - max(s)); returns (max(s), the sum of the exps).
inline std::pair<float, float> exp_inplace(float* s, int64_t len) {
#if defined(__AVX512F__)
  // by vectors, the last one masked (perf: std::max_element's scalar chain held a large share of a
  // bfloat16 task's samples; it is gone, and with it the tail's std::exp calls and the
  // per-probability division)
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16)) - 1);
  const int64_t full = len - len % 16;
  __m512 vmax = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), tail, s + full);
  for (int64_t j = 0; j < full; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx));
    _mm512_storeu_ps(s + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (tail) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), vmx));
    _mm512_mask_storeu_ps(s + full, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
  }
  return {mx, _mm512_reduce_add_ps(vsum)};
#elif defined(PLAIT_AVX2)
  const int64_t full = len - len % 8;
  const __m256i tail = lanes8(len % 8);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vmax = _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + full, tail), _mm256_castsi256_ps(tail));
  for (int64_t j = 0; j < full; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  const float mx = reduce_max8(vmax);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (len % 8) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + full, tail), vmx)), _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(s + full, tail, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return {mx, reduce_add8(vsum)};
#else
  const float mx = *std::max_element(s, s + len);
  float sum = 0.f;
  for (int64_t j = 0; j < len; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  return {mx, sum};
#endif
}

// y[0, n) = x * scale, stored as T.
template <typename T>
inline void store_scaled(const float* x, float scale, int64_t n, T* y) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(y + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(scale)));
#elif defined(PLAIT_AVX2)
  for (; i + 8 <= n; i += 8) store8(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(scale)));
#endif
  for (; i < n; ++i) y[i] = T(x[i] * scale);
}

#if defined(__AVX512F__)
// acc[g] = sum_j p[g][j] * v_j with all G queries' accumulators in registers (G and the D / 16
// chunks known at compile time: indexed at run time, the array lived on the stack); v_j read once;
// `next` (may be null): the next task's values, fetched a share per 8 rows.
template <int G, int CH, typename KV>
void values_in_registers(const float* p, const KV* v, int64_t v_stride, int64_t len, float* acc,
                         AheadRows<KV>* next) {
  __m512 a[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) a[g][c] = _mm512_setzero_ps();
  const int64_t ahead = prefetch_rows<KV>(16 * CH);
  for (int64_t j = 0; j < len; ++j) {
    const KV* vj = v + j * v_stride;
    if (j + ahead < len) prefetch_row(vj + ahead * v_stride, 16 * CH);
    if (next != nullptr && (j & 7) == 7) next->upto(j + 1, len);
    __m512 pg[G];
    for (int g = 0; g < G; ++g) pg[g] = _mm512_set1_ps(p[g * len + j]);
    for (int c = 0; c < CH; ++c) {
      const __m512 vc = load16(vj + 16 * c);
      for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(pg[g], vc, a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * 16 * CH + 16 * c, a[g][c]);
}
#endif

#if defined(PLAIT_AVX2)
// acc[g][c0, c0 + 8 CH) = sum_j p[g][j] * v_j[c0, c0 + 8 CH) (acc rows D apart): 16 registers hold
// G * CH accumulators, so a head of 64 dims takes two passes over its values (the second from L1/L2).
template <int G, int CH, typename KV>
void values_in_registers8(const float* p, const KV* v, int64_t v_stride, int64_t len, int64_t D, float* acc,
                          bool fetch, AheadRows<KV>* next) {
  __m256 a[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) a[g][c] = _mm256_setzero_ps();
  const int64_t ahead = prefetch_rows<KV>(D);
  for (int64_t j = 0; j < len; ++j) {
    const KV* vj = v + j * v_stride;
    if (fetch) {   // (the first pass: the rows whole, and the next task's values)
      if (j + ahead < len) prefetch_row(vj + ahead * v_stride, D);
      if (next != nullptr && (j & 7) == 7) next->upto(j + 1, len);
    }
    __m256 pg[G];
    for (int g = 0; g < G; ++g) pg[g] = _mm256_set1_ps(p[g * len + j]);
    for (int c = 0; c < CH; ++c) {
      const __m256 vc = load8(vj + 8 * c);
      for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(pg[g], vc, a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + g * D + 8 * c, a[g][c]);
}
#endif

// acc[g] = sum_j p[g][j] * v_j for the G queries.
template <typename KV>
void attention_values(const float* p, const KV* v, int64_t v_stride, int64_t len, int64_t G, int64_t D, float* acc,
                      AheadRows<KV>* next = nullptr) {
#if defined(__AVX512F__)
#define PLAIT_VALUES(g, ch) \
  if (G == g && D == 16 * ch) return values_in_registers<g, ch>(p, v, v_stride, len, acc, next);
  PLAIT_VALUES(1, 4) PLAIT_VALUES(2, 4) PLAIT_VALUES(3, 4) PLAIT_VALUES(4, 4) PLAIT_VALUES(5, 4) PLAIT_VALUES(6, 4)
  PLAIT_VALUES(1, 8) PLAIT_VALUES(2, 8) PLAIT_VALUES(3, 8) PLAIT_VALUES(4, 8)
#undef PLAIT_VALUES
#elif defined(PLAIT_AVX2)
  if (G <= 3 && D % 32 == 0) {   // 4 chunks of 8 dims a pass; the first pass fetches ahead
    for (int64_t c0 = 0; c0 < D; c0 += 32) {
      if (G == 1) values_in_registers8<1, 4>(p, v + c0, v_stride, len, D, acc + c0, c0 == 0, next);
      else if (G == 2) values_in_registers8<2, 4>(p, v + c0, v_stride, len, D, acc + c0, c0 == 0, next);
      else values_in_registers8<3, 4>(p, v + c0, v_stride, len, D, acc + c0, c0 == 0, next);
    }
    return;
  }
  if (G <= 6 && D % 16 == 0) {
    for (int64_t c0 = 0; c0 < D; c0 += 16) {
      switch (G) {
#define PLAIT_VALUES8(g) case g: values_in_registers8<g, 2>(p, v + c0, v_stride, len, D, acc + c0, c0 == 0, next); break;
        PLAIT_VALUES8(1) PLAIT_VALUES8(2) PLAIT_VALUES8(3) PLAIT_VALUES8(4) PLAIT_VALUES8(5) PLAIT_VALUES8(6)
#undef PLAIT_VALUES8
      }
    }
    return;
  }
#endif
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    const KV* vj = v + j * v_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * len + j];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * f32(vj[d]);
    }
  }
}

// q [n, H, D] in its own dtype Q and strides (unit stride in D): each task widens its G queries to
// float32 (bfloat16 q and K/V: the scores take them as they are) and writes its output rows in Q, so a
// bfloat16 model's step pays no copies around the op.
template <typename KV, typename Q>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* lens,
                             const int64_t* rows, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t G = H / KVH;
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const KV* kp = k.data_ptr<KV>();
  const KV* vp = v.data_ptr<KV>();
  int64_t max_len = 0;
  auto row = [rows](int64_t b) { return rows ? rows[b] : b; };   // batch row b's K/V row
  for (int64_t b = 0; b < n; ++b) max_len = std::max(max_len, lens[row(b)]);
  // Fewer (row, KV head) tasks than twice the threads (batch 1 on SmolLM2: 3 tasks, 2 threads, one
  // idle a third of the time): each task's keys are split into `parts`, each part's softmax kept
  // unnormalized with its max and sum, and the parts merged after (as flash-decoding does).
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1;
  while (n * KVH * parts < 2 * threads && max_len >= 128 * 2 * parts && parts < 8) parts *= 2;
  const int64_t per_task = std::max<int64_t>(1, 2 * G * max_len * D / parts);
  std::vector<float> partial(parts > 1 ? n * KVH * parts * G * (D + 2) : 0);   // [task][g]: max, sum, o[D]
  // the scores take bfloat16 q as it lies (a KV head's G query rows contiguous, as the qkv view has them)
  // strides as plain numbers and the buffers as plain pointers: in the task loop a Tensor's stride()
  // (an out-of-line call with its dim check) and a thread_local (a __tls_get_addr call) per q element
  // held most of a short task's time
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const bool dot = dot_scores<Q, KV>() && D % 32 == 0 && qs1 == D;
  const int64_t tasks = n * KVH * parts;
  parallel_shares(tasks, grain(per_task, 1 << 17), grain(per_task, 1 << 18), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores_buf, qf_buf, of_buf, inv_buf;
    float* const scores = at_least(scores_buf, G * std::max<int64_t>((max_len + parts - 1) / parts, 1));
    float* const qf = at_least(qf_buf, G * D);
    float* const of = at_least(of_buf, G * D);
    float* const inv = at_least(inv_buf, G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (KVH * parts), kvh = task / parts % KVH, part = task % parts;
      const int64_t m = row(b), j0 = lens[m] * part / parts, len = lens[m] * (part + 1) / parts - j0;
      const Q* q0 = qp + b * qs0 + kvh * G * qs1;   // the G queries of this KV head
      for (int64_t g = 0; g < G && !dot; ++g)           // as float32 rows
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = f32(q0[g * qs1 + d]);
      Q* ob = op + (b * H + kvh * G) * D;
      float* pt = partial.data() + task * G * (D + 2);
      if (len <= 0) {
        if (parts == 1) std::fill(ob, ob + G * D, Q(0.f));
        else for (int64_t g = 0; g < G; ++g) pt[g * (D + 2)] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const KV* kb = kp + m * ks0 + kvh * ks1 + j0 * ks2;
      const KV* vb = vp + m * vs0 + kvh * vs1 + j0 * vs2;
      AheadRows<KV> nk, nv;   // the next task's keys while these scores run, its values while these values do
      if (task + 1 < tasks) {   // past `end` too: a thread's next chunk usually follows
        const int64_t nb = (task + 1) / (KVH * parts), nkvh = (task + 1) / parts % KVH, npart = (task + 1) % parts;
        const int64_t nm = row(nb), n0 = lens[nm] * npart / parts, nlen = lens[nm] * (npart + 1) / parts - n0;
        // Only short streams, which the hardware prefetcher does not ramp up on in time: a longer one
        // it fetches itself, and fetching it here too slowed every long case (kAheadMaxKeys)
        if (nlen < kAheadMaxKeys) {
          nk = {kp + nm * ks0 + nkvh * ks1 + n0 * ks2, ks2, nlen, D};
          nv = {vp + nm * vs0 + nkvh * vs1 + n0 * vs2, vs2, nlen, D};
        }
      }
      if (dot) attention_scores(q0, kb, ks2, len, G, D, scale, scores, vb, vs2, &nk);
      else attention_scores(qf, kb, ks2, len, G, D, scale, scores, vb, vs2, &nk);
      nk.upto(1, 1);
      if (parts == 1) {   // the exps' sums divide the output, not each probability
        for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / exp_inplace(scores + g * len, len).second;
        attention_values(scores, vb, vs2, len, G, D, of, &nv);
        for (int64_t g = 0; g < G; ++g) store_scaled(of + g * D, inv[g], D, ob + g * D);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const auto [mx, sum] = exp_inplace(scores + g * len, len);
        pt[g * (D + 2)] = mx;
        pt[g * (D + 2) + 1] = sum;
      }
      attention_values(scores, vb, vs2, len, G, D, of, &nv);
      for (int64_t g = 0; g < G; ++g) std::copy(of + g * D, of + (g + 1) * D, pt + g * (D + 2) + 2);
    }
  });
  if (parts == 1) return;
  std::vector<float> acc(D);
  for (int64_t t = 0; t < n * KVH; ++t) {   // merge: o = sum_p e_p o_p / sum_p e_p sum_p, e_p = exp(max_p - max)
    const int64_t b = t / KVH, kvh = t % KVH;
    Q* ob = op + (b * H + kvh * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* p0 = partial.data() + t * parts * G * (D + 2) + g * (D + 2);
      const int64_t stride = G * (D + 2);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, p0[p * stride]);
      if (mx == -std::numeric_limits<float>::infinity()) {   // no keys at all
        std::fill(ob + g * D, ob + (g + 1) * D, Q(0.f));
        continue;
      }
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const float* pp = p0 + p * stride;
        if (pp[0] == -std::numeric_limits<float>::infinity()) continue;
        const float e = std::exp(pp[0] - mx);
        sum += e * pp[1];
        for (int64_t d = 0; d < D; ++d) acc[d] += e * pp[2 + d];
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) ob[g * D + d] = Q(acc[d] * inv);
    }
  }
}

// rows (optional, int64 [n]): batch row b attends K/V row rows[b] with lens[rows[b]] (a decode mirror
// whose rows are held in another order than the batch's); by default row b.
// out: contiguous, q's shape and dtype; made here when undefined.
void decode_attention_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                           double scale, const c10::optional<at::Tensor>& rows, at::Tensor& out) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "decode_attention: q must be float32 or bfloat16 [n, heads, head_dim]");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "decode_attention: k and v must be [n, kv_heads, length, head_dim] alike");
  TORCH_CHECK(k.size(0) >= q.size(0) && k.size(3) == q.size(2) && q.size(1) % k.size(1) == 0,
              "decode_attention: q and k/v shapes disagree");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: head_dim must have unit stride");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() >= q.size(0),
              "decode_attention: lens must be int64 [>= n]");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* rp = nullptr;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == q.size(0),
                "decode_attention: rows must be int64 [n]");
    rp = rows->data_ptr<int64_t>();
  }
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t m = rp ? rp[b] : b;
    TORCH_CHECK(m >= 0 && m < k.size(0) && m < lens.numel(), "decode_attention: a row's K/V row is out of range");
    TORCH_CHECK(lp[m] <= k.size(2), "decode_attention: a row's length exceeds its keys");
  }
  const at::Tensor qs = q.stride(2) == 1 ? q : q.contiguous();
  if (!out.defined()) out = at::empty(q.sizes(), q.options());   // the output in the query's dtype
  else check_out(out, q.sizes(), q.scalar_type(), "decode_attention");
  const float sc = static_cast<float>(scale);
  with_kv_type(k.scalar_type(), "decode_attention", [&](auto kv_type) {
    using KV = decltype(kv_type);
    if (q.scalar_type() == at::kFloat) decode_attention_kernel<KV, float>(qs, k, v, lp, rp, sc, out);
    else decode_attention_kernel<KV, c10::BFloat16>(qs, k, v, lp, rp, sc, out);
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            double scale, const c10::optional<at::Tensor>& rows) {
  at::Tensor out;
  decode_attention_into(q, k, v, lens, scale, rows, out);
  return out;
}

}  // namespace PLAIT_NS
