// Shared device helpers for the TwELL kernels (Hopper, sm_90a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace twell {

// TwELL word: (bf16 bits << 16) | global column (see src/twell/formats/twell.py).
__device__ __forceinline__ float entry_value(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t entry_col(uint32_t w) { return w & 0xFFFFu; }

// bf16x2 word -> two floats (a bf16 is the upper half of a float).
__device__ __forceinline__ float bf16lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// ReLU that keeps NaN (fmaxf would turn NaN into 0, hiding a bad input), rounded to bf16.
__device__ __forceinline__ __nv_bfloat16 relu_bf16(float v) {
  return __float2bfloat16_rn(v > 0.f || v != v ? v : 0.f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint4 ldg_nc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

}  // namespace twell
