// Host entry points of the TwELL CUDA kernels. Pure CUDA (no torch headers) so that every .cu
// compiles with nvcc alone; the torch glue (checks, allocation, current stream) is bindings.cpp.
// Each launcher returns cudaSuccess or the error of its launch; messages via twell_last_error().
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace twell {

// TwELL(relu(x @ w^T)): x bf16 [M, D], w bf16 [H, D] (row-major, contiguous, D % 64 == 0),
// out uint32 [M, ceil(H/tile) * S], S = tile / compression, tile in {64, 128, 256}.
// Overflowing tile rows go to spill[0 .. spill_cap) (count word = 0x80000000 | offset); *spill_used
// (zeroed here) ends as the words claimed. spill may be null (then counts keep the true count).
cudaError_t launch_gate_twell(const void* x, const void* w, uint32_t* out, uint32_t* spill, uint32_t* spill_used,
                              uint32_t spill_cap, int M, int D, int H, int tile, int S, int device,
                              cudaStream_t stream);

// out bf16 [M, D] from TwELL words tw [M, ceil(H/tile) * S] (+ spill area, may be null).
// gated: w_up != nullptr. w_act (optional): the weight whose ReLU made the TwELL; enables the exact
// in-kernel recompute of overflowing tiles without a spill copy (when null, such rows are left
// unwritten for the caller). heavy_queue: int32 scratch of M + 2 words. 64 <= D <= 2048.
cudaError_t launch_twell_ffn(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_act,
                             const void* w_up, const void* w_down_t, void* out, uint32_t* heavy_queue, int M, int D,
                             int H, int tile, int S, int device, cudaStream_t stream);

// Detail of the last failure that is not a plain CUDA error (e.g. tensor-map encoding).
const char* last_error();
void set_error(const char* msg);

}  // namespace twell
