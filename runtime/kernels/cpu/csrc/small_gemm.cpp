// small_gemm: the float32 / bfloat16 projections at decode's batch sizes, y = x w^T (+ bias) for any
// number of rows of x against weights packed in panels of 32 output columns (pack_panels).
// AVX-512 with BW and VL (PLAIT_AVX512BW_VL): row blocks of up to 12 rows over a whole panel; bfloat16
// by AVX512-BF16 dot products on panels of k pairs, so without AVX512-BF16 float32 only. AVX2 + FMA +
// F16C (PLAIT_AVX2): up to 6 rows over half panels, bfloat16 panels one k a row, widened by shifts.
// Other builds (-march=x86-64, AVX-512 without BW/VL) have no small_gemm: has_small_gemm() is false,
// the op raises, and prepack.py keeps the weights for oneDNN or F.linear instead.
#include "ops.h"

namespace PLAIT_NS {

// ---- float32 / bfloat16 small-M GEMM: the projections at decode batch sizes ----------------------
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x, summed in float32. The weight
// is held in panels of 32 output columns, k-major (`pack_panels` in cpu_kernels.py): float32
// [N/32, K, 32], bfloat16 [N/32, K/2, 32, 2] (pairs of k, as AVX512-BF16's dot product takes them;
// AVX2: [N/32, K, 32], see bf16_panels_k_pairs).
// A row block of up to 12 rows of x runs over a panel with 24 accumulators: per k (pair) two
// loads of the weight, one broadcast and two FMAs (dot products) per row, no horizontal sums. At
// one row that streams the weight at the machine's bandwidth (oneDNN runs a single row on one core);
// at 32 float32 rows it keeps up with oneDNN's GEMM in cache and is ahead of it streaming the weights.
// Each thread streams its own run of panels; a panel's second and third row blocks read it from L2,
// so while it computes, each block prefetches its share of the next panel (without that the first
// pass waited on memory). Any number of rows works; prepack.py's SMALL_GEMM_MAX_ROWS is where it
// stops beating oneDNN on SmolLM2's matrices.
#if defined(PLAIT_AVX512BW_VL) || defined(PLAIT_AVX2)
#define PLAIT_SMALL_GEMM 1
constexpr int64_t kPanel = 32;          // output columns per panel
constexpr int64_t kStreamRowsMin = 8;   // fewer rows' logits (< 1.5 MB on SmolLM2) stay in cache for the sampler
// A bfloat16 result stored widened to float32 (the LM head's logits: no second pass to widen them).
struct WidenedBF16 { float value; };
// Logits of many rows (float32, bfloat16 widened), stored past the caches: the sampler reads them
// once, later. Cached stores first read every line they write (12.6 MB a batch-64 step of SmolLM2)
// and fill L3 with them.
template <typename T> struct Streamed { float value; };

// `lines` cache lines from `next` on, spread evenly over a loop of `steps` iterations (`step()` once
// each): a running sum instead of two 64-bit divisions an iteration, which had cost time at every
// row count, most on the LM head.
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
// accumulators, 3 rows a block, so that one row's sums are more chains: no faster out of cache at a
// few rows, slower at many.)
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
// broadcast every x twice, and ran slower than this way.)
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
// the panel's end: the next panel, which follows it in memory), into L1. Such a pass reads its panel
// too soon for the next panel, spread over it into L2, to arrive in time.
constexpr int64_t kStreamAhead = 16;

// MR rows of x (float32) against V x 8 columns of a panel (w: their first weight; k rows 32 weights
// apart), `cols` (1..8V) of them real; bias (may be null) at their first column. (The m and v loops
// unrolled by pragma: left to GCC's heuristics, the accumulator arrays stayed in memory, stored
// every k.)
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
// the float32 kernel on it was slower than converting in registers.)
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

}  // namespace PLAIT_NS
