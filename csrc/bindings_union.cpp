// Bindings of the block-union path (csrc/twell_union.cu): its shape limits and its plan alone.
#include "bindings_common.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

namespace twell::bind {

// Why the block-union path cannot serve a gated layer of this D and H, or "" when it can. Clamped so
// that a huge value cannot wrap into a supported one.
std::string union_unsupported(int64_t D, int64_t H) {
  auto narrow = [](int64_t v) { return int(std::max<int64_t>(-1, std::min<int64_t>(v, 1 << 30))); };
  return twell::union_unsupported(narrow(D), narrow(H), true);
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
  TORCH_CHECK(std::isfinite(ratio) && std::isfinite(base) && ratio >= 0 && base >= 0,
              "twell.ffn_plan: ratio and base must both be finite and >= 0, got ", ratio, " and ", base);
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

}  // namespace twell::bind
