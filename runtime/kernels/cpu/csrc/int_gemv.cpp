// Integer-weight projections on int16 activations (x quantized per block along K, products summed
// exactly in int32): int8_gemv (int8 [N, K], decode's few rows), int8_rows (int8 packed 16 outputs a
// vector, any rows), int4_gemv (GGUF Q4_1's codes and scales, any rows) and int8g_gemv (int8 codes with
// a scale and minimum per group of 16 or 32: GGUF's 5- to 8-bit types).
// AVX-512 with VNNI and BW (PLAIT_INT_GEMV_512): int8_gemv and int4_gemv by vpdpwssd; no int8_rows
// (there int8_gemv and the bfloat16 copy serve). AVX2 + FMA + F16C (PLAIT_AVX2): all three, by
// vpmaddwd + vpaddd. Other builds (-march=x86-64, AVX-512 without VNNI) have none: has_int_gemv() and
// has_int8_rows() are false, the ops raise, and quantization.py keeps torch's int8 / int4 kernels.
#include "ops.h"

namespace PLAIT_NS {

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
        // 4 rows ahead: the hardware prefetcher alone left the stream short of the bandwidth
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
// past 8 rows that leaves it no faster than a bfloat16 copy of the weights, and at 1-8 rows this is
// faster too. Here, as int4_gemv does, 16 outputs share a vector, one lane each: the weight
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
      // 2 KB ahead (on into the next outputs' weights, which follow): the head at 1 row ran faster
      // than with no fetch, or with 4 or 8 KB. Non-temporal: read once a step, the head's 28 MB need
      // not pass through L2 and L3 (int4 models' batch-1 steps ran shorter so; the layers' parts
      // unchanged, so the difference is the head's).
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
  // rows of x a pass: on SmolLM2's head 6 ran faster than 4 or 8 at 9, 32 and 64 rows
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
      // prefetcher is up to speed
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
// broadcasts of a group live and spill them).
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
          // 8 chunks' products and spills them (seen in the disassembly; slower than this order, and
          // than not unrolling at all)
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

// ---- int8 codes with a scale and minimum per group: GGUF's 5- to 8-bit types as the file has them ----
// y[m, n] = sum_g d[n, g] * sum_{k in g} q[n, k] * x[m, k] + mn[n, g] * sum_{k in g} x[m, k], with
// int8 codes q in groups of G = 16 or 32 along K and float32 d, mn: Q8_0 (q, d), Q5_0 (q - 16, d),
// Q5_1 (q, d, m), Q5_K (q, d * sc, -dmin * m per 32) and Q6_K (q - 32, d * sc per 16) all fit, and
// float32 holds each product of the file's fp16 and 6- or 8-bit scales exactly, so the layer's weights
// are the file's. As int4_gemv: x as int16 per group (xsum for the minimums), 16 output rows a vector,
// exact int32 sums (at most 32 x 32767 x 128 a group). Per block of 16 rows and group (`int8g_gemv_pack`):
// G/2 chunks of 32 bytes, byte 2i + j of chunk p row i's code for k = 2p + j (a chunk sign-extended is
// vpdpwssd's pairs, 16 rows to a vector), then d[16] and mn[16] as float32: 16 G + 128 bytes.
#if defined(PLAIT_INT_GEMV)
#define PLAIT_INT8G_GEMV 1
template <int G>
constexpr int64_t int8g_group_bytes() { return 16 * G + 128; }
#endif

#if defined(PLAIT_INT_GEMV_512)
template <int G, int M, typename O>
void int8g_gemv_blocks(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, const float* bias,
                       int64_t K, int64_t b0, int64_t b1, O* y, int64_t N) {
  constexpr int64_t GB = int8g_group_bytes<G>();
  constexpr int C = M <= 2 ? 2 : 1;   // chains per row of x: a group is G/2 dependent dot products
  const int64_t NG = K / G;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * NG * GB;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < NG; ++g) {
      const uint8_t* wg = wb + g * GB;
      for (int l = 0; l < GB / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + 4 * GB + 64 * l), _MM_HINT_T0);
      __m512i dot[C][M];
      for (int c = 0; c < C; ++c)
        for (int m = 0; m < M; ++m) dot[c][m] = _mm512_setzero_si512();
      for (int p = 0; p < G / 2; p += C) {
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (p + c) * 32)));
          for (int m = 0; m < M; ++m) {
            const int32_t pair = *reinterpret_cast<const int32_t*>(xq + m * K + g * G + 2 * (p + c));
            dot[c][m] = _mm512_dpwssd_epi32(dot[c][m], v, _mm512_set1_epi32(pair));
          }
        }
      }
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(wg + 16 * G));
      const __m512 mn = _mm512_loadu_ps(reinterpret_cast<const float*>(wg + 16 * G + 64));
      for (int m = 0; m < M; ++m) {
        const __m512i sum = C == 2 ? _mm512_add_epi32(dot[0][m], dot[C - 1][m]) : dot[0][m];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(xs[m * NG + g])), acc[m]);
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * NG + g]), acc[m]);
      }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + b * 16) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store16(y + m * N + b * 16, _mm512_add_ps(acc[m], bv));
  }
}
#elif defined(PLAIT_INT8G_GEMV)
// AVX2: a chunk's first 16 bytes are rows 0-7, its last 16 rows 8-15, one vector each; vpmaddwd.
template <int G, int M, typename O>
void int8g_gemv_blocks(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, const float* bias,
                       int64_t K, int64_t b0, int64_t b1, O* y, int64_t N) {
  constexpr int64_t GB = int8g_group_bytes<G>();
  const int64_t NG = K / G;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * NG * GB;
    __m256 acc[2][M];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < M; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; ++g) {
      const uint8_t* wg = wb + g * GB;
      for (int l = 0; l < GB / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(wg + 4 * GB + 64 * l), _MM_HINT_T0);
      __m256i dot[2][M];
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < M; ++m) dot[h][m] = _mm256_setzero_si256();
      for (int p = 0; p < G / 2; ++p) {
        const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + p * 32)));
        const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + p * 32 + 16)));
        for (int m = 0; m < M; ++m) {
          const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * K + g * G + 2 * p));
          dot[0][m] = _mm256_add_epi32(dot[0][m], _mm256_madd_epi16(v0, xv));
          dot[1][m] = _mm256_add_epi32(dot[1][m], _mm256_madd_epi16(v1, xv));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(wg + 16 * G + 32 * h));
        const __m256 mn = _mm256_loadu_ps(reinterpret_cast<const float*>(wg + 16 * G + 64 + 32 * h));
        for (int m = 0; m < M; ++m) {
          acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][m]), _mm256_mul_ps(d, _mm256_set1_ps(xs[m * NG + g])), acc[h][m]);
          acc[h][m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * NG + g]), acc[h][m]);
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

#if defined(PLAIT_INT8G_GEMV)
template <int G>
void int8g_gemv_run(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  constexpr int64_t GB = int8g_group_bytes<G>();
  const int64_t M = x.size(0), K = x.size(1), NG = K / G, NB = w.size(0), N = NB * 16;
  const at::Tensor xc = x.contiguous();
  QuantizedX& q = quantized_x(M * K, M * NG);
  int16_t* xq = q.q.data();
  float *xs = q.scale.data(), *xsum = q.sum.data();
  quantize_int16_blocks<G>(xc, xq, xs, xsum);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t chunk = std::max<int64_t>(1, 32768 / (NG * GB));   // ~32 KB of weights
  auto run = [&](auto* yp) {
    row_blocks_over_chunks<8>(NB, M, grain(16 * K * M, 65536), chunk, [&](auto rows, int64_t r0, int64_t c0, int64_t c1) {
      int8g_gemv_blocks<G, decltype(rows)::value>(xq + r0 * K, xs + r0 * NG, xsum + r0 * NG, wp, bias, K, c0, c1,
                                                  yp + r0 * N, N);
    });
  };
  if (y.scalar_type() == at::kBFloat16) run(y.data_ptr<c10::BFloat16>());
  else run(y.data_ptr<float>());
}
#endif

// y: contiguous [M, N], float32 or x's dtype; made here when undefined (float32 with `widen`, else
// in x's dtype).
void int8g_gemv_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool widen,
                     at::Tensor& y) {
  check_cpu(x, "x");
  check_cpu(w, "w");
  const int64_t G = w.dim() == 3 ? (w.size(2) - 128) / 16 : 0;
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && (G == 16 || G == 32) &&
                  w.size(2) == 16 * G + 128,
              "int8g_gemv: w must be the packed uint8 [N/16, K/G, 16 G + 128] of int8g_gemv_pack, G 16 or 32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1) * G && x.size(0) >= 1, "int8g_gemv: x must be [M >= 1, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8g_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == w.size(0) * 16),
              "int8g_gemv: bias must be float32 [N]");
#if defined(PLAIT_INT8G_GEMV)
  const int64_t M = x.size(0), N = w.size(0) * 16;
  if (!y.defined()) y = at::empty({M, N}, x.options().dtype(widen ? at::kFloat : x.scalar_type()));
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == x.scalar_type(), "int8g_gemv: out must be float32 or x's dtype");
  check_out(y, {M, N}, y.scalar_type(), "int8g_gemv");
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (G == 16) int8g_gemv_run<16>(x, w, bp, y);
  else int8g_gemv_run<32>(x, w, bp, y);
#else
  TORCH_CHECK(false, "int8g_gemv: this build has no AVX512-VNNI or AVX2");
#endif
}

at::Tensor int8g_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool widen) {
  at::Tensor y;
  int8g_gemv_into(x, w, bias, widen, y);
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
// dot products (AVX512-BF16, AMX) for a bfloat16 copy of the weights to run faster (on AVX2
// int4_gemv outran the copy's small_gemm at 32 rows too).
bool int4_gemv_all_rows() {
#if defined(PLAIT_INT_GEMV) && !defined(__AVX512BF16__) && !defined(__AMX_BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace PLAIT_NS
