// plait's fused CPU kernels (runtime/cpu_kernels.py): what every kernel file shares. The scalar
// helpers (element types, checks, the thread split) and the vector helpers of each ISA path:
// AVX-512 (16 float32 lanes: load16 / store16 / exp16) and AVX2 + FMA + F16C (8 lanes: load8 / store8 /
// exp8); a build for neither (-march=x86-64, other architectures) compiles only the scalar code.
//
// bfloat16 follows Hugging Face transformers' rounding step by step (each intermediate the eager
// model rounds to bfloat16 is rounded here too); sums run in another order than PyTorch's, which
// moves float32 results by rounding noise. Built with -ffp-contract=off so that a*b + c is never
// fused into one rounding.
#pragma once
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
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// CPUs with AVX2 but no AVX-512 (AMD before Zen 4, Intel client cores) take 8-wide versions of the
// hot kernels; each AVX-512 block keeps its own path, the AVX2 one is the #elif.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PLAIT_AVX2 1
#endif

// Every symbol lives in a namespace named for the build (cpu_kernels.py passes -DPLAIT_NS=...): one
// process may load several ISA builds side by side (the tests run each path the host can execute),
// and their functions must not resolve to one another's.
#ifndef PLAIT_NS
#define PLAIT_NS plait_cpu
#endif

namespace PLAIT_NS {

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

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// An output the caller made (the `_into` kernels write into it): contiguous, the shape and dtype
// the kernel would have made.
inline void check_out(const at::Tensor& y, at::IntArrayRef sizes, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(y.is_contiguous() && y.sizes() == sizes && y.scalar_type() == dtype, op, ": out must be contiguous ",
              sizes, " ", dtype, ", got ", y.sizes(), " ", y.scalar_type());
}

// Rows per parallel task so that a task is at least ~`work` multiply-adds.
inline int64_t grain(int64_t per_row, int64_t work = 32768) {
  return std::max<int64_t>(1, work / std::max<int64_t>(1, per_row));
}

// f(begin, end) over [0, n) on up to n / min_share threads. Thread t owns the t-th equal share and
// takes it front to back in chunks (one stream, as a static split); a thread done with its own
// takes chunks from the back of the share with the most left. On this host a vCPU's speed drifts
// with what shares its core, and with a static split every op waits for the slower thread.
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

}  // namespace PLAIT_NS
