// RMSNorm (optionally after the residual add), rotate-half RoPE, the gated MLP's silu(gate) * up and
// this step's K/V writes into the pool and the decode mirror: one op each in place of several aten ops.
// RMSNorm has an AVX-512 path (rows a multiple of 16 wide) and an AVX2 + FMA + F16C one (PLAIT_AVX2,
// a multiple of 8); silu_mul the same two, 16 or 8 lanes at a time, then a scalar tail. RoPE and the
// K/V writes (copies, or conversions to a bfloat16 / fp8 pool) are scalar code in every build. Other
// widths and a -march=x86-64 build run the scalar loops: every op here exists in every build.
#include "ops.h"

namespace PLAIT_NS {

// ---- RMSNorm, optionally after a residual add --------------------------------------------------
template <typename T>
void rms_norm_kernel(T* x, const T* delta, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  // tasks of >= 4K elements: a decode batch's rows split over the threads
  at::parallel_for(0, rows, grain(dim, 1 << 12), [&](int64_t begin, int64_t end) {
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

// ---- the gated MLP's activation: silu(gate) * up ----------------------------------------------------
// gu [T, 2I] (gate then up, as the merged gate_up projection returns them) -> [T, I], one op instead
// of split + silu + mul; bfloat16 rounds silu's result before the product, as the eager model does.
template <typename T>
void silu_mul_kernel(const T* gu, T* y, int64_t rows, int64_t I) {
  // tasks of >= 4K elements, as rms_norm_kernel's
  at::parallel_for(0, rows, grain(I, 1 << 12), [&](int64_t begin, int64_t end) {
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
        std::copy(ks, ks + D, pk);                  // conversion per element
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

}  // namespace PLAIT_NS
