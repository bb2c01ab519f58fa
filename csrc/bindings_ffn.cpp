// Bindings of the fused up/down kernels (csrc/twell_ffn.cu) and the one op, gate kernel then fused
// kernels in one call.
#include "bindings_common.h"

#include <cmath>
#include <utility>

namespace twell::bind {
namespace {

// The fused kernels' optional paths for one call of M rows. Block-union path (csrc/twell_union.cu):
// a block of 64 rows takes it when its union U of active neurons satisfies
// |U| <= union_ratio x (entries - union_base); ratio 0 turns it off (the default; why:
// docs/kernels.md §7). dense_cap_rows: the dense path's capacity (dense_cap in bindings_dense.cpp; None:
// its rule).
twell::FfnPaths ffn_paths(int64_t M, double union_ratio, double union_base,
                          const c10::optional<int64_t>& dense_cap_rows, const char* op) {
  TORCH_CHECK(std::isfinite(union_ratio) && std::isfinite(union_base) && union_ratio >= 0 && union_base >= 0, op,
              ": union_ratio and union_base must both be finite and >= 0 (ratio 0: the block-union path off), got ",
              union_ratio, " and ", union_base);
  return {float(union_ratio), float(union_base), int(dense_cap(M, dense_cap_rows))};
}

}  // namespace

at::Tensor ffn_forward(const at::Tensor& x, const at::Tensor& tw, const c10::optional<at::Tensor>& spill,
                       const c10::optional<at::Tensor>& w_act, const c10::optional<at::Tensor>& w_up,
                       const at::Tensor& w_down_t, int64_t tile, int64_t compression, int64_t max_sms,
                       const c10::optional<at::Tensor>& out_opt, double union_ratio, double union_base,
                       const c10::optional<int64_t>& dense_cap_rows) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w_down_t, "w_down_t");
  check_tiling(tile, compression, "twell.ffn", false);
  const int64_t M = x.size(0), D = x.size(1), H = w_down_t.size(0), S = tile / compression;
  TORCH_CHECK(w_down_t.size(1) == D, "twell.ffn: w_down_t must be [H, D]");
  TORCH_CHECK(D >= 64 && D % 64 == 0 && D <= twell::kFfnMaxD, "twell.ffn: D must be a positive multiple of 64, at most ",
              twell::kFfnMaxD, ", got ", D);
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
  const twell::FfnPaths paths = ffn_paths(M, union_ratio, union_base, dense_cap_rows, "twell.ffn");
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
// time. spill_cap and cluster as for gate_twell.
at::Tensor sparse_ffn(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                      const at::Tensor& w_down_t, int64_t tile, int64_t compression, double union_ratio,
                      double union_base, const c10::optional<int64_t>& dense_cap_rows, int64_t spill_cap,
                      int64_t cluster) {
  check_gate_inputs(x, w_gate, tile, compression, "twell.sparse_ffn");
  check_gate_settings(spill_cap, cluster, "twell.sparse_ffn");
  for (const auto& [w, name] : {std::pair{&w_up, "w_up"}, std::pair{&w_down_t, "w_down_t"}}) {
    check_bf16_matrix(*w, name);
    TORCH_CHECK(w->sizes() == w_gate.sizes() && w->device() == x.device(), "twell.sparse_ffn: ", name,
                " must be [H, D] like w_gate, on x's device");
  }
  const int64_t M = x.size(0), D = x.size(1), H = w_gate.size(0);
  TORCH_CHECK(D <= twell::kFfnMaxD, "twell.sparse_ffn: the fused kernel needs D <= ", twell::kFfnMaxD, ", got ", D);
  const int64_t S = tile / compression, cap = spill_cap;
  const twell::FfnPaths paths = ffn_paths(M, union_ratio, union_base, dense_cap_rows, "twell.sparse_ffn");
  at::Tensor tw = at::empty({M, ((H + tile - 1) / tile) * S}, x.options().dtype(at::kUInt32));
  at::Tensor spill = at::empty({sparse_ffn_spill_words(M, cap)}, x.options().dtype(at::kUInt32));
  at::Tensor out = at::empty({M, D}, x.options());
  const int64_t words = int64_t(twell::ffn_workspace_words(int(M), int(D), int(H), true, true, paths));
  at::Tensor work = at::empty({words}, x.options().dtype(at::kInt));
  const c10::cuda::CUDAGuard guard(x.device());
  auto* sp = reinterpret_cast<uint32_t*>(spill.data_ptr());
  check_launch(twell::launch_sparse_gated_ffn(x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), w_down_t.data_ptr(),
                                              out.data_ptr(), reinterpret_cast<uint32_t*>(tw.data_ptr()), sp, sp + cap,
                                              uint32_t(cap), reinterpret_cast<uint32_t*>(work.data_ptr()), int(M),
                                              int(D), int(H), int(tile), int(S), paths, x.get_device(),
                                              c10::cuda::getCurrentCUDAStream(), int(cluster)),
               "sparse_ffn");
  return out;
}

}  // namespace twell::bind
