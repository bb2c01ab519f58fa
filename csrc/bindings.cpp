// Torch glue for the TwELL CUDA kernels: argument checks, allocation, the current stream.
// The torch.library ops (src/twell/kernels/ops.py) call these functions; Python validates the
// arguments with readable messages first, these checks guard the kernels' own assumptions.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "twell_kernels.h"

namespace {

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "twell.", what, " failed: ", cudaGetErrorString(err),
              (*twell::last_error() ? std::string(" (") + twell::last_error() + ")" : std::string()));
}

// The kernels load rows with 16-byte vectors and TMA, which fault on a misaligned base address
// (a contiguous view at an odd element offset): refuse it here rather than crash the context.
void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "twell: ", name,
              " must start at a 16-byte aligned address (a view at an element offset is not; pass a copy)");
}

void check_bf16_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.is_contiguous(),
              "twell: ", name, " must be a contiguous bf16 CUDA matrix");
  check_aligned(t, name);
}

// Every tensor of a launch on x's GPU: a pointer into another GPU's memory faults (or, with peer
// access, reads remotely) instead of failing here.
void check_on_device_of(const at::Tensor& x, const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.device() == x.device(), "twell.", op, ": ", name, " is on ", t.device(), ", x on ", x.device());
}

// TwELL words of M rows over H neurons: uint32 [M, ceil(H/tile) * S], contiguous, on the device.
void check_twell_words(const at::Tensor& tw, int64_t M, int64_t H, int64_t tile, int64_t S, const char* op) {
  TORCH_CHECK(tw.is_cuda() && tw.scalar_type() == at::kUInt32 && tw.is_contiguous() && tw.dim() == 2 &&
                  tw.size(0) == M && tw.size(1) == ((H + tile - 1) / tile) * S,
              "twell.", op, ": TwELL words must be uint32 [M, ceil(H/tile)*S]");
  check_aligned(tw, "the TwELL words");
}

// The gate kernel's spill area (uint32 words, contiguous, on the device, aligned).
void check_spill(const at::Tensor& spill, const char* op) {
  TORCH_CHECK(spill.is_cuda() && spill.scalar_type() == at::kUInt32 && spill.is_contiguous(), "twell.", op,
              ": bad spill area");
  check_aligned(spill, "the spill area");
}

// A number >= 0 from the environment variable `name`, else `fallback`.
float env_nonnegative(const char* name, float fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const float v = std::strtof(env, &end);
  TORCH_CHECK(end != env && *end == '\0' && v >= 0.f && std::isfinite(v), name, " must be a finite number >= 0, got '",
              env, "'");
  return v;
}

// Block-union path (csrc/twell_union.cu): a block of 64 rows takes it when its union U of active
// neurons satisfies |U| <= ratio x (entries - base); ratio 0 turns it off. TWELL_UNION_RATIO and
// TWELL_UNION_BASE override the defaults (read on every call, so a benchmark can compare settings in
// one process). Off by default: the plan costs 0.06-0.1 ms per call where no block qualifies, as on
// every generator input; the fitted rule and why it is off by default: docs/kernels.md §7.
constexpr float kUnionRatioDefault = 0.0f;
constexpr float kUnionBaseDefault = 0.0f;
float union_ratio() { return env_nonnegative("TWELL_UNION_RATIO", kUnionRatioDefault); }
float union_base() { return env_nonnegative("TWELL_UNION_BASE", kUnionBaseDefault); }

// Rows of one round of the dense path (csrc/twell_dense.cu): M / 8 rounded up to 128 (the paper sizes
// its training dense backup the same way), at least kDenseRoundFloor, at most M rounded up to 128, and
// 0 (off) below kDenseMinRows, where the path could never run. Workspace: cap x (D + H rounded up to
// 256) bf16: 126 MB at M = 65536 for the paper's shapes, where the heavy-tail case queues ~4100 rows,
// and 63 MB from M = 4096 to 32768 (the dense FFN's own hidden state there is 92-738 MB). The floor keeps rounds efficient on near-dense inputs: a round of
// 512 rows leaves most SMs idle in its down GEMM (32 tiles of 128 x 256). More heavy rows than cap
// take several rounds. $TWELL_DENSE_CAP overrides the rule (rows, rounded up to 128; 0, or anything
// under kDenseMinRows, turns the path off).
constexpr int64_t kDenseRoundFloor = 4096;
int64_t dense_cap(int64_t M) {
  auto up = [](int64_t v) { return (v + 127) / 128 * 128; };
  int64_t cap = M < twell::kDenseMinRows ? 0 : std::max(up(M / 8), kDenseRoundFloor);
  const char* env = std::getenv("TWELL_DENSE_CAP");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    TORCH_CHECK(end != env && *end == '\0' && v >= 0, "TWELL_DENSE_CAP must be an integer >= 0, got '", env, "'");
    cap = up(v);
  }
  cap = std::min(cap, up(M));
  return cap < twell::kDenseMinRows ? 0 : cap;
}

// Words of the spill area for M rows: room for about 1% of rows fully dense (past it, tiles keep
// their true counts and the fused kernel recomputes them exactly).
int64_t spill_capacity(int64_t M) { return std::max<int64_t>(int64_t(1) << 20, M * 64); }

// The one op's (sparse_ffn's) internal spill block: the spill area, its words-used counter, then the
// gate kernel's ready counters.
int64_t sparse_ffn_spill_words(int64_t M) { return spill_capacity(M) + 1 + twell::gate_ready_words(int(M)); }

// tile / compression slots per tile row (checked before anything divides by compression); the gate
// kernel also needs a tile of 64, 128 or 256 columns and at least two slots (count + one entry).
void check_tiling(int64_t tile, int64_t compression, const char* op, bool gate_kernel) {
  const bool ok = compression > 0 && tile % compression == 0 &&
                  (!gate_kernel || ((tile == 64 || tile == 128 || tile == 256) && tile / compression >= 2));
  TORCH_CHECK(ok, op, ": unsupported tile ", tile, " / compression ", compression);
}

// The gate kernel's inputs (gate_twell and sparse_ffn): x [M, D], w_gate [H, D], the tiling.
void check_gate_inputs(const at::Tensor& x, const at::Tensor& w, int64_t tile, int64_t compression, const char* op) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w, "w_gate");
  TORCH_CHECK(x.size(1) == w.size(1) && x.device() == w.device(), op, ": x and w_gate disagree");
  TORCH_CHECK(x.size(1) >= 64 && x.size(1) % 64 == 0, op, ": D must be a positive multiple of 64, got ", x.size(1));
  check_tiling(tile, compression, op, true);
  TORCH_CHECK(w.size(0) <= 65536, op, ": H must be <= 65536");
}

// max_sms > 0 caps the SMs a launch may occupy (the rest stay free for a kernel on another stream).
std::vector<at::Tensor> gate_twell(const at::Tensor& x, const at::Tensor& w, int64_t tile, int64_t compression,
                                   int64_t max_sms) {
  check_gate_inputs(x, w, tile, compression, "twell.gate");
  const int64_t M = x.size(0), H = w.size(0), S = tile / compression, cap = spill_capacity(M);
  at::Tensor out = at::empty({M, ((H + tile - 1) / tile) * S}, x.options().dtype(at::kUInt32));
  at::Tensor spill = at::empty({cap + 1}, x.options().dtype(at::kUInt32));  // last word: words used
  const c10::cuda::CUDAGuard guard(x.device());
  auto sp = reinterpret_cast<uint32_t*>(spill.data_ptr());
  check_launch(twell::launch_gate_twell(x.data_ptr(), w.data_ptr(), reinterpret_cast<uint32_t*>(out.data_ptr()), sp,
                                        sp + cap, uint32_t(cap), int(M), int(x.size(1)), int(H), int(tile), int(S),
                                        x.get_device(), c10::cuda::getCurrentCUDAStream(), int(max_sms)),
               "gate");
  return {out, spill};
}

// The fused kernels' paths for one call of M rows. The block-union rule: union_ratio and union_base
// both >= 0 for this call, or both negative for the TWELL_UNION_* setting.
twell::FfnPaths ffn_paths(int64_t M, double union_ratio_arg, double union_base_arg, const char* op) {
  const bool per_call = !(union_ratio_arg < 0 && union_base_arg < 0);
  TORCH_CHECK(!per_call || (union_ratio_arg >= 0 && union_base_arg >= 0 && std::isfinite(union_ratio_arg) &&
                            std::isfinite(union_base_arg)),
              op, ": union_ratio and union_base must both be finite and >= 0 (or both negative: the "
              "TWELL_UNION_* setting), got ", union_ratio_arg, " and ", union_base_arg);
  return {per_call ? float(union_ratio_arg) : union_ratio(),
          per_call ? float(union_base_arg) : union_base(), int(dense_cap(M))};
}

at::Tensor ffn_forward(const at::Tensor& x, const at::Tensor& tw, const c10::optional<at::Tensor>& spill,
                       const c10::optional<at::Tensor>& w_act, const c10::optional<at::Tensor>& w_up,
                       const at::Tensor& w_down_t, int64_t tile, int64_t compression, int64_t max_sms,
                       const c10::optional<at::Tensor>& out_opt, double union_ratio_arg, double union_base_arg) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w_down_t, "w_down_t");
  check_tiling(tile, compression, "twell.ffn", false);
  const int64_t M = x.size(0), D = x.size(1), H = w_down_t.size(0), S = tile / compression;
  TORCH_CHECK(w_down_t.size(1) == D, "twell.ffn: w_down_t must be [H, D]");
  TORCH_CHECK(D >= 64 && D % 64 == 0 && D <= 2048, "twell.ffn: D must be a positive multiple of 64, at most 2048, "
              "got ", D);
  TORCH_CHECK(tile >= 2 && tile <= 4096, "twell.ffn: tile must be in [2, 4096], got ", tile);
  check_twell_words(tw, M, H, tile, S, "ffn");
  check_on_device_of(x, tw, "the TwELL words", "ffn");
  check_on_device_of(x, w_down_t, "w_down_t", "ffn");
  if (spill) {
    check_spill(*spill, "ffn");
    check_on_device_of(x, *spill, "the spill area", "ffn");
  }
  for (const auto* opt : {&w_act, &w_up}) {
    if (opt->has_value()) {
      check_bf16_matrix(**opt, "w_act/w_up");
      TORCH_CHECK((*opt)->sizes() == w_down_t.sizes(), "twell.ffn: w_act/w_up must be [H, D] like w_down_t");
      check_on_device_of(x, **opt, "w_act/w_up", "ffn");
    }
  }
  at::Tensor out;
  if (out_opt) {
    check_bf16_matrix(*out_opt, "out");
    TORCH_CHECK(out_opt->size(0) == M && out_opt->size(1) == D && out_opt->device() == x.device(),
                "twell.ffn: out must be [M, D] on x's device");
    out = *out_opt;
  } else {
    out = at::empty({M, D}, x.options());
  }
  const twell::FfnPaths paths = ffn_paths(M, union_ratio_arg, union_base_arg, "twell.ffn");
  const int64_t words =
      int64_t(twell::ffn_workspace_words(int(M), int(D), int(H), w_up.has_value(), w_act.has_value(), paths));
  at::Tensor work = at::empty({words}, x.options().dtype(at::kInt));  // row queues, path scratch, dense rows
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(twell::launch_twell_ffn(
                   x.data_ptr(), reinterpret_cast<const uint32_t*>(tw.data_ptr()),
                   spill ? reinterpret_cast<const uint32_t*>(spill->data_ptr()) : nullptr,
                   w_act ? w_act->data_ptr() : nullptr, w_up ? w_up->data_ptr() : nullptr, w_down_t.data_ptr(),
                   out.data_ptr(), reinterpret_cast<uint32_t*>(work.data_ptr()), int(M), int(D), int(H), int(tile),
                   int(S), paths, x.get_device(), c10::cuda::getCurrentCUDAStream(), int(max_sms)),
               "ffn");
  return out;
}

// The whole gated FFN in one op (twell.kernels.sparse_gated_ffn): gate kernel, then the fused
// kernels, with the light kernel overlapping the gate kernel's last wave (docs/kernels.md §6). The
// TwELL stays internal, so nothing outside the op sees its ready counters or the queue zeroed ahead of
// time.
at::Tensor sparse_ffn(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                      const at::Tensor& w_down_t, int64_t tile, int64_t compression, double union_ratio_arg,
                      double union_base_arg) {
  check_gate_inputs(x, w_gate, tile, compression, "twell.sparse_ffn");
  for (const auto& [w, name] : {std::pair{&w_up, "w_up"}, std::pair{&w_down_t, "w_down_t"}}) {
    check_bf16_matrix(*w, name);
    TORCH_CHECK(w->sizes() == w_gate.sizes() && w->device() == x.device(), "twell.sparse_ffn: ", name,
                " must be [H, D] like w_gate, on x's device");
  }
  const int64_t M = x.size(0), D = x.size(1), H = w_gate.size(0);
  TORCH_CHECK(D <= 2048, "twell.sparse_ffn: the fused kernel needs D <= 2048, got ", D);
  const int64_t S = tile / compression, cap = spill_capacity(M);
  at::Tensor tw = at::empty({M, ((H + tile - 1) / tile) * S}, x.options().dtype(at::kUInt32));
  at::Tensor spill = at::empty({sparse_ffn_spill_words(M)}, x.options().dtype(at::kUInt32));
  at::Tensor out = at::empty({M, D}, x.options());
  const twell::FfnPaths paths = ffn_paths(M, union_ratio_arg, union_base_arg, "twell.sparse_ffn");
  const int64_t words = int64_t(twell::ffn_workspace_words(int(M), int(D), int(H), true, true, paths));
  at::Tensor work = at::empty({words}, x.options().dtype(at::kInt));
  const c10::cuda::CUDAGuard guard(x.device());
  auto* sp = reinterpret_cast<uint32_t*>(spill.data_ptr());
  check_launch(twell::launch_sparse_gated_ffn(x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), w_down_t.data_ptr(),
                                              out.data_ptr(), reinterpret_cast<uint32_t*>(tw.data_ptr()), sp, sp + cap,
                                              uint32_t(cap), reinterpret_cast<uint32_t*>(work.data_ptr()), int(M),
                                              int(D), int(H), int(tile), int(S), paths, x.get_device(),
                                              c10::cuda::getCurrentCUDAStream()),
               "sparse_ffn");
  return out;
}

// Diagnostic: the block-union plan alone (no products). Returns (rows left to the per-row kernel,
// union sizes |U| of the blocks that take the union path, those blocks' indices, ascending).
// Synchronises the device.
std::vector<at::Tensor> ffn_plan(const at::Tensor& x, const at::Tensor& tw, const c10::optional<at::Tensor>& spill,
                                 const at::Tensor& w_up, const at::Tensor& w_down_t, int64_t tile,
                                 int64_t compression, double ratio, double base) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w_up, "w_up");
  check_bf16_matrix(w_down_t, "w_down_t");
  check_tiling(tile, compression, "twell.ffn_plan", false);
  const int64_t M = x.size(0), D = x.size(1), H = w_down_t.size(0), S = tile / compression;
  TORCH_CHECK(w_down_t.size(1) == D && w_up.sizes() == w_down_t.sizes(),
              "twell.ffn_plan: w_up and w_down_t must be [H, D] with x's D");
  const std::string why = twell::union_unsupported(int(D), int(H), true);
  TORCH_CHECK(why.empty(), "twell.ffn_plan: ", why);
  check_twell_words(tw, M, H, tile, S, "ffn_plan");
  for (const auto& [t, name] : {std::pair{&tw, "the TwELL words"}, std::pair{&w_up, "w_up"},
                                std::pair{&w_down_t, "w_down_t"}})
    check_on_device_of(x, *t, name, "ffn_plan");
  if (spill) {
    check_spill(*spill, "ffn_plan");
    check_on_device_of(x, *spill, "the spill area", "ffn_plan");
  }
  const int64_t words = int64_t(twell::union_workspace_words(int(M), int(H)));
  at::Tensor work = at::zeros({words}, x.options().dtype(at::kInt));
  const c10::cuda::CUDAGuard guard(x.device());
  auto* work0 = reinterpret_cast<uint32_t*>(work.data_ptr());
  const twell::Workspace w = twell::union_workspace(work0, int(M), int(H));
  check_launch(twell::launch_union_plan(x.data_ptr(), reinterpret_cast<const uint32_t*>(tw.data_ptr()),
                                        spill ? reinterpret_cast<const uint32_t*>(spill->data_ptr()) : nullptr,
                                        w_up.data_ptr(), w_down_t.data_ptr(), nullptr, w, int(M), int(D), int(H),
                                        int((H + tile - 1) / tile), int(S), float(ratio), float(base),
                                        c10::cuda::getCurrentCUDAStream()),
               "ffn_plan");
  const at::Tensor ctr = work.narrow(0, 0, 2).cpu();
  const int64_t n_light = ctr[0].item<int64_t>(), n_union = ctr[1].item<int64_t>();
  const int64_t nb = (M + 63) / 64;
  // Blocks in ascending order (the plan claims them with atomics, in no fixed order).
  const at::Tensor blocks = std::get<0>(work.narrow(0, w.ublocks - work0, n_union).to(at::kLong).sort());
  const at::Tensor sizes = work.narrow(0, w.usize - work0, nb).index_select(0, blocks);
  return {at::full({1}, n_light, at::kLong), sizes.cpu().to(at::kLong), blocks.cpu()};
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TwELL sparse FFN kernels (Hopper sm_90a)";
  m.def("gate_twell", &gate_twell, "TwELL(relu(x @ w^T)) written by the gate GEMM epilogue",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("tile"), pybind11::arg("compression"),
        pybind11::arg("max_sms") = 0);
  m.def("ffn_forward", &ffn_forward, "fused sparse up/down projection from TwELL", pybind11::arg("x"),
        pybind11::arg("tw"), pybind11::arg("spill"), pybind11::arg("w_act"), pybind11::arg("w_up"),
        pybind11::arg("w_down_t"), pybind11::arg("tile"), pybind11::arg("compression"), pybind11::arg("max_sms") = 0,
        pybind11::arg("out") = pybind11::none(), pybind11::arg("union_ratio") = -1.0,
        pybind11::arg("union_base") = -1.0);
  m.def("sparse_ffn", &sparse_ffn, "gate kernel + fused up/down in one call (the fused kernel overlaps the gate's tail)",
        pybind11::arg("x"), pybind11::arg("w_gate"), pybind11::arg("w_up"), pybind11::arg("w_down_t"),
        pybind11::arg("tile"), pybind11::arg("compression"), pybind11::arg("union_ratio") = -1.0,
        pybind11::arg("union_base") = -1.0);
  m.def("dense_cap", &dense_cap, "heavy rows the dense path may take for M rows ($TWELL_DENSE_CAP or the default)",
        pybind11::arg("M"));
  m.def("union_ratio", &union_ratio, "block-union threshold in effect ($TWELL_UNION_RATIO or the default)");
  m.def("union_base", &union_base, "block-union fixed-cost term in entries ($TWELL_UNION_BASE or the default)");
  m.def("sparse_ffn_spill_words", &sparse_ffn_spill_words,
        "words of sparse_ffn's internal spill block (spill area, its counter, the gate's ready counters)");
  m.def("union_unsupported",
        [](int64_t D, int64_t H) {  // clamped so that a huge value cannot wrap into a supported one
          auto narrow = [](int64_t v) { return int(std::max<int64_t>(-1, std::min<int64_t>(v, 1 << 30))); };
          return twell::union_unsupported(narrow(D), narrow(H), true);
        },
        "why the block-union path cannot serve a gated layer of this D and H, or '' when it can",
        pybind11::arg("D"), pybind11::arg("H"));
  m.def("ffn_plan", &ffn_plan, "block-union plan only (diagnostic)", pybind11::arg("x"), pybind11::arg("tw"),
        pybind11::arg("spill"), pybind11::arg("w_up"), pybind11::arg("w_down_t"), pybind11::arg("tile"),
        pybind11::arg("compression"), pybind11::arg("ratio"), pybind11::arg("base"));
}
