// The ops each kernel file defines and the others (the fused decode step, the bindings) call.
#pragma once
#include "simd.h"

namespace PLAIT_NS {

// ---- norms, RoPE, the MLP's activation, K/V writes (norm_rope_kv.cpp) ----
void rms_norm_into(at::Tensor x, const c10::optional<at::Tensor>& delta, const at::Tensor& w, double eps, at::Tensor& y);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& delta, const at::Tensor& w, double eps);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
void silu_mul_into(const at::Tensor& gu, at::Tensor& y);
at::Tensor silu_mul(const at::Tensor& gu);
void kv_write_(at::Tensor pool_k, at::Tensor pool_v, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v,
               const c10::optional<at::Tensor>& mirror_k, const c10::optional<at::Tensor>& mirror_v,
               const c10::optional<at::Tensor>& mirror_at);

// ---- decode attention (decode_attention.cpp) ----
void decode_attention_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                           double scale, const c10::optional<at::Tensor>& rows, at::Tensor& out);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            double scale, const c10::optional<at::Tensor>& rows);

// ---- float32 / bfloat16 small-M GEMM (small_gemm.cpp) ----
bool bf16_panels_k_pairs();
bool has_small_gemm(bool bf16);
void small_gemm_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t N,
                     bool widen, at::Tensor& y);
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t N,
                      bool widen);

// ---- int8 / int4 weights on int16 activations (int_gemv.cpp) ----
void int8_gemv_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor& y);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
void int8_rows_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor& y);
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
bool has_int8_rows();
void int4_gemv_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y);
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
void int8g_gemv_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool widen,
                     at::Tensor& y);
at::Tensor int8g_gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, bool widen);
bool has_int_gemv();
bool int4_gemv_all_rows();

// ---- the fused decode step, the mirror's steady step, greedy argmax (decode_step.cpp) ----
at::Tensor mirror_steady_(at::Tensor ids, at::Tensor stamps, at::Tensor lens, const at::Tensor& slot_stamp,
                          const at::Tensor& kv, const at::Tensor& pre, const at::Tensor& targets, int64_t clock,
                          int64_t kv_heads);
at::Tensor argmax_rows(const at::Tensor& x);
void bitmask_fill_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows);
void decode_profile_(bool on);
at::Tensor decode_profile();

// decode_layers_'s arguments that stay the same from step to step (the weights, the pools, the
// mirror's blocks until it is reallocated), held by Python across steps: passed as ~420 tensors a
// call, they were converted from Python objects every step (an aten op taking such a list pays
// for it on every call).
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
    TORCH_CHECK(kind == 0 || kind == 2 || kind == 3 || kind == 4,
                "DecodePlan.set_ends: the head runs small_gemm, int8_gemv, int8_rows or int8g_gemv");
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
                          const at::Tensor& lens, const c10::optional<at::Tensor>& mirror_rows);
at::Tensor decode_step(const at::Tensor& ids, const at::Tensor& positions, const c10::intrusive_ptr<DecodePlan>& plan,
                       const at::Tensor& slots, const at::Tensor& mirror_at, const at::Tensor& lens,
                       const c10::optional<at::Tensor>& mirror_rows);

}  // namespace PLAIT_NS
