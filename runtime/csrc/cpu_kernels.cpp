// plait's fused CPU kernels for the decoder's small ops (see runtime/cpu_kernels.py).
//
// At decode batch sizes each of these ops touches a few KB, so in eager PyTorch their cost is
// dispatch and thread wake-ups, not arithmetic: an RMSNorm is ~8 aten ops, RoPE ~9, SDPA on 3
// queries per KV head ~50 us. Each kernel here is one op. Small work runs on the calling thread
// (no OpenMP region to wake); large work (prefill, big batches) is split with at::parallel_for, the
// projections' weights with parallel_shares (a thread done early takes over part of a slower one's).
//
// bfloat16 follows Hugging Face transformers' rounding step by step (each intermediate the
// eager model rounds to bfloat16 is rounded here too), so RoPE equals the eager op
// bit for bit; sums (the norm's mean of squares, attention) run in another order than PyTorch's,
// which moves float32 results by rounding noise and, rarely, a bfloat16 norm output by one step.
// Built with -ffp-contract=off so that a*b + c is never fused into one rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// CPUs with AVX2 but no AVX-512 (AMD before Zen 4, Intel client cores) take 8-wide versions of the
// hot kernels; each AVX-512 block below keeps its own path, the AVX2 one is the #elif.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PLAIT_AVX2 1
#endif

namespace {

inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }
// 8-bit K/V (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): stored by c10's conversions (round to nearest
// even; e4m3 saturates at +-448), read back exactly (every fp8 value is a float16 value).
inline float f32(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float f32(c10::Float8_e5m2 x) { return static_cast<float>(x); }

// f(a value of the C++ type) for a pool's or mirror's dtype: float32, bfloat16 or fp8 (e4m3fn, e5m2).
template <typename F>
void with_kv_type(at::ScalarType t, const char* op, const F& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kFloat8_e4m3fn: return f(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return f(c10::Float8_e5m2{});
    default: TORCH_CHECK(false, op, ": K/V must be float32, bfloat16 or fp8 (e4m3fn, e5m2), got ", t);
  }
}

// The value a tensor of type T stores for x (bfloat16: round to nearest even).
template <typename T> inline float stored(float x) { return x; }
template <> inline float stored<c10::BFloat16>(float x) { return static_cast<float>(c10::BFloat16(x)); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// An output the caller made (the `_into` kernels write into it): contiguous, the shape and dtype
// the kernel would have made.
void check_out(const at::Tensor& y, at::IntArrayRef sizes, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(y.is_contiguous() && y.sizes() == sizes && y.scalar_type() == dtype, op, ": out must be contiguous ",
              sizes, " ", dtype, ", got ", y.sizes(), " ", y.scalar_type());
}

// Rows per parallel task so that a task is at least ~`work` multiply-adds.
int64_t grain(int64_t per_row, int64_t work = 32768) {
  return std::max<int64_t>(1, work / std::max<int64_t>(1, per_row));
}

// f(begin, end) over [0, n) on up to n / min_share threads. Thread t owns the t-th equal share and
// takes it front to back in chunks (one stream, as a static split); a thread done with its own
// takes chunks from the back of the share with the most left. On this host a vCPU's speed drifts
// with what shares its core, and with a static split every op waits for the slower thread (bf16+int4
// batch 1, 120 GEMVs a step: the slower thread's run ~6% above the mean).
constexpr int kMaxShares = 64;
struct alignas(64) Share {
  std::atomic<uint64_t> range;   // front << 32 | back
};
inline uint64_t pack_range(int64_t front, int64_t back) {
  return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
}
inline int64_t range_front(uint64_t r) { return static_cast<int64_t>(r >> 32); }
inline int64_t range_back(uint64_t r) { return static_cast<int64_t>(r & 0xFFFFFFFFu); }
template <typename F>
void parallel_shares(int64_t n, int64_t min_share, int64_t chunk, const F& f) {
  if (n >= (int64_t{1} << 31)) {   // past what a share's packed range holds: a static split
    at::parallel_for(0, n, min_share, f);
    return;
  }
  const int64_t T = std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), kMaxShares,
                                       std::max<int64_t>(1, n / std::max<int64_t>(1, min_share))});
  if (T <= 1 || at::in_parallel_region()) {
    f(int64_t{0}, n);
    return;
  }
  Share shares[kMaxShares];
  for (int64_t t = 0; t < T; ++t) shares[t].range.store(pack_range(t * n / T, (t + 1) * n / T), std::memory_order_relaxed);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (;;) {   // own share, from the front
        uint64_t r = shares[t].range.load(std::memory_order_relaxed);
        const int64_t front = range_front(r), back = range_back(r);
        if (front >= back) break;
        const int64_t end = std::min(back, front + chunk);
        if (shares[t].range.compare_exchange_weak(r, pack_range(end, back), std::memory_order_relaxed)) f(front, end);
      }
      for (;;) {   // others', from the back of the one with the most left
        int64_t best = -1;
        uint64_t r = 0;
        for (int64_t s = 0; s < T; ++s) {
          const uint64_t rs = shares[s].range.load(std::memory_order_relaxed);
          if (range_back(rs) - range_front(rs) > (best < 0 ? 0 : range_back(r) - range_front(r))) best = s, r = rs;
        }
        if (best < 0) break;
        const int64_t front = range_front(r), back = range_back(r), begin = std::max(front, back - chunk);
        if (shares[best].range.compare_exchange_weak(r, pack_range(front, begin), std::memory_order_relaxed)) f(begin, back);
      }
    }
  });
}

// v's first n elements, v grown (never shrunk) to hold them: a thread's scratch kept across calls.
template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// f(std::integral_constant<int, rows>{}) for rows in 1..R: a kernel templated on its rows of x.
template <int R, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// The integer GEMVs' loop: blocks [0, n) over the threads (parallel_shares), each thread's blocks in
// chunks; each chunk taken by every block of up to R rows of x in turn while its weights sit in L1/L2
// (a weight is unpacked once per block of rows, read from memory once). f(rows, r0, c0, c1): rows
// [r0, r0 + rows) of x, rows a std::integral_constant, against blocks [c0, c1).
template <int R, typename F>
void row_blocks_over_chunks(int64_t n, int64_t M, int64_t min_share, int64_t chunk, const F& f) {
  parallel_shares(n, min_share, chunk, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(b1, c0 + chunk);
      for (int64_t r0 = 0; r0 < M; r0 += R)
        with_rows<R>(std::min<int64_t>(R, M - r0), [&](auto rows) { f(rows, r0, c0, c1); });
    }
  });
}

// For tests: which thread ran each index of [0, n) under parallel_shares (-1: none, -2: more than
// once), thread 0 sleeping `slow_us` in each chunk it runs, so that the others take from its share.
at::Tensor shares_coverage(int64_t n, int64_t min_share, int64_t chunk, int64_t slow_us) {
  TORCH_CHECK(n >= 0 && min_share >= 1 && chunk >= 1, "shares_coverage: n >= 0, min_share >= 1, chunk >= 1");
  std::vector<std::atomic<int64_t>> who(n);
  for (auto& w : who) w.store(-1);
  parallel_shares(n, min_share, chunk, [&](int64_t begin, int64_t end) {
    const int64_t t = at::get_thread_num();
    if (t == 0 && slow_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
    for (int64_t i = begin; i < end; ++i) {
      int64_t none = -1;
      if (!who[i].compare_exchange_strong(none, t)) who[i].store(-2);
    }
  });
  at::Tensor out = at::empty({n}, at::kLong);
  for (int64_t i = 0; i < n; ++i) out.data_ptr<int64_t>()[i] = who[i].load();
  return out;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// fp8 as float16 bits, then F16C: e5m2 is a float16's high byte; e4m3's sign, exponent and 3
// mantissa bits placed as a float16's (exponent bias 15 against 7: the value times 2^-8, exact for
// normals and subnormals alike), scaled back by 2^8. (NaN, never stored, would read as 480.)
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define PLAIT_AVX512BW_VL 1   // masked 16-bit stores
#endif
// float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7FC0: what c10::BFloat16(float) does.
inline __m256i to_bf16_bits(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}
// The value a T stores for v, as float32.
inline __m512 stored16(float*, __m512 v) { return v; }
inline __m512 stored16(c10::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}
// e^x for x <= 0 (scores minus their max): 2^n * p(r), |r| <= ln2/2, degree-6 Taylor (~2e-7 rel).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(PLAIT_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp8 as in load16's
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
// float32 -> bfloat16 bits, round to nearest even, NaN -> 0x7FC0 (as to_bf16_bits).
inline __m128i to_bf16_bits8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_bits8(v)); }
inline __m256 stored8(float*, __m256 v) { return v; }
inline __m256 stored8(c10::BFloat16*, __m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_bits8(v)), 16));
}
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// The first n (0..8) lanes.
inline __m256i lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// e^x as exp16: 2^n * p(r), 2^n built in the exponent bits (n in [-126, 127] for x in [-87, 88]).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// ---- RMSNorm, optionally after a residual add --------------------------------------------------
template <typename T>
void rms_norm_kernel(T* x, const T* delta, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain(dim, 1 << 12), [&](int64_t begin, int64_t end) {   // 32 rows: 9.6 -> 6.8 us
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* yr = y + r * dim;
#if defined(__AVX512F__)
      if (dim % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        if (delta != nullptr) {
          const T* dr = delta + r * dim;
          for (int64_t i = 0; i < dim; i += 16) {
            const __m512 v = stored16(xr, _mm512_add_ps(load16(xr + i), load16(dr + i)));
            store16(xr + i, v);
            acc = _mm512_fmadd_ps(v, v, acc);
          }
        } else {
          for (int64_t i = 0; i < dim; i += 16) {
            const __m512 v = load16(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
          }
        }
        const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(dim) + eps));
        for (int64_t i = 0; i < dim; i += 16)
          store16(yr + i, _mm512_mul_ps(stored16(yr, _mm512_mul_ps(load16(xr + i), inv)), load16(w + i)));
        continue;
      }
#elif defined(PLAIT_AVX2)
      if (dim % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        const T* dr = delta != nullptr ? delta + r * dim : nullptr;
        for (int64_t i = 0; i < dim; i += 8) {
          __m256 v = load8(xr + i);
          if (dr != nullptr) {
            v = stored8(xr, _mm256_add_ps(v, load8(dr + i)));
            store8(xr + i, v);
          }
          acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(reduce_add8(acc) / static_cast<float>(dim) + eps));
        for (int64_t i = 0; i < dim; i += 8)
          store8(yr + i, _mm256_mul_ps(stored8(yr, _mm256_mul_ps(load8(xr + i), inv)), load8(w + i)));
        continue;
      }
#endif
      float ss = 0.f;
      if (delta != nullptr) {   // the residual stream: x += delta, rounded as the model rounds it
        const T* dr = delta + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          T v = T(f32(xr[i]) + f32(dr[i]));
          xr[i] = v;
          float fv = f32(v);
          ss += fv * fv;
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) {
          float fv = f32(xr[i]);
          ss += fv * fv;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      // HF: (x * rsqrt(var + eps)) cast to the input dtype, then times the weight.
      for (int64_t i = 0; i < dim; ++i) yr[i] = T(stored<T>(f32(xr[i]) * inv) * f32(w[i]));
    }
  });
}

// y: contiguous, shaped and typed as x; made here when undefined.
void rms_norm_into(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w, double eps, at::Tensor& y) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rms_norm: contiguous tensors only");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must match x");
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  TORCH_CHECK(w.numel() == dim, "rms_norm: weight has ", w.numel(), " elements, x rows ", dim);
  if (delta) {
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                "add_rms_norm: delta must be contiguous, shaped and typed as x");
  }
  if (!y.defined()) y = at::empty_like(x);
  else check_out(y, x.sizes(), x.scalar_type(), "rms_norm");
  if (x.scalar_type() == at::kFloat) {
    rms_norm_kernel<float>(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr,
                           w.data_ptr<float>(), y.data_ptr<float>(), rows, dim, static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_kernel<c10::BFloat16>(x.data_ptr<c10::BFloat16>(),
                                   delta ? delta->data_ptr<c10::BFloat16>() : nullptr,
                                   w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, dim,
                                   static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only, got ", x.scalar_type());
  }
}

at::Tensor rms_norm_impl(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w, double eps) {
  at::Tensor y;
  rms_norm_into(x, delta, w, eps, y);
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, c10::nullopt, w, eps);
}

// x += delta (in place), then RMSNorm(x).
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  return rms_norm_impl(x, delta, w, eps);
}

// ---- rotate-half RoPE, in place ----------------------------------------------------------------
template <typename T>
void rope_kernel(T* x, int64_t row_stride, const float* cos, const float* sin, int64_t tokens, int64_t heads,
                 int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim), s(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < head_dim; ++i) {   // the tables, as the model's dtype holds them
        c[i] = stored<T>(cos[t * head_dim + i]);
        s[i] = stored<T>(sin[t * head_dim + i]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x + t * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = f32(p[i]), b = f32(p[i + half]);
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded.
          const float lo = stored<T>(a * c[i]) + stored<T>(-b * s[i]);
          const float hi = stored<T>(b * c[i + half]) + stored<T>(a * s[i + half]);
          p[i] = T(lo);
          p[i + half] = T(hi);
        }
      }
    }
  });
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rope_: x must be [tokens, width] with unit column stride");
  TORCH_CHECK(x.size(1) >= heads * head_dim && head_dim % 2 == 0, "rope_: x narrower than heads * head_dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == x.size(0) * head_dim && sin.numel() == cos.numel(),
              "rope_: cos/sin must be contiguous float32 [tokens, head_dim]");
  if (x.scalar_type() == at::kFloat) {
    rope_kernel<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0),
                       heads, head_dim);
  } else if (x.scalar_type() == at::kBFloat16) {
    rope_kernel<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0), cos.data_ptr<float>(),
                               sin.data_ptr<float>(), x.size(0), heads, head_dim);
  } else {
    TORCH_CHECK(false, "rope_: float32 or bfloat16 only, got ", x.scalar_type());
  }
}

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
// gained ~3% at 32 rows x 160 keys, not worth the precision.)
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
// accumulators on the stack (zeroed, stored and reloaded around the sums every 8 keys): bfloat16
// dot products, one thread, keys in L2, 9.4 vs 3.0 ns a key for 3 queries of 64 dims. Only the
// bfloat16 dot products take it: float32 K/V out of cache ran slower with it (see attention_scores).
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
// (The hardware prefetcher barely ramps up on a task's few-KB streams: bfloat16, 30 layers x 150
// keys, 32 / 64 / 128 rows 14-16 / 11-13 / 18-20% faster than fetching only the first rows ahead.)
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
    // bfloat16 q and K (a bfloat16 model's steps), 30 layers' decode attention, A/B in one process,
    // arms alternating (20 rounds, Zen 4, load ~0.5): 1 row x 1024 keys 1.737 -> 1.561 ms, 32 x 512
    // 18.57 -> 18.14; float32 K/V at 32 x 512 29.96 -> 31.73, so that path keeps a run-time D
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
  // by vectors, the last one masked (perf: std::max_element's scalar chain held 13% of a bfloat16
  // task's samples; with it, the tail's std::exp calls and the per-probability division gone, one
  // thread with K/V in cache went from 16.3 to 8.5-11.9 ns a key)
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
  // held ~2/3 of a short task's time (32 rows x 16 keys: 1.2 us a task)
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
        // it fetches itself, and fetching it here too slowed every long case on Zen 4 (30 layers'
        // attention, arms alternating in one process, 16 rounds, load 0.4-1.0, ms with -> without:
        // bfloat16 32 x 512 keys 17.75 -> 15.40, 8 x 1024 8.84 -> 7.94, 1 x 1024 2.51 -> 2.18, float32 32 x
        // 512 33.38 -> 29.09; 150 keys within the noise there: 32 rows 6.53 -> 6.33, 128 rows 25.40 -> 25.17)
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

// ---- the gated MLP's activation: silu(gate) * up ----------------------------------------------------
// gu [T, 2I] (gate then up, as the merged gate_up projection returns them) -> [T, I], one op instead
// of split + silu + mul; bfloat16 rounds silu's result before the product, as the eager model does.
template <typename T>
void silu_mul_kernel(const T* gu, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain(I, 1 << 12), [&](int64_t begin, int64_t end) {   // 32 rows: 27 -> 16 us
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * I;
      const T* u = g + I;
      T* yr = y + r * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= I; i += 16) {
        const __m512 gv = load16(g + i);
        const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(88.f)));
        const __m512 silu = stored16(yr, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store16(yr + i, _mm512_mul_ps(silu, load16(u + i)));
      }
#elif defined(PLAIT_AVX2)
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.f)));
        const __m256 silu = stored8(yr, _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
        store8(yr + i, _mm256_mul_ps(silu, load8(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float gf = f32(g[i]);
        yr[i] = T(stored<T>(gf / (1.f + std::exp(-gf))) * f32(u[i]));
      }
    }
  });
}

// y: contiguous [T, I] in gu's dtype; made here when undefined.
void silu_mul_into(const at::Tensor& gu, at::Tensor& y) {
  check_cpu(gu, "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "silu_mul: gate_up must be contiguous [T, 2I]");
  const int64_t rows = gu.size(0), I = gu.size(1) / 2;
  if (!y.defined()) y = at::empty({rows, I}, gu.options());
  else check_out(y, {rows, I}, gu.scalar_type(), "silu_mul");
  if (gu.scalar_type() == at::kFloat) silu_mul_kernel(gu.data_ptr<float>(), y.data_ptr<float>(), rows, I);
  else if (gu.scalar_type() == at::kBFloat16)
    silu_mul_kernel(gu.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, I);
  else TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only, got ", gu.scalar_type());
}

at::Tensor silu_mul(const at::Tensor& gu) {
  at::Tensor y;
  silu_mul_into(gu, y);
  return y;
}

// ---- this step's K/V into the pool and, optionally, the decode mirror ----------------------------
// k, v [T, KVH, D] (unit stride in D; e.g. views into the qkv projection), in the model's dtype;
// pool_k/v [slots, KVH, D] contiguous, in the KV dtype: token t goes to slot slots[t]. The mirror
// (contiguous, any shape, viewed as rows of D) takes token t's head h at row mirror_at[t * KVH + h].
template <typename S, typename T>
void kv_write_kernel(const at::Tensor& k, const at::Tensor& v, T* pool_k, T* pool_v, const int64_t* slots,
                     T* mirror_k, T* mirror_v, const int64_t* mirror_at) {
  const int64_t tokens = k.size(0), heads = k.size(1), D = k.size(2);
  const S* kp = k.data_ptr<S>();
  const S* vp = v.data_ptr<S>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const S* ks = kp + t * k.stride(0) + h * k.stride(1);
      const S* vs = vp + t * v.stride(0) + h * v.stride(1);
      T* pk = pool_k + (slots[t] * heads + h) * D;
      T* pv = pool_v + (slots[t] * heads + h) * D;
      if constexpr (std::is_same<S, T>::value) {   // the model's dtype is the pool's: a copy, not a
        std::copy(ks, ks + D, pk);                  // conversion per element (bf16, 32 rows: 32 -> 21 us a layer)
        std::copy(vs, vs + D, pv);
      } else {
        for (int64_t i = 0; i < D; ++i) {
          pk[i] = T(f32(ks[i]));
          pv[i] = T(f32(vs[i]));
        }
      }
      if (mirror_at != nullptr) {
        std::copy(pk, pk + D, mirror_k + mirror_at[t * heads + h] * D);
        std::copy(pv, pv + D, mirror_v + mirror_at[t * heads + h] * D);
      }
    }
  }
}

void kv_write_(at::Tensor pool_k, at::Tensor pool_v, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v,
               const c10::optional<at::Tensor>& mirror_k, const c10::optional<at::Tensor>& mirror_v,
               const c10::optional<at::Tensor>& mirror_at) {
  check_cpu(pool_k, "pool_k");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.stride(2) == 1 &&
                  v.stride(2) == 1, "kv_write_: k and v must be [tokens, kv_heads, head_dim] alike, unit stride in head_dim");
  TORCH_CHECK(pool_k.is_contiguous() && pool_v.is_contiguous() && pool_k.sizes() == pool_v.sizes() &&
                  pool_k.dim() == 3 && pool_k.size(1) == k.size(1) && pool_k.size(2) == k.size(2) &&
                  pool_k.scalar_type() == pool_v.scalar_type(), "kv_write_: pools must be contiguous [slots, kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "kv_write_: slots must be int64 [tokens]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < pool_k.size(0), "kv_write_: slot out of range");
  const int64_t* ap = nullptr;
  if (mirror_at) {
    TORCH_CHECK(mirror_k && mirror_v && mirror_k->is_contiguous() && mirror_v->is_contiguous() &&
                    mirror_k->scalar_type() == pool_k.scalar_type() && mirror_v->scalar_type() == pool_k.scalar_type() &&
                    mirror_at->scalar_type() == at::kLong && mirror_at->is_contiguous() &&
                    mirror_at->numel() == k.size(0) * k.size(1),
                "kv_write_: the mirror must be contiguous in the pool's dtype, mirror_at int64 [tokens * kv_heads]");
    ap = mirror_at->data_ptr<int64_t>();
    const int64_t rows = std::min(mirror_k->numel(), mirror_v->numel()) / k.size(2);
    for (int64_t i = 0; i < mirror_at->numel(); ++i) TORCH_CHECK(ap[i] >= 0 && ap[i] < rows, "kv_write_: mirror row out of range");
  }
  const at::ScalarType st = k.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16, "kv_write_: k/v must be float32 or bfloat16");
  with_kv_type(pool_k.scalar_type(), "kv_write_", [&](auto dst_type) {
    using T = decltype(dst_type);
    T *mk = ap ? mirror_k->data_ptr<T>() : nullptr, *mv = ap ? mirror_v->data_ptr<T>() : nullptr;
    if (st == at::kFloat) kv_write_kernel<float, T>(k, v, pool_k.data_ptr<T>(), pool_v.data_ptr<T>(), sp, mk, mv, ap);
    else kv_write_kernel<c10::BFloat16, T>(k, v, pool_k.data_ptr<T>(), pool_v.data_ptr<T>(), sp, mk, mv, ap);
  });
}

// ---- float32 / bfloat16 small-M GEMM: the projections at decode batch sizes ----------------------
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x, summed in float32. The weight
// is held in panels of 32 output columns, k-major (`pack_panels` in cpu_kernels.py): float32
// [N/32, K, 32], bfloat16 [N/32, K/2, 32, 2] (pairs of k, as AVX512-BF16's dot product takes them;
// AVX2: [N/32, K, 32], see bf16_panels_k_pairs).
// A row block of up to 12 rows of x runs over a panel with 24 accumulators: per k (pair) two
// loads of the weight, one broadcast and two FMAs (dot products) per row, no horizontal sums. At
// one row that streams the weight at the machine's bandwidth; at 32 float32 rows 362-410 GFLOP/s
// with the weights in cache (oneDNN's GEMM 256-391) and 284-313 streaming them (oneDNN 216-241), of
// a ~440-490 GFLOP/s peak; oneDNN also runs a single row on one core. Each thread streams its own run of panels; a panel's second and
// third row blocks read it from L2, so while it computes, each block prefetches its share of the
// next panel (without that the first pass waited on memory: ~30% slower at 32 rows). Any number of
// rows works (SmolLM2's matrices: faster than oneDNN up to 64 float32 / 128 bfloat16 rows, on par at
// 128 / 256; prepack.py's SMALL_GEMM_MAX_ROWS).
#if defined(PLAIT_AVX512BW_VL) || defined(PLAIT_AVX2)
#define PLAIT_SMALL_GEMM 1
constexpr int64_t kPanel = 32;          // output columns per panel
constexpr int64_t kStreamRowsMin = 8;   // fewer rows' logits (< 1.5 MB on SmolLM2) stay in cache for the sampler
// A bfloat16 result stored widened to float32 (the LM head's logits: no second pass to widen them).
struct WidenedBF16 { float value; };
// Logits of many rows (float32, bfloat16 widened), stored past the caches: the sampler reads them
// once, later. Cached stores first read every line they write (12.6 MB a batch-64 step of SmolLM2)
// and fill L3 with them (LM head [49152, 576], bfloat16, alone: 64 rows 5.71 -> 4.74 ms, 128 rows
// 11.71 -> 9.65; whole batch-64 steps ~1.3 ms less).
template <typename T> struct Streamed { float value; };

// `lines` cache lines from `next` on, spread evenly over a loop of `steps` iterations (`step()` once
// each): a running sum instead of two 64-bit divisions an iteration, which had cost 9-14% at 32 rows
// on SmolLM2's layer matrices (bfloat16 and float32), 15-19% on the LM head, and 5-8% at 1-4 rows.
struct SpreadPrefetch {
  const char* next;
  int64_t lines, steps, acc = 0;
  inline void step() {
    for (acc += lines; acc >= steps; acc -= steps, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};
#endif

#if defined(PLAIT_AVX512BW_VL)
constexpr int64_t kRowBlock = 12;       // rows of x per pass: 24 accumulators + 2 weights + 1 broadcast

inline void store_cols(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_cols(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v));
}
inline void store_cols(WidenedBF16* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(reinterpret_cast<float*>(p), m, stored16(static_cast<c10::BFloat16*>(nullptr), v));
}
inline void stream_cols(float* p, __m512 v, __mmask16 m) {
  if (m == 0xFFFF && (reinterpret_cast<uintptr_t>(p) & 63) == 0) _mm512_stream_ps(p, v);
  else _mm512_mask_storeu_ps(p, m, v);
}
inline void store_cols(Streamed<float>* p, __m512 v, __mmask16 m) { stream_cols(reinterpret_cast<float*>(p), v, m); }
inline void store_cols(Streamed<c10::BFloat16>* p, __m512 v, __mmask16 m) {
  stream_cols(reinterpret_cast<float*>(p), stored16(static_cast<c10::BFloat16*>(nullptr), v), m);
}

// MR rows of x against one panel: 32 output columns, `cols` of them real (the last panel's may be
// padding); bias (float32, may be null) at this panel's first column.
template <int MR, typename T, typename O>
inline void panel_rows(const T* x, int64_t K, const T* w, const float* bias, O* y, int64_t N, int64_t cols,
                       const char* pf, int64_t pf_lines) {
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  if constexpr (std::is_same<T, float>::value) {
    SpreadPrefetch ahead{pf, pf_lines, K};
    for (int64_t k = 0; k < K; ++k) {
      ahead.step();
      const __m512 w0 = _mm512_loadu_ps(w + k * kPanel), w1 = _mm512_loadu_ps(w + k * kPanel + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 b = _mm512_set1_ps(x[m * K + k]);
        a0[m] = _mm512_fmadd_ps(b, w0, a0[m]);
        a1[m] = _mm512_fmadd_ps(b, w1, a1[m]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    const int64_t K2 = K / 2;
    SpreadPrefetch ahead{pf, pf_lines, K2};
    for (int64_t k = 0; k < K2; ++k) {
      ahead.step();
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kPanel);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * 2 * kPanel + 32);
      for (int m = 0; m < MR; ++m) {   // x[m, 2k], x[m, 2k + 1] as one 32-bit lane
        const __m512bh b = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * K + 2 * k));
        a0[m] = _mm512_dpbf16_ps(a0[m], b, w0);
        a1[m] = _mm512_dpbf16_ps(a1[m], b, w1);
      }
    }
#endif
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    store_cols(y + m * N, _mm512_add_ps(a0[m], b0), m0);
    store_cols(y + m * N + 16, _mm512_add_ps(a1[m], b1), m1);
  }
}

// Panels [p0, p1) of P; each prefetches the next one (also past p1: a thread's next chunk of panels
// usually follows).
template <typename T, typename O>
void small_gemm_panels(const T* x, int64_t M, int64_t K, const T* w, const float* bias, O* y, int64_t N,
                       int64_t p0, int64_t p1, int64_t P) {
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t panel_lines = K * kPanel * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t share = (panel_lines + blocks - 1) / blocks;   // of the next panel, per row block
  for (int64_t p = p0; p < p1; ++p) {
    const T* wp = w + p * K * kPanel;
    const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = b * M / blocks, r1 = (b + 1) * M / blocks;
      const char* pf = reinterpret_cast<const char*>(wp + K * kPanel) + 64 * share * b;
      const int64_t lines = p + 1 < P ? std::max<int64_t>(0, std::min(share, panel_lines - share * b)) : 0;
      const float* bp = bias ? bias + p * kPanel : nullptr;
      O* yp = y + r0 * N + p * kPanel;
      switch (r1 - r0) {
#define PLAIT_PANEL_ROWS(rows) \
  case rows: panel_rows<rows>(x + r0 * K, K, wp, bp, yp, N, cols, pf, lines); break;
        PLAIT_PANEL_ROWS(1) PLAIT_PANEL_ROWS(2) PLAIT_PANEL_ROWS(3) PLAIT_PANEL_ROWS(4)
        PLAIT_PANEL_ROWS(5) PLAIT_PANEL_ROWS(6) PLAIT_PANEL_ROWS(7) PLAIT_PANEL_ROWS(8)
        PLAIT_PANEL_ROWS(9) PLAIT_PANEL_ROWS(10) PLAIT_PANEL_ROWS(11) PLAIT_PANEL_ROWS(12)
#undef PLAIT_PANEL_ROWS
      }
    }
  }
}
#elif defined(PLAIT_AVX2)
// AVX2 has 16 vector registers: a pass runs up to 6 rows of x against half a panel (16 columns): 12
// accumulators, 2 weights and a broadcast (up to 2 rows: the whole panel, 4 weights). bfloat16 panels
// hold one k a row as float32's do (not AVX512-BF16's pairs), widened 8 weights at a time
// (load16_widened). x comes as float32 (bfloat16 widened once a call); bfloat16 products are exact in
// float32, as AVX512-BF16's are, and each accumulator takes k in order, so a row's arithmetic is the
// same in every row block (a batch's rows equal their batch-1 results). (Even and odd k in separate
// accumulators, 3 rows a block, so that one row's sums are more chains: no faster out of cache at 1-4
// rows, 64 rows ~20% slower.)
constexpr int64_t kRowBlock8 = 6;

// The first n (1..8) of 8 output columns.
inline void store_cols8(float* p, __m256 v, int64_t n) {
  if (n == 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lanes8(n), v);
}
inline void store_cols8(c10::BFloat16* p, __m256 v, int64_t n) {
  if (n == 8) return store8(p, v);
  alignas(16) uint16_t b[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(b), to_bf16_bits8(v));
  std::copy(b, b + n, reinterpret_cast<uint16_t*>(p));
}
inline void store_cols8(WidenedBF16* p, __m256 v, int64_t n) {
  store_cols8(reinterpret_cast<float*>(p), stored8(static_cast<c10::BFloat16*>(nullptr), v), n);
}
inline void stream_cols8(float* p, __m256 v, int64_t n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 31) == 0) _mm256_stream_ps(p, v);
  else store_cols8(p, v, n);
}
inline void store_cols8(Streamed<float>* p, __m256 v, int64_t n) { stream_cols8(reinterpret_cast<float*>(p), v, n); }
inline void store_cols8(Streamed<c10::BFloat16>* p, __m256 v, int64_t n) {
  stream_cols8(reinterpret_cast<float*>(p), stored8(static_cast<c10::BFloat16*>(nullptr), v), n);
}

// A panel row's 16 weights as float32 (w0: columns 0-7, w1: 8-15). bfloat16: each 8 zero-extended
// from memory and shifted into the high halves, so that each broadcast of x feeds both halves' FMAs
// as float32's does. (Panels of k pairs, split by a shift and a mask as AVX512-BF16 lays them out,
// broadcast every x twice: SmolLM2's 120 layer matrices, 32 rows, streamed 122 GFLOP/s, 169 this way.)
inline void load16_widened(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
inline void load16_widened(const c10::BFloat16* w, __m256& w0, __m256& w1) {
  const __m128i* p = reinterpret_cast<const __m128i*>(w);
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
}

// The whole-panel pass of up to 2 rows (V == 4) fetches this many k rows ahead in its own stream (past
// the panel's end: the next panel, which follows it in memory), into L1. Such a pass reads a panel in
// a few microseconds, too soon for the next panel spread over it into L2 to arrive: SmolLM2's 120
// layer matrices and LM head at 1 row, two threads, the two ways alternated in one process, bfloat16
// 12.5-13.3 vs 13.5-14.7 ms (medians of 30-40 rounds, three runs), float32 27.95 vs 28.65 (one run).
constexpr int64_t kStreamAhead = 16;

// MR rows of x (float32) against V x 8 columns of a panel (w: their first weight; k rows 32 weights
// apart), `cols` (1..8V) of them real; bias (may be null) at their first column. (The m and v loops
// unrolled by pragma: left to GCC's heuristics, the accumulator arrays stayed in memory, stored
// every k: 32 rows ~2.5x slower.)
template <int MR, int V, typename T, typename O>
inline void panel_cols_rows(const float* x, int64_t K, const T* w, const float* bias, O* y, int64_t N, int64_t cols,
                            const char* pf, int64_t pf_lines) {
  __m256 a[V][MR];
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) a[v][m] = _mm256_setzero_ps();
  SpreadPrefetch ahead{pf, pf_lines, K};   // (V == 4: unused, fetching ahead in its own stream)
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (V == 4) {   // a k row: 64 bytes of bfloat16, 128 of float32
      const char* a = reinterpret_cast<const char*>(w + (k + kStreamAhead) * kPanel);
      _mm_prefetch(a, _MM_HINT_T0);
      if constexpr (sizeof(T) == 4) _mm_prefetch(a + 64, _MM_HINT_T0);
    } else {
      ahead.step();
    }
    __m256 wv[V];
#pragma GCC unroll 2
    for (int j = 0; j < V / 2; ++j) load16_widened(w + k * kPanel + 16 * j, wv[2 * j], wv[2 * j + 1]);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * K + k);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) a[v][m] = _mm256_fmadd_ps(b, wv[v], a[v][m]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int64_t n = std::min<int64_t>(8, cols - 8 * v);
    if (n <= 0) break;
    const __m256 bv = bias != nullptr ? _mm256_maskload_ps(bias + 8 * v, lanes8(n)) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) store_cols8(y + m * N + 8 * v, _mm256_add_ps(a[v][m], bv), n);
  }
}

// All M rows against one panel (wp), its `cols` real columns. Up to 2 rows: the whole panel in one
// pass (4 vectors of columns: 4-8 chains of FMAs a row, where 2 waited on the FMA latency), fetching
// ahead in its own stream; more: in row blocks of up to 6, each against the two halves of 16 columns
// in turn (12 accumulators), each pass prefetching its share of `next` (`next_lines` cache lines; null:
// none).
template <typename T, typename O>
void panel_passes(const float* x, int64_t M, int64_t K, const T* wp, const char* next, int64_t next_lines,
                  const float* bias, O* y, int64_t N, int64_t cols) {
  if (M <= 2) {   // (fetching ahead in its own stream: kStreamAhead)
    if (M == 1) panel_cols_rows<1, 4>(x, K, wp, bias, y, N, cols, nullptr, 0);
    else panel_cols_rows<2, 4>(x, K, wp, bias, y, N, cols, nullptr, 0);
    return;
  }
  const int64_t blocks = (M + kRowBlock8 - 1) / kRowBlock8, passes = 2 * blocks;
  const int64_t share = (next_lines + passes - 1) / passes;
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t hc = std::min<int64_t>(16, cols - 16 * h);
    for (int64_t b = 0; b < blocks && hc > 0; ++b) {
      const int64_t pass = h * blocks + b, r0 = b * M / blocks, r1 = (b + 1) * M / blocks;
      const char* pf = next + 64 * share * pass;
      const int64_t lines = next != nullptr ? std::max<int64_t>(0, std::min(share, next_lines - share * pass)) : 0;
      const float* bp = bias ? bias + 16 * h : nullptr;
      const T* wh = wp + 16 * h;
      O* yp = y + r0 * N + 16 * h;
      switch (r1 - r0) {
#define PLAIT_HALF_ROWS(rows) \
  case rows: panel_cols_rows<rows, 2>(x + r0 * K, K, wh, bp, yp, N, hc, pf, lines); break;
        PLAIT_HALF_ROWS(1) PLAIT_HALF_ROWS(2) PLAIT_HALF_ROWS(3) PLAIT_HALF_ROWS(4) PLAIT_HALF_ROWS(5) PLAIT_HALF_ROWS(6)
#undef PLAIT_HALF_ROWS
      }
    }
  }
}

// Panels [p0, p1) of P; each prefetches the next one (also past p1: a thread's next chunk of panels
// usually follows). (Widening a bfloat16 panel to float32 once for all row blocks, into L2, and running
// the float32 kernel on it was 2x slower than converting in registers: SmolLM2's 120 matrices, 12 to
// 128 rows, 50-59 vs 87-112 GFLOP/s.)
template <typename T, typename O>
void small_gemm_panels(const float* x, int64_t M, int64_t K, const T* w, const float* bias, O* y, int64_t N,
                       int64_t p0, int64_t p1, int64_t P) {
  const int64_t panel_lines = K * kPanel * static_cast<int64_t>(sizeof(T)) / 64;
  for (int64_t p = p0; p < p1; ++p) {
    const T* wp = w + p * K * kPanel;
    const char* next = p + 1 < P ? reinterpret_cast<const char*>(wp + K * kPanel) : nullptr;
    panel_passes(x, M, K, wp, next, panel_lines, bias ? bias + p * kPanel : nullptr, y + p * kPanel, N,
                 std::min<int64_t>(kPanel, N - p * kPanel));
  }
}
#endif

// Whether small_gemm's bfloat16 panels hold pairs of k ([N/32, K/2, 32, 2], as AVX512-BF16's dot
// product takes them) or one k a row ([N/32, K, 32], as float32's: AVX2, see load16_widened).
bool bf16_panels_k_pairs() {
#if defined(PLAIT_AVX2)
  return false;
#else
  return true;
#endif
}

bool has_small_gemm(bool bf16) {
#if defined(PLAIT_SMALL_GEMM) && (defined(__AVX512BF16__) || defined(PLAIT_AVX2))
  return true;
#elif defined(PLAIT_SMALL_GEMM)
  return !bf16;
#else
  return false;
#endif
}

// widen: the LM head's logits: a bfloat16 product returned as float32 holding the bfloat16 results
// (`.float()` of them); from kStreamRowsMin rows on (any dtype) stored past the caches.
// y: contiguous [M, N], float32 if widen, else x's dtype; made here when undefined.
void small_gemm_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t N,
                     bool widen, at::Tensor& y) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  const bool bf16 = w.scalar_type() == at::kBFloat16, pairs = bf16 && bf16_panels_k_pairs();
  TORCH_CHECK(w.is_contiguous() && (w.scalar_type() == at::kFloat || bf16) && w.dim() == (pairs ? 4 : 3) &&
                  w.size(2) == 32 && (!pairs || w.size(3) == 2),
              "small_gemm: w must be the panels of pack_panels (float32 [N/32, K, 32]; bfloat16 ",
              pairs ? "[N/32, K/2, 32, 2]" : "[N/32, K, 32]", " on this CPU)");
  const int64_t K = pairs ? 2 * w.size(1) : w.size(1), P = w.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.size(0) >= 1, "small_gemm: x must be [M >= 1, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "small_gemm: x and w must have one dtype");
  TORCH_CHECK(N > (P - 1) * 32 && N <= P * 32, "small_gemm: N does not fit the panels");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "small_gemm: bias must be float32 [N]");
  TORCH_CHECK(has_small_gemm(bf16), "small_gemm: this build has no AVX-512", bf16 ? "-BF16" : "", " or AVX2 path");
  if (!y.defined()) y = at::empty({x.size(0), N}, widen ? x.options().dtype(at::kFloat) : x.options());
  else check_out(y, {x.size(0), N}, widen ? at::kFloat : x.scalar_type(), "small_gemm");
#if defined(PLAIT_SMALL_GEMM)
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  const bool stream = widen && M >= kStreamRowsMin;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // each thread streams its own share of panels (at least ~64 KB of weights), in chunks of as many
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * kPanel * static_cast<int64_t>(w.element_size())));
  auto run = [&](const auto* xp, const auto* wp, auto* yp) {
    parallel_shares(P, grain, grain, [&](int64_t p0, int64_t p1) {
      small_gemm_panels(xp, M, K, wp, bp, yp, N, p0, p1, P);
      if (stream) _mm_sfence();   // the streamed stores before the region's end publishes them
    });
  };
  if (bf16) {
#if defined(PLAIT_AVX2)
    thread_local std::vector<float> widened;   // x as float32 (exact), which the AVX2 kernel broadcasts
    float* xf = at_least(widened, M * K);
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
    const float* xp = xf;
#else
    const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
#endif
    const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
    if (stream) run(xp, wp, reinterpret_cast<Streamed<c10::BFloat16>*>(y.data_ptr<float>()));
    else if (widen) run(xp, wp, reinterpret_cast<WidenedBF16*>(y.data_ptr<float>()));
    else run(xp, wp, y.data_ptr<c10::BFloat16>());
  } else {
    const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>();
    if (stream) run(xp, wp, reinterpret_cast<Streamed<float>*>(y.data_ptr<float>()));
    else run(xp, wp, y.data_ptr<float>());
  }
#endif
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t N,
                      bool widen) {
  at::Tensor y;
  small_gemm_into(x, w, bias, N, widen, y);
  return y;
}

// ---- activations as int16 for the integer GEMVs below -----------------------------------------------
// AVX512-VNNI (vpdpwssd) or AVX2 (vpmaddwd then vpaddd): int16 x int16 products summed exactly in int32.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PLAIT_INT_GEMV 1
#define PLAIT_INT_GEMV_512 1
#elif defined(PLAIT_AVX2)
#define PLAIT_INT_GEMV 1
#endif

#if defined(PLAIT_INT_GEMV_512)
// x [M, K] -> int16 per block of B (32 or 64) along K, symmetric (scale max|x| / 32767, rounded to
// nearest even): the codes, each block's scale and, when `xsum` is given, each block's sum of x.
template <int B, typename T>
void quantize_int16_blocks(const T* x, int64_t M, int64_t K, int16_t* xq, float* xs, float* xsum) {
  constexpr int V = B / 16;
  const int64_t blocks = K / B;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* p = x + m * K + b * B;
      __m512 v[V], amax = _mm512_setzero_ps();
      for (int i = 0; i < V; ++i) {
        v[i] = load16(p + 16 * i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
      }
      const float mx = _mm512_reduce_max_ps(amax);
      const float s = mx > 0.f ? mx / 32767.f : 1.f;
      const __m512 inv = _mm512_set1_ps(1.f / s);
      int16_t* q = xq + m * K + b * B;
      __m512 sum = _mm512_setzero_ps();
      for (int i = 0; i < V; ++i) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv))));
        sum = _mm512_add_ps(sum, v[i]);
      }
      xs[m * blocks + b] = s;
      if (xsum != nullptr) xsum[m * blocks + b] = _mm512_reduce_add_ps(sum);
    }
  }
}
#elif defined(PLAIT_INT_GEMV)
template <int B, typename T>
void quantize_int16_blocks(const T* x, int64_t M, int64_t K, int16_t* xq, float* xs, float* xsum) {
  constexpr int V = B / 8;
  const int64_t blocks = K / B;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* p = x + m * K + b * B;
      __m256 v[V], amax = _mm256_setzero_ps();
      for (int i = 0; i < V; ++i) {
        v[i] = load8(p + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
      }
      const float mx = reduce_max8(amax);
      const float s = mx > 0.f ? mx / 32767.f : 1.f;
      const __m256 inv = _mm256_set1_ps(1.f / s);
      int16_t* q = xq + m * K + b * B;
      __m256 sum = _mm256_setzero_ps();
      for (int i = 0; i < V; i += 2) {   // packs interleaves 128-bit halves; the permute puts them back in order
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8));
        sum = _mm256_add_ps(sum, _mm256_add_ps(v[i], v[i + 1]));
      }
      xs[m * blocks + b] = s;
      if (xsum != nullptr) xsum[m * blocks + b] = reduce_add8(sum);
    }
  }
}
#endif

#if defined(PLAIT_INT_GEMV)

// The calling thread's quantized activations: reused, grown as needed (a decode step makes ~120 GEMV
// calls, each would otherwise allocate these three).
struct QuantizedX {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};
QuantizedX& quantized_x(int64_t values, int64_t blocks) {
  thread_local QuantizedX x;
  at_least(x.q, values);
  at_least(x.scale, blocks);
  at_least(x.sum, blocks);
  return x;
}

// quantize_int16_blocks on a float32 or bfloat16 tensor's data.
template <int B>
void quantize_int16_blocks(const at::Tensor& x, int16_t* xq, float* xs, float* xsum) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) quantize_int16_blocks<B>(x.data_ptr<c10::BFloat16>(), M, K, xq, xs, xsum);
  else quantize_int16_blocks<B>(x.data_ptr<float>(), M, K, xq, xs, xsum);
}

// The int8 kernels' input and output: x [M, K] (bfloat16, else as float32) as int16 in blocks of 64
// along K, in the calling thread's buffers; y [M, N] made float32 when undefined, else float32 or
// bfloat16.
QuantizedX& int8_kernel_io(const at::Tensor& x, int64_t N, at::Tensor& y, const char* op) {
  const at::Tensor xc = (x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat)).contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  QuantizedX& q = quantized_x(M * K, M * (K / 64));
  quantize_int16_blocks<64>(xc, q.q.data(), q.scale.data(), nullptr);
  if (!y.defined()) y = at::empty({M, N}, x.options().dtype(at::kFloat));
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16, op, ": out must be float32 or bfloat16");
  check_out(y, {M, N}, y.scalar_type(), op);
  return q;
}
#endif

// ---- int8 weight GEMV on 16-bit activations: int8 layers and LM head at decode batch sizes ---------
// y[m, n] = scale[n] * sum_b sx[m, b] * sum_{k in b} xq[m, k] * w[n, k], x quantized to int16 in
// blocks of 64 along K (symmetric, sx = max|x| / 32767: a relative error ~1e-5, below bfloat16's
// 4e-3), the weights sign-extended to int16 in registers, products summed exactly in int32 by
// AVX512-VNNI (vpdpwssd, 32 multiply-adds an instruction). The weight is read once for all M rows;
// 3 instructions per 32 weights, so reading memory is the limit, as it should be for a GEMV.
// y: contiguous [M, N], float32 or bfloat16 (each product rounded once from float32); made (float32)
// here when undefined.
void int8_gemv_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor& y) {
  check_cpu(x, "x");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) % 64 == 0,
              "int8_gemv: w must be contiguous int8 [N, K], K a multiple of 64");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1, "int8_gemv: x must be [M >= 1, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == w.size(0),
              "int8_gemv: scale must be float32 [N]");
#if defined(PLAIT_INT_GEMV)
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / 64;
  const QuantizedX& xq = int8_kernel_io(x, N, y, "int8_gemv");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int16_t* xp = xq.q.data();
  const float* sxp = xq.scale.data();
  auto run = [&](auto* yp) {
    parallel_shares(N, 256, std::max<int64_t>(16, 32768 / K), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int8_t* wn = wp + n * K;
        // 4 rows ahead: the hardware prefetcher alone left it at ~35 GB/s (1 row: 0.82 -> 0.71 ms)
        for (int64_t l = 0; l < K; l += 64) _mm_prefetch(reinterpret_cast<const char*>(wn + 4 * K + l), _MM_HINT_T0);
        for (int64_t r0 = 0; r0 < M; r0 += 8) {   // rows in blocks of 8; the weight row stays in L1
          const int64_t r1 = std::min(M, r0 + 8);
#if defined(PLAIT_INT_GEMV_512)
          __m512 acc[8];
          for (int64_t m = r0; m < r1; ++m) acc[m - r0] = _mm512_setzero_ps();
          for (int64_t b = 0; b < B; ++b) {
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + b * 64)));
            const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + b * 64 + 32)));
            for (int64_t m = r0; m < r1; ++m) {
              const int16_t* xb = xp + m * K + b * 64;
              __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xb), w0);
              dot = _mm512_dpwssd_epi32(dot, _mm512_loadu_si512(xb + 32), w1);
              acc[m - r0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(sxp[m * B + b]), acc[m - r0]);
            }
          }
          for (int64_t m = r0; m < r1; ++m) yp[m * N + n] = _mm512_reduce_add_ps(acc[m - r0]) * sp[n];
#else
          __m256 acc[8];
          for (int64_t m = r0; m < r1; ++m) acc[m - r0] = _mm256_setzero_ps();
          for (int64_t b = 0; b < B; ++b) {
            __m256i wv[4];
            for (int i = 0; i < 4; ++i)
              wv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + b * 64 + 16 * i)));
            for (int64_t m = r0; m < r1; ++m) {
              const __m256i* xb = reinterpret_cast<const __m256i*>(xp + m * K + b * 64);
              __m256i dot = _mm256_madd_epi16(_mm256_loadu_si256(xb), wv[0]);
              for (int i = 1; i < 4; ++i) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_loadu_si256(xb + i), wv[i]));
              acc[m - r0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sxp[m * B + b]), acc[m - r0]);
            }
          }
          for (int64_t m = r0; m < r1; ++m) yp[m * N + n] = reduce_add8(acc[m - r0]) * sp[n];
#endif
        }
      }
    });
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<c10::BFloat16>());
  else run(y.data_ptr<float>());
#else
  TORCH_CHECK(false, "int8_gemv: this build has no AVX512-VNNI or AVX2");
#endif
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  at::Tensor y;
  int8_gemv_into(x, w, scale, y);
  return y;
}

// ---- int8 weights at any rows (AVX2 without AVX-512): int8 layers and LM head ------------------------
// int8_gemv reads a weight row once for all rows of x but ends each (row, output) in a horizontal sum;
// past 8 rows that leaves it no faster than a bfloat16 copy of the weights (SmolLM2's head, 32 rows:
// ~114 vs ~110 GFLOP/s), and at 1-8 rows this is faster too (the head: 1 row 1.15 vs 1.31 ms, 8 rows
// 2.64 vs 3.76). Here, as int4_gemv does, 16 outputs share a vector, one lane each: the weight
// packed [N/16, K/2, 32] (`int8_rows_pack`: per block of 16 outputs and pair of k, output i's two
// weights at bytes 2i, 2i+1), sign-extended once per block of rows and k pair, vpmaddwd against the
// pair of x broadcast, int32 sums per block of 64 k (x's int16 blocks: at most 64 x 32767 x 127, no
// overflow), then float32. Same numbers as int8_gemv's up to float32 summation order.
#if defined(PLAIT_INT_GEMV) && !defined(PLAIT_INT_GEMV_512)
#define PLAIT_INT8_ROWS 1
template <int M, typename O>
void int8_rows_blocks(const int16_t* xq, const float* xs, const int8_t* w, const float* scale, int64_t K,
                      int64_t b0, int64_t b1, O* y, int64_t N) {
  const int64_t B = K / 64;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = w + b * 16 * K;
    __m256 acc[2][M];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < M; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < B; ++blk) {
      // 2 KB ahead (on into the next outputs' weights, which follow): the head at 1 row, min / median
      // of 12 alternating runs, 1.001 / 1.080 -> 0.920 / 0.992 ms (4 KB 0.955 / 1.021, 8 KB 0.930 / 1.024).
      // Non-temporal: read once a step, the head's 28 MB need not pass through L2 and L3 (bfloat16 + int4
      // batch-1 steps, 512 keys, T0 vs NTA in every weight stream, alternated in one process, three
      // runs: 8.54 / 6.00 / 6.87 vs 8.03 / 5.77 / 6.51 ms medians; the layers' parts unchanged, so the
      // difference is the head's).
      const char* ahead = reinterpret_cast<const char*>(wb + blk * 1024) + 2048;
      for (int l = 0; l < 16; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_NTA);
      __m256i dot[2][M];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < M; ++m) dot[h][m] = _mm256_setzero_si256();
      for (int p = 0; p < 32; ++p) {   // the block's 32 pairs of k
        const int8_t* wp = wb + (blk * 32 + p) * 32;
        const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
        const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
        for (int m = 0; m < M; ++m) {
          const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * K + blk * 64 + 2 * p));
          dot[0][m] = _mm256_add_epi32(dot[0][m], _mm256_madd_epi16(v0, xv));
          dot[1][m] = _mm256_add_epi32(dot[1][m], _mm256_madd_epi16(v1, xv));
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m256 sx = _mm256_set1_ps(xs[m * B + blk]);
        for (int h = 0; h < 2; ++h) acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][m]), sx, acc[h][m]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sc = _mm256_loadu_ps(scale + b * 16 + 8 * h);
      for (int m = 0; m < M; ++m) store8(y + m * N + b * 16 + 8 * h, _mm256_mul_ps(acc[h][m], sc));
    }
  }
}
#endif

// y: contiguous [M, N], float32 or bfloat16; made (float32) here when undefined.
void int8_rows_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor& y) {
  check_cpu(x, "x");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(2) == 32 && (2 * w.size(1)) % 64 == 0,
              "int8_rows: w must be the packed int8 [N/16, K/2, 32] of int8_rows_pack, K a multiple of 64");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * w.size(1) && x.size(0) >= 1, "int8_rows: x must be [M >= 1, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == 16 * w.size(0),
              "int8_rows: scale must be float32 [N]");
#if defined(PLAIT_INT8_ROWS)
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), N = 16 * NB, B = K / 64;
  const QuantizedX& xq = int8_kernel_io(x, N, y, "int8_rows");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int16_t* xp = xq.q.data();
  const float* sxp = xq.scale.data();
  // rows of x a pass; SmolLM2's head, 9 / 32 / 64 rows, GFLOP/s: 4 rows 133-146 / 148-150 / 150-152,
  // 6 rows 175-180 / 170-172 / 169, 8 rows 151-159 / 159-162 / 163-164
  constexpr int R = 6;
  const int64_t chunk = std::max<int64_t>(1, 32768 / (16 * K));   // ~32 KB of weights
  auto run = [&](auto* yp) {
    row_blocks_over_chunks<R>(NB, M, grain(16 * K * M, 65536), chunk, [&](auto rows, int64_t r0, int64_t c0, int64_t c1) {
      int8_rows_blocks<decltype(rows)::value>(xp + r0 * K, sxp + r0 * B, wp, sp, K, c0, c1, yp + r0 * N, N);
    });
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<c10::BFloat16>());
  else run(y.data_ptr<float>());
#else
  TORCH_CHECK(false, "int8_rows: this build has no AVX2 path (or has AVX-512, where int8_gemv and the bf16 copy serve)");
#endif
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  at::Tensor y;
  int8_rows_into(x, w, scale, y);
  return y;
}

bool has_int8_rows() {
#if defined(PLAIT_INT8_ROWS)
  return true;
#else
  return false;
#endif
}

// ---- int4 weight GEMV on 16-bit activations: GGUF Q4_1's layers (any rows; see int4_gemv_all_rows) --
// y[m, n] = sum_g d[n, g] * sum_{k in g} q[n, k] * x[m, k] + mn[n, g] * sum_{k in g} x[m, k], with
// 4-bit codes q in groups of 32 along K and fp16 d, mn (Q4_1's own, so a GGUF model's weights are
// the file's exactly). x is quantized to int16 per group of 32 (relative error ~1e-5, below
// bfloat16's 4e-3); code x activation products are summed exactly in int32 by AVX512-VNNI
// (vpdpwssd). The weight is laid out for this loop (`int4_gemv_pack` in cpu_kernels.py): 16 output
// rows share a vector, one lane each, so a group's 16 dot products end as one vector with no
// horizontal sums, and its scales are applied once per group, not per product. Per block of 16 rows
// and group: 8 chunks of 32 bytes, byte i of chunk s holding row i/2's codes for k = 4s + i%2 (low
// nibble) and 4s + 2 + i%2 (high nibble); then d[16] and mn[16] as fp16: 320 bytes per 512 weights,
// streamed front to back. torch's int4 kernel (float32 FMAs on converted codes) is compute-bound
// here; this is 3 instructions per 64 weights plus one dot product per 32 per row of x.
#if defined(PLAIT_INT_GEMV)
#define PLAIT_INT4_GEMV 1
constexpr int64_t kInt4GroupBytes = 320;
#endif

#if defined(PLAIT_INT_GEMV_512)

template <int M, typename O>
void int4_gemv_blocks(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, const float* bias,
                      int64_t K, int64_t b0, int64_t b1, O* y, int64_t N) {
  constexpr int C = M <= 2 ? 2 : 1;   // chains per row of x: a group is 16 dependent dot products
  const int64_t G = K / 32;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * G * kInt4GroupBytes;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = wb + g * kInt4GroupBytes;
      // ~2.5 KB ahead: a thread's run (a few 10 KB on small matrices) ends before the hardware
      // prefetcher is up to speed (SmolLM2's 120 layer matrices back to back, 1-8 rows: 4-17% faster)
      for (int l = 0; l < 5; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + 8 * kInt4GroupBytes + 64 * l), _MM_HINT_T0);
      __m512i lo_acc[C][M], hi_acc[C][M];
      for (int c = 0; c < C; ++c)
        for (int m = 0; m < M; ++m) lo_acc[c][m] = hi_acc[c][m] = _mm512_setzero_si512();
      for (int s = 0; s < 8; s += C) {
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (s + c) * 32)));
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
          for (int m = 0; m < M; ++m) {
            // x[4s + {0,1}] pairs with the low nibbles, x[4s + {2,3}] with the high ones
            const int32_t* xp = reinterpret_cast<const int32_t*>(xq + m * K + g * 32 + (s + c) * 4);
            lo_acc[c][m] = _mm512_dpwssd_epi32(lo_acc[c][m], lo, _mm512_set1_epi32(xp[0]));
            hi_acc[c][m] = _mm512_dpwssd_epi32(hi_acc[c][m], hi, _mm512_set1_epi32(xp[1]));
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 256)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 288)));
      for (int m = 0; m < M; ++m) {
        __m512i dot = _mm512_add_epi32(lo_acc[0][m], hi_acc[0][m]);
        if (C == 2) dot = _mm512_add_epi32(dot, _mm512_add_epi32(lo_acc[C - 1][m], hi_acc[C - 1][m]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xs[m * G + g])), acc[m]);
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * G + g]), acc[m]);
      }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store16(y + m * N + b * 16, _mm512_add_ps(acc[m], bv));
  }
}
#elif defined(PLAIT_INT4_GEMV)
// AVX2: a block's 16 rows as two halves of 8 (bytes 0-15 of each 32-byte chunk are rows 0-7, and
// d, mn's first 8 values), one vector each; the codes widened to int16, vpmaddwd for the products,
// both nibbles' products summed into one int32 accumulator (exact: the same sums). Each x pair is
// broadcast once for both halves (the halves in separate passes had the compiler keep all 16
// broadcasts of a group live and spill them: 9 GB/s at one row).
template <int M, typename O>
void int4_gemv_blocks(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, const float* bias,
                      int64_t K, int64_t b0, int64_t b1, O* y, int64_t N) {
  const int64_t G = K / 32;
  const __m256i low4 = _mm256_set1_epi16(0x000F);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * G * kInt4GroupBytes;
    __m256 acc[2][M];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < M; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = wb + g * kInt4GroupBytes;
      for (int l = 0; l < 5; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + 8 * kInt4GroupBytes + 64 * l), _MM_HINT_T0);
      __m256i dot[2][M];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < M; ++m) dot[h][m] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + s * 32)));
        const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + s * 32 + 16)));
        const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_srli_epi16(v0, 4);
        const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_srli_epi16(v1, 4);
        for (int m = 0; m < M; ++m) {   // x[4s + {0,1}] with the low nibbles, x[4s + {2,3}] with the high ones
          const int32_t* xp = reinterpret_cast<const int32_t*>(xq + m * K + g * 32 + s * 4);
          const __m256i xl = _mm256_set1_epi32(xp[0]), xh = _mm256_set1_epi32(xp[1]);
          dot[0][m] = _mm256_add_epi32(dot[0][m], _mm256_add_epi32(_mm256_madd_epi16(lo0, xl), _mm256_madd_epi16(hi0, xh)));
          dot[1][m] = _mm256_add_epi32(dot[1][m], _mm256_add_epi32(_mm256_madd_epi16(lo1, xl), _mm256_madd_epi16(hi1, xh)));
          // the sums in this order: else GCC reassociates them (exact either way) into a tree over all
          // 8 chunks' products and spills them (seen in the disassembly; SmolLM2's 120 int4 matrices, 1 row,
          // alternating: min 6.24 vs 7.10 ms, not unrolling at all 6.41)
          asm volatile("" : "+x"(dot[0][m]), "+x"(dot[1][m]));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 256 + 16 * h)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 288 + 16 * h)));
        for (int m = 0; m < M; ++m) {
          acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][m]), _mm256_mul_ps(d, _mm256_set1_ps(xs[m * G + g])), acc[h][m]);
          acc[h][m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * G + g]), acc[h][m]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 bv = bias ? _mm256_loadu_ps(bias + b * 16 + 8 * h) : _mm256_setzero_ps();
      for (int m = 0; m < M; ++m) store8(y + m * N + b * 16 + 8 * h, _mm256_add_ps(acc[h][m], bv));
    }
  }
}
#endif

// y: contiguous [M, N] in x's dtype; made here when undefined.
void int4_gemv_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == 320,
              "int4_gemv: w must be the packed uint8 [N/16, K/32, 320] of int4_gemv_pack");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) * 32 && x.size(0) >= 1, "int4_gemv: x must be [M >= 1, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == w.size(0) * 16),
              "int4_gemv: bias must be float32 [N]");
#if defined(PLAIT_INT4_GEMV)
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, NB = w.size(0), N = NB * 16;
  const at::Tensor xc = x.contiguous();
  QuantizedX& q = quantized_x(M * K, M * G);
  int16_t* xq = q.q.data();
  float *xs = q.scale.data(), *xsum = q.sum.data();
  quantize_int16_blocks<32>(xc, xq, xs, xsum);
  if (!y.defined()) y = at::empty({M, N}, x.options());
  else check_out(y, {M, N}, x.scalar_type(), "int4_gemv");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  // each thread streams a contiguous share of blocks (at least ~64K multiply-adds), in chunks of
  // ~32 KB, rows of x in blocks of 8
  const int64_t chunk = std::max<int64_t>(1, 32768 / (G * kInt4GroupBytes));
  auto run = [&](auto* yp) {
    row_blocks_over_chunks<8>(NB, M, grain(16 * K * M, 65536), chunk, [&](auto rows, int64_t r0, int64_t c0, int64_t c1) {
      int4_gemv_blocks<decltype(rows)::value>(xq + r0 * K, xs + r0 * G, xsum + r0 * G, wp, bp, K, c0, c1, yp + r0 * N, N);
    });
  };
  if (x.scalar_type() == at::kBFloat16) run(y.data_ptr<c10::BFloat16>());
  else run(y.data_ptr<float>());
#else
  TORCH_CHECK(false, "int4_gemv: this build has no AVX512-VNNI or AVX2");
#endif
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  at::Tensor y;
  int4_gemv_into(x, w, bias, y);
  return y;
}

bool has_int_gemv() {
#if defined(PLAIT_INT_GEMV)
  return true;
#else
  return false;
#endif
}

// Whether int4_gemv should take every row count, not only decode's few: where the CPU has no bfloat16
// dot products (AVX512-BF16, AMX) for a bfloat16 copy of the weights to run faster.
// SmolLM2's 120 int4 matrices, AVX2, 32 rows: int4_gemv 205 GFLOP/s, the copy's small_gemm 116.
bool int4_gemv_all_rows() {
#if defined(PLAIT_INT_GEMV) && !defined(__AVX512BF16__) && !defined(__AMX_BF16__)
  return true;
#else
  return false;
#endif
}

// ---- the decode mirror's steady step ---------------------------------------------------------------
// DecodeMirror.plan's common case in one op (its ~30 small tensor ops cost ~0.25 ms a step): every
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
// torch's argmax reads float32 logits at ~5 GB/s here (1.1 ms for 32 rows of a 49152-token
// vocabulary); this keeps 16 running maxima and their indices. Same result: the first index of the
// maximum, and of the first NaN in a row that has one (NaN counts as the maximum).
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

// ---- a whole decode step's decoder layers in one call ---------------------------------------------
// At batch 1 a layer's ten kernels take ~100-200 us together, and reaching each from Python (module
// calls, argument checks, the dispatcher) added ~2 ms a step over SmolLM2's 30 layers. Here the same
// kernels run in the same order from one op, so the results are those of the layer-by-layer path bit
// for bit. Per layer, `weights` holds 10 tensors: input norm, qkv (a, b), o (a, b), post-attention
// norm, gate_up (a, b), down (a, b); `kinds` 8 ints: (kind, out_features) per projection. A
// projection's kind: 0 small_gemm (a = panels, b = float32 bias or empty), 1 int4_gemv (a = packed
// codes, b = float32 bias or empty), 2 int8_gemv (a = int8 weight, b = float32 scales) or 3 int8_rows
// (a = its packed int8 weight, b = float32 scales). Attention: this step's K/V to pool slots `slots`
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
  }
  TORCH_CHECK(false, "decode_layers_: unknown projection kind ", kind[0]);
}

// Where this step's K/V rows go in layer l's pool and mirror, fetched for writing ahead of
// kv_write_ (a layer's qkv projection earlier): otherwise each of those lines is a miss when written
// (32 rows: ~20 us a layer).
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
// --breakdown`): a clock read between the parts (~25 ns each, ~9 a layer), none while off. One
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

// decode_layers_'s arguments that stay the same from step to step (the weights, the pools, the
// mirror's blocks until it is reallocated), held by Python across steps: passed as ~420 tensors a
// call, they were converted from Python objects every step (an aten op taking such a list: ~0.17-0.20
// ms a call here).
struct DecodePlan : torch::CustomClassHolder {
  std::vector<at::Tensor> weights, pool_k, pool_v, mirror_k, mirror_v;
  std::vector<int64_t> kinds;
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
  // The step's ends, for decode_step (set_ends; head_kind empty until then): the token embedding
  // [vocab, hidden], RoPE's float32 tables [positions, head_dim], the final norm and the LM head as
  // a projection (kind, out_features; a, b).
  at::Tensor embed, rope_cos, rope_sin, final_norm, head_a, head_b;
  std::vector<int64_t> head_kind;
  double final_eps = 0;
  void set_ends(at::Tensor embed_, at::Tensor cos, at::Tensor sin, at::Tensor norm, double norm_eps, int64_t kind,
                int64_t out_features, at::Tensor a, at::Tensor b) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.is_contiguous() && cos.dim() == 2 && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.size(1) == head_dim,
                "DecodePlan.set_ends: a contiguous [vocab, hidden] embedding and float32 [positions, head_dim] RoPE tables");
    TORCH_CHECK(kind == 0 || kind == 2 || kind == 3, "DecodePlan.set_ends: the head runs small_gemm, int8_gemv or int8_rows");
    embed = std::move(embed_);
    rope_cos = std::move(cos);
    rope_sin = std::move(sin);
    final_norm = std::move(norm);
    final_eps = norm_eps;
    head_kind = {kind, out_features};
    head_a = std::move(a);
    head_b = std::move(b);
  }
  DecodePlan(std::vector<at::Tensor> weights, std::vector<int64_t> kinds, std::vector<at::Tensor> pool_k,
             std::vector<at::Tensor> pool_v, std::vector<at::Tensor> mirror_k, std::vector<at::Tensor> mirror_v,
             int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : weights(std::move(weights)), pool_k(std::move(pool_k)), pool_v(std::move(pool_v)),
        mirror_k(std::move(mirror_k)), mirror_v(std::move(mirror_v)), kinds(std::move(kinds)), heads(heads),
        kv_heads(kv_heads), head_dim(head_dim), eps(eps), scale(scale) {
    const size_t layers = this->pool_k.size();
    TORCH_CHECK(this->weights.size() == 10 * layers && this->kinds.size() == 8 * layers &&
                    this->pool_v.size() == layers && this->mirror_k.size() == layers && this->mirror_v.size() == layers,
                "DecodePlan: per layer 10 weights, 8 kinds, a pool and a mirror for K and V");
  }
};

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
  // the next layer writes it): ~8 allocations a layer less (~0.3-0.5 us each).
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
// these ends' ops runs with cold caches after the weights' stream (the final norm 77-198 us against
// 11 us warm); here a bfloat16 batch-1 step is ~0.3 ms shorter (steps alternating, load ~1.4).
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


}  // namespace

TORCH_LIBRARY(plait_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lens, float scale, Tensor? rows=None) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_rows(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("has_int8_rows() -> bool");
  m.def("small_gemm(Tensor x, Tensor w, Tensor? bias, int n, bool widen=False) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("mirror_steady_(Tensor(a!) ids, Tensor(b!) stamps, Tensor(c!) lens, Tensor slot_stamp, Tensor kv, Tensor pre, "
        "Tensor targets, int clock, int kv_heads) -> Tensor");
  m.def("has_int_gemv() -> bool");
  m.def("int4_gemv_all_rows() -> bool");
  m.def("shares_coverage(int n, int min_share, int chunk, int slow_us) -> Tensor");
  m.def("has_small_gemm(bool bf16) -> bool");
  m.def("bf16_panels_k_pairs() -> bool");
  m.def("decode_profile_(bool on) -> ()");
  m.def("decode_profile() -> Tensor");
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double>())
      .def("set_ends", &DecodePlan::set_ends);
  // writes x, the pools' and the mirror's (the plan's) slots
  m.def("decode_layers_(Tensor(a!) x, __torch__.torch.classes.plait_cpu.DecodePlan plan, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor mirror_at, Tensor lens, Tensor? mirror_rows) -> Tensor");
  m.def("decode_step(Tensor ids, Tensor positions, __torch__.torch.classes.plait_cpu.DecodePlan plan, Tensor slots, "
        "Tensor mirror_at, Tensor lens, Tensor? mirror_rows) -> Tensor");
  m.def("kv_write_(Tensor(a!) pool_k, Tensor(b!) pool_v, Tensor slots, Tensor k, Tensor v, Tensor(c!)? mirror_k, "
        "Tensor(d!)? mirror_v, Tensor? mirror_at) -> ()");
}

TORCH_LIBRARY_IMPL(plait_cpu, CompositeExplicitAutograd, m) {
  m.impl("has_int_gemv", &has_int_gemv);
  m.impl("decode_profile_", &decode_profile_);
  m.impl("decode_profile", &decode_profile);
  m.impl("has_int8_rows", &has_int8_rows);
  m.impl("int4_gemv_all_rows", &int4_gemv_all_rows);
  m.impl("shares_coverage", &shares_coverage);
  m.impl("has_small_gemm", &has_small_gemm);
  m.impl("bf16_panels_k_pairs", &bf16_panels_k_pairs);
}

TORCH_LIBRARY_IMPL(plait_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("decode_attention", &decode_attention);
  m.impl("silu_mul", &silu_mul);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_rows", &int8_rows);
  m.impl("small_gemm", &small_gemm);
  m.impl("int4_gemv", &int4_gemv);
  m.impl("kv_write_", &kv_write_);
  m.impl("decode_layers_", &decode_layers_);
  m.impl("decode_step", &decode_step);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("mirror_steady_", &mirror_steady_);
}
