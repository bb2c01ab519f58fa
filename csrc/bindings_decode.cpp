// Bindings of the decoding FFN (csrc/twell_decode.cu): the gated FFN for a few rows.
#include "bindings_common.h"

#include <cmath>
#include <utility>

namespace twell::bind {

// The gated FFN for a few rows (decoding, twell_decode.cu): reads only the active neurons' up and
// down weight rows. M <= kDecodeMaxRows. threshold: FATReLU's (0: ReLU); up_relu: dReLU.
at::Tensor decode_ffn(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                      const at::Tensor& w_down_t, double threshold, bool up_relu) {
  TORCH_CHECK(std::isfinite(threshold) && threshold >= 0, "twell.decode_ffn: threshold (FATReLU) must be finite and >= 0, got ",
              threshold);
  check_bf16_matrix(x, "x");
  for (const auto& [w, name] : {std::pair{&w_gate, "w_gate"}, std::pair{&w_up, "w_up"},
                                std::pair{&w_down_t, "w_down_t"}}) {
    check_bf16_matrix(*w, name);
    TORCH_CHECK(w->sizes() == w_gate.sizes() && w->size(1) == x.size(1) && w->device() == x.device(),
                "twell.decode_ffn: ", name, " must be [H, D] like w_gate, D as x's, on x's device");
  }
  const int64_t M = x.size(0), D = x.size(1), H = w_gate.size(0);
  TORCH_CHECK(M >= 1 && M <= twell::kDecodeMaxRows, "twell.decode_ffn: takes 1 to ", twell::kDecodeMaxRows,
              " rows, got ", M);
  TORCH_CHECK(D >= 64 && D % 64 == 0, "twell.decode_ffn: D must be a positive multiple of 64, got ", D);
  TORCH_CHECK(H >= 1 && H <= twell::kDecodeMaxH, "twell.decode_ffn: H must be in [1, ", twell::kDecodeMaxH, "], got ",
              H);
  at::Tensor out = at::empty({M, D}, x.options());
  const int64_t bytes = int64_t(twell::decode_workspace_bytes(int(M), int(D), int(H)));
  at::Tensor work = at::empty({(bytes + 15) / 16 * 4}, x.options().dtype(at::kInt));
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(twell::launch_decode_ffn(x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), w_down_t.data_ptr(),
                                        out.data_ptr(), work.data_ptr(), int(M), int(D), int(H),
                                        c10::cuda::getCurrentCUDAStream(), float(threshold), up_relu),
               "decode_ffn");
  return out;
}

}  // namespace twell::bind
