// Bindings of the gate kernel (csrc/twell_gate.cu): TwELL words and the spill area from the gate GEMM.
#include "bindings_common.h"

namespace twell::bind {

// max_sms > 0 caps the SMs a launch may occupy (the rest stay free for a kernel on another stream).
// spill_cap: words of the spill area (twell.kernels.ops.spill_capacity(M) sizes it, so that the fake
// op's output shape and this allocation come from one formula); cluster: CTAs per cluster.
std::vector<at::Tensor> gate_twell(const at::Tensor& x, const at::Tensor& w, int64_t tile, int64_t compression,
                                   int64_t max_sms, int64_t spill_cap, int64_t cluster) {
  check_gate_inputs(x, w, tile, compression, "twell.gate");
  check_gate_settings(spill_cap, cluster, "twell.gate");
  const int64_t M = x.size(0), H = w.size(0), S = tile / compression, cap = spill_cap;
  at::Tensor out = at::empty({M, ((H + tile - 1) / tile) * S}, x.options().dtype(at::kUInt32));
  at::Tensor spill = at::empty({cap + 1}, x.options().dtype(at::kUInt32));  // last word: words used
  const c10::cuda::CUDAGuard guard(x.device());
  auto sp = reinterpret_cast<uint32_t*>(spill.data_ptr());
  check_launch(twell::launch_gate_twell(x.data_ptr(), w.data_ptr(), reinterpret_cast<uint32_t*>(out.data_ptr()), sp,
                                        sp + cap, uint32_t(cap), int(M), int(x.size(1)), int(H), int(tile), int(S),
                                        x.get_device(), c10::cuda::getCurrentCUDAStream(), int(cluster),
                                        int(max_sms)),
               "gate");
  return {out, spill};
}

// The one op's (sparse_ffn's) internal spill block: the spill area of spill_cap words, its words-used
// counter, then the gate kernel's ready counters.
int64_t sparse_ffn_spill_words(int64_t M, int64_t spill_cap) {
  TORCH_CHECK(M >= 0 && M < (int64_t(1) << 31), "twell.sparse_ffn_spill_words: M must be in [0, 2^31), got ", M);
  check_gate_settings(spill_cap, 2, "twell.sparse_ffn_spill_words");
  return spill_cap + 1 + twell::gate_ready_words(int(M));
}

}  // namespace twell::bind
