// The ops' registration with torch (TORCH_LIBRARY) under the build's namespace (PLAIT_NS): one schema
// per op and the DecodePlan class; the kernels under the CPU key, the build's capability queries
// (has_small_gemm, has_int_gemv, ...), the profile switches and shares_coverage (a test hook for
// parallel_shares) under CompositeExplicitAutograd. No ISA-specific code here: every build registers
// every op. Those whose kernel a build lacks (small_gemm, the integer GEMVs; e.g. -march=x86-64) raise
// when called; the has_* queries tell Python first, which then keeps its own path (eager ops, oneDNN).
#include "ops.h"

// TORCH_LIBRARY pastes its namespace argument: these expand PLAIT_NS first.
#define PLAIT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PLAIT_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define PLAIT_STRINGIFY(x) #x
#define PLAIT_STR(x) PLAIT_STRINGIFY(x)
#define PLAIT_PLAN_TYPE "__torch__.torch.classes." PLAIT_STR(PLAIT_NS) ".DecodePlan"

namespace PLAIT_NS {

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

}  // namespace PLAIT_NS

using namespace PLAIT_NS;

PLAIT_LIBRARY(PLAIT_NS, m) {
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
  m.def("int8g_gemv(Tensor x, Tensor w, Tensor? bias, bool widen=False) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("bitmask_fill_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
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
  m.def("decode_layers_(Tensor(a!) x, " PLAIT_PLAN_TYPE " plan, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor mirror_at, Tensor lens, Tensor? mirror_rows) -> Tensor");
  m.def("decode_step(Tensor ids, Tensor positions, " PLAIT_PLAN_TYPE " plan, Tensor slots, "
        "Tensor mirror_at, Tensor lens, Tensor? mirror_rows) -> Tensor");
  m.def("kv_write_(Tensor(a!) pool_k, Tensor(b!) pool_v, Tensor slots, Tensor k, Tensor v, Tensor(c!)? mirror_k, "
        "Tensor(d!)? mirror_v, Tensor? mirror_at) -> ()");
}

PLAIT_LIBRARY_IMPL(PLAIT_NS, CompositeExplicitAutograd, m) {
  m.impl("has_int_gemv", &has_int_gemv);
  m.impl("decode_profile_", &decode_profile_);
  m.impl("decode_profile", &decode_profile);
  m.impl("has_int8_rows", &has_int8_rows);
  m.impl("int4_gemv_all_rows", &int4_gemv_all_rows);
  m.impl("shares_coverage", &shares_coverage);
  m.impl("has_small_gemm", &has_small_gemm);
  m.impl("bf16_panels_k_pairs", &bf16_panels_k_pairs);
}

PLAIT_LIBRARY_IMPL(PLAIT_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_", &rope_);
  m.impl("decode_attention", &decode_attention);
  m.impl("silu_mul", &silu_mul);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_rows", &int8_rows);
  m.impl("small_gemm", &small_gemm);
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8g_gemv", &int8g_gemv);
  m.impl("kv_write_", &kv_write_);
  m.impl("decode_layers_", &decode_layers_);
  m.impl("decode_step", &decode_step);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("bitmask_fill_", &bitmask_fill_);
  m.impl("mirror_steady_", &mirror_steady_);
}
