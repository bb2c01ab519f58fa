// Torch glue shared by the bindings of every kernel family (bindings_<family>.cpp): argument checks
// and the functions each family exposes, which bindings.cpp registers with pybind11. The
// torch.library ops (src/twell/kernels/ops.py) validate arguments with readable messages first;
// these checks guard the kernels' own assumptions, for callers of the extension itself too.
//
// Nothing here reads the environment: every setting of a launch (block-union rule, dense-path
// capacity, gate cluster size, spill capacity) is an argument, with its default named once in
// Python (twell.reference.ffn, twell.kernels.ops; docs/kernels.md §2).
#pragma once

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>
#include <vector>

#include "twell_kernels.h"

namespace twell::bind {

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "twell.", what, " failed: ", cudaGetErrorString(err),
              (*twell::last_error() ? std::string(" (") + twell::last_error() + ")" : std::string()));
}

// The kernels load rows with 16-byte vectors and TMA, which fault on a misaligned base address
// (a contiguous view at an odd element offset): refuse it here rather than crash the context.
inline void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "twell: ", name,
              " must start at a 16-byte aligned address (a view at an element offset is not; pass a copy)");
}

inline void check_bf16_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.is_contiguous(),
              "twell: ", name, " must be a contiguous bf16 CUDA matrix");
  check_aligned(t, name);
}

// Every tensor of a launch on x's GPU: a pointer into another GPU's memory faults (or, with peer
// access, reads remotely) instead of failing here.
inline void check_on_device_of(const at::Tensor& x, const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.device() == x.device(), "twell.", op, ": ", name, " is on ", t.device(), ", x on ", x.device());
}

// TwELL words of M rows over H neurons: uint32 [M, ceil(H/tile) * S], contiguous, on the device.
inline void check_twell_words(const at::Tensor& tw, int64_t M, int64_t H, int64_t tile, int64_t S, const char* op) {
  TORCH_CHECK(tw.is_cuda() && tw.scalar_type() == at::kUInt32 && tw.is_contiguous() && tw.dim() == 2 &&
                  tw.size(0) == M && tw.size(1) == ((H + tile - 1) / tile) * S,
              "twell.", op, ": TwELL words must be uint32 [M, ceil(H/tile)*S]");
  check_aligned(tw, "the TwELL words");
}

// The gate kernel's spill area (uint32 words, contiguous, on the device, aligned).
inline void check_spill(const at::Tensor& spill, const char* op) {
  TORCH_CHECK(spill.is_cuda() && spill.scalar_type() == at::kUInt32 && spill.is_contiguous(), "twell.", op,
              ": bad spill area");
  check_aligned(spill, "the spill area");
}

// tile / compression slots per tile row (checked before anything divides by compression); the gate
// kernel also needs a tile of 64, 128 or 256 columns and at least two slots (count + one entry).
inline void check_tiling(int64_t tile, int64_t compression, const char* op, bool gate_kernel) {
  const bool ok = compression > 0 && tile % compression == 0 &&
                  (!gate_kernel || ((tile == 64 || tile == 128 || tile == 256) && tile / compression >= 2));
  TORCH_CHECK(ok, op, ": unsupported tile ", tile, " / compression ", compression);
}

// The settings of a gate launch: the spill area's capacity in words (the caller sizes it with
// twell.kernels.ops.spill_capacity, the one formula; a count word holds an offset below 2^31) and
// the CTAs per cluster (1 or 2).
inline void check_gate_settings(int64_t spill_cap, int64_t cluster, const char* op) {
  TORCH_CHECK(spill_cap >= 0 && spill_cap < (int64_t(1) << 31), op, ": spill_cap must be in [0, 2^31) words "
              "(pass twell.kernels.ops.spill_capacity(M)), got ", spill_cap);
  TORCH_CHECK(cluster == 1 || cluster == 2, op, ": cluster must be 2 (the gate kernel's 2-CTA clusters) or 1 "
              "(its single-CTA variant), got ", cluster);
}

// The gate kernel's inputs (gate_twell and sparse_ffn): x [M, D], w_gate [H, D], the tiling.
inline void check_gate_inputs(const at::Tensor& x, const at::Tensor& w, int64_t tile, int64_t compression,
                              const char* op) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w, "w_gate");
  TORCH_CHECK(x.size(1) == w.size(1) && x.device() == w.device(), op, ": x and w_gate disagree");
  TORCH_CHECK(x.size(1) >= 64 && x.size(1) % 64 == 0, op, ": D must be a positive multiple of 64, got ", x.size(1));
  check_tiling(tile, compression, op, true);
  TORCH_CHECK(w.size(0) <= 65536, op, ": H must be <= 65536");
}

// -- gate (bindings_gate.cpp) -------------------------------------------------------------------------
std::vector<at::Tensor> gate_twell(const at::Tensor& x, const at::Tensor& w, int64_t tile, int64_t compression,
                                   int64_t max_sms, int64_t spill_cap, int64_t cluster);
int64_t sparse_ffn_spill_words(int64_t M, int64_t spill_cap);

// -- dense path for heavy rows (bindings_dense.cpp) ---------------------------------------------------
int64_t dense_cap(int64_t M, const c10::optional<int64_t>& requested);

// -- fused up/down and the one op (bindings_ffn.cpp) --------------------------------------------------
at::Tensor ffn_forward(const at::Tensor& x, const at::Tensor& tw, const c10::optional<at::Tensor>& spill,
                       const c10::optional<at::Tensor>& w_act, const c10::optional<at::Tensor>& w_up,
                       const at::Tensor& w_down_t, int64_t tile, int64_t compression, int64_t max_sms,
                       const c10::optional<at::Tensor>& out_opt, double union_ratio, double union_base,
                       const c10::optional<int64_t>& dense_cap_rows);
at::Tensor sparse_ffn(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                      const at::Tensor& w_down_t, int64_t tile, int64_t compression, double union_ratio,
                      double union_base, const c10::optional<int64_t>& dense_cap_rows, int64_t spill_cap,
                      int64_t cluster);

// -- block-union path (bindings_union.cpp) ------------------------------------------------------------
std::vector<at::Tensor> ffn_plan(const at::Tensor& x, const at::Tensor& tw, const c10::optional<at::Tensor>& spill,
                                 const at::Tensor& w_up, const at::Tensor& w_down_t, int64_t tile,
                                 int64_t compression, double ratio, double base);
std::string union_unsupported(int64_t D, int64_t H);

// -- decoding (bindings_decode.cpp) -------------------------------------------------------------------
at::Tensor decode_ffn(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                      const at::Tensor& w_down_t, double threshold, bool up_relu);

// -- training (bindings_train.cpp) --------------------------------------------------------------------
std::vector<at::Tensor> train_compact(const at::Tensor& g, int64_t slots);
std::vector<at::Tensor> train_rows_forward(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& val,
                                           const at::Tensor& nnz, const at::Tensor& w_up, const at::Tensor& w_down_t,
                                           int64_t slots);
std::vector<at::Tensor> train_rows_backward(const at::Tensor& dy, const at::Tensor& idx, const at::Tensor& val,
                                            const at::Tensor& u, const at::Tensor& h, const at::Tensor& nnz,
                                            const at::Tensor& w_down_t, const at::Tensor& w_up,
                                            const at::Tensor& w_gate, const c10::optional<at::Tensor>& l1_grad,
                                            int64_t slots);
std::vector<at::Tensor> train_columns(const at::Tensor& ent, const at::Tensor& item_col, const at::Tensor& item_lo,
                                      const at::Tensor& item_hi, const at::Tensor& item_part,
                                      const at::Tensor& long_col, const at::Tensor& long_part_lo,
                                      const at::Tensor& long_part_n, int64_t n_part, const at::Tensor& h,
                                      const at::Tensor& du, const at::Tensor& dg, const at::Tensor& x,
                                      const at::Tensor& dy, const c10::optional<at::Tensor>& heavy_down,
                                      const c10::optional<at::Tensor>& heavy_up,
                                      const c10::optional<at::Tensor>& heavy_gate, int64_t H, int64_t slots,
                                      int64_t column_parts);
std::vector<at::Tensor> train_worklist(const at::Tensor& idx, const at::Tensor& nnz, int64_t H, int64_t slots,
                                       int64_t chunk);
at::Tensor transpose_bf16(const at::Tensor& w);
at::Tensor gate_product(const at::Tensor& g, const at::Tensor& u, double threshold, bool up_relu);
std::vector<at::Tensor> train_heavy_grads(const at::Tensor& g, const at::Tensor& u, const at::Tensor& ds,
                                          const c10::optional<at::Tensor>& l1_grad);
std::vector<at::Tensor> train_forward(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                                      const at::Tensor& w_down, int64_t slots, int64_t chunk,
                                      const c10::optional<at::Tensor>& sizes_host);
std::vector<at::Tensor> train_backward(const at::Tensor& d_out, const c10::optional<at::Tensor>& l1_grad,
                                       const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                                       const at::Tensor& w_down, const at::Tensor& w_down_t, const at::Tensor& idx,
                                       const at::Tensor& val, const at::Tensor& u, const at::Tensor& h,
                                       const at::Tensor& nnz, const at::Tensor& heavy, const at::Tensor& ent,
                                       const at::Tensor& items, const at::Tensor& longs, const at::Tensor& sizes,
                                       int64_t slots, int64_t column_parts,
                                       const c10::optional<std::vector<at::Tensor>>& rows_done);

}  // namespace twell::bind
