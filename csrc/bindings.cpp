// Torch glue for the TwELL CUDA kernels: argument checks, allocation, the current stream.
// The torch.library ops (src/twell/kernels/ops.py) call these functions; Python validates the
// arguments with readable messages first, these checks guard the kernels' own assumptions.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "twell_kernels.h"

namespace {

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "twell.", what, " failed: ", cudaGetErrorString(err),
              (*twell::last_error() ? std::string(" (") + twell::last_error() + ")" : std::string()));
}

void check_bf16_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.is_contiguous(),
              "twell: ", name, " must be a contiguous bf16 CUDA matrix");
}

// Words of the spill area for M rows: room for about 1% of rows fully dense (past it, tiles keep
// their true counts and the fused kernel recomputes them exactly).
int64_t spill_capacity(int64_t M) { return std::max<int64_t>(int64_t(1) << 20, M * 64); }

std::vector<at::Tensor> gate_twell(const at::Tensor& x, const at::Tensor& w, int64_t tile, int64_t compression) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w, "w_gate");
  TORCH_CHECK(x.size(1) == w.size(1) && x.device() == w.device(), "twell.gate: x and w_gate disagree");
  TORCH_CHECK(x.size(1) % 64 == 0, "twell.gate: D must be a multiple of 64, got ", x.size(1));
  TORCH_CHECK((tile == 64 || tile == 128 || tile == 256) && tile % compression == 0 && tile / compression >= 2,
              "twell.gate: unsupported tile ", tile, " / compression ", compression);
  TORCH_CHECK(w.size(0) <= 65536, "twell.gate: H must be <= 65536");
  const int64_t M = x.size(0), H = w.size(0), S = tile / compression, cap = spill_capacity(M);
  at::Tensor out = at::empty({M, ((H + tile - 1) / tile) * S}, x.options().dtype(at::kUInt32));
  at::Tensor spill = at::empty({cap + 1}, x.options().dtype(at::kUInt32));  // last word: words used
  const c10::cuda::CUDAGuard guard(x.device());
  auto sp = reinterpret_cast<uint32_t*>(spill.data_ptr());
  check_launch(twell::launch_gate_twell(x.data_ptr(), w.data_ptr(), reinterpret_cast<uint32_t*>(out.data_ptr()), sp,
                                        sp + cap, uint32_t(cap), int(M), int(x.size(1)), int(H), int(tile), int(S),
                                        x.get_device(), c10::cuda::getCurrentCUDAStream()),
               "gate");
  return {out, spill};
}

at::Tensor ffn_forward(const at::Tensor& x, const at::Tensor& tw, const c10::optional<at::Tensor>& spill,
                       const c10::optional<at::Tensor>& w_act, const c10::optional<at::Tensor>& w_up,
                       const at::Tensor& w_down_t, int64_t tile, int64_t compression) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w_down_t, "w_down_t");
  const int64_t M = x.size(0), D = x.size(1), H = w_down_t.size(0), S = tile / compression;
  TORCH_CHECK(w_down_t.size(1) == D, "twell.ffn: w_down_t must be [H, D]");
  TORCH_CHECK(D % 64 == 0 && D <= 2048, "twell.ffn: D must be a multiple of 64 and at most 2048, got ", D);
  TORCH_CHECK(tw.is_cuda() && tw.scalar_type() == at::kUInt32 && tw.is_contiguous() && tw.dim() == 2 &&
                  tw.size(0) == M && tw.size(1) == ((H + tile - 1) / tile) * S,
              "twell.ffn: TwELL words must be uint32 [M, ceil(H/tile)*S]");
  if (spill) TORCH_CHECK(spill->is_cuda() && spill->scalar_type() == at::kUInt32 && spill->is_contiguous(),
                         "twell.ffn: bad spill area");
  for (const auto* opt : {&w_act, &w_up}) {
    if (opt->has_value()) {
      check_bf16_matrix(**opt, "w_act/w_up");
      TORCH_CHECK((*opt)->sizes() == w_down_t.sizes(), "twell.ffn: w_act/w_up must be [H, D] like w_down_t");
    }
  }
  at::Tensor out = at::empty({M, D}, x.options());
  at::Tensor heavy = at::empty({M + 2}, x.options().dtype(at::kInt));  // counts + row queue
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(twell::launch_twell_ffn(
                   x.data_ptr(), reinterpret_cast<const uint32_t*>(tw.data_ptr()),
                   spill ? reinterpret_cast<const uint32_t*>(spill->data_ptr()) : nullptr,
                   w_act ? w_act->data_ptr() : nullptr, w_up ? w_up->data_ptr() : nullptr, w_down_t.data_ptr(),
                   out.data_ptr(), reinterpret_cast<uint32_t*>(heavy.data_ptr()), int(M), int(D), int(H), int(tile),
                   int(S), x.get_device(), c10::cuda::getCurrentCUDAStream()),
               "ffn");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TwELL sparse FFN kernels (Hopper sm_90a)";
  m.def("gate_twell", &gate_twell, "TwELL(relu(x @ w^T)) written by the gate GEMM epilogue",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("tile"), pybind11::arg("compression"));
  m.def("ffn_forward", &ffn_forward, "fused sparse up/down projection from TwELL", pybind11::arg("x"),
        pybind11::arg("tw"), pybind11::arg("spill"), pybind11::arg("w_act"), pybind11::arg("w_up"),
        pybind11::arg("w_down_t"), pybind11::arg("tile"), pybind11::arg("compression"));
}
