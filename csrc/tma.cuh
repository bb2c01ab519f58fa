// TMA helpers shared by the kernels that load tiles with the tensor-memory accelerator.
#pragma once
#include <cuda.h>
#include <stdint.h>

#include "common.cuh"

namespace twell {

// 2-D tile load into shared memory, completing `bytes` of transaction on the mbarrier.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c_inner, int c_outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c_inner), "r"(c_outer)
      : "memory");
}

// 2-D bf16 tensor map over a row-major [rows, cols] matrix; boxes of box_rows x 64 columns (128
// bytes, 128B swizzle; boxes past the matrix are zero-filled). Defined in twell_gate.cu; on failure
// it records the reason (last_error()) and returns false.
bool make_map(CUtensorMap* map, const void* ptr, int rows, int cols, int box_rows);

}  // namespace twell
