// What the two weight-stationary probes (stationary_loop.cu, stationary_mma.cu) share: the shape,
// the tile layout (one CTA per SM holding 1408 neurons x 64 columns of one quarter of H), the tile
// loader, error checks and the timing loop. Header-only so each probe still builds with plain nvcc.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                     \
  do {                                                            \
    cudaError_t e = (x);                                          \
    if (e != cudaSuccess) {                                       \
      printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                    \
    }                                                             \
  } while (0)

constexpr int M = 65536, D = 2048, H = 5632;
constexpr int NQ = 4, R = H / NQ, DC = 64, NC = D / DC;
constexpr int THREADS = 512;
constexpr int TILE_BYTES = R * DC * 2;

__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}

// Copies tile (q, c) of `tiles` ([NQ * NC] tiles of TILE_BYTES) into dynamic shared memory; returns
// its shared address.
__device__ __forceinline__ uint32_t load_tile(const uint4* tiles, int q, int c) {
  extern __shared__ __align__(1024) uint4 sm[];
  const uint4* src = tiles + size_t(q * NC + c) * (TILE_BYTES / 16);
  for (int i = threadIdx.x; i < TILE_BYTES / 16; i += blockDim.x) sm[i] = __ldg(src + i);
  __syncthreads();
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(sm));
  return a;
}

// Median of 10 timed launches (CUDA events) after 2 warm-up launches.
template <class F>
float median_ms(F launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < 12; ++r) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) ts.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// A device copy of a host vector, as D* (the caller frees it with cudaFree, or leaves it to exit).
template <class D, class T>
D* to_device(const std::vector<T>& h) {
  void* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<D*>(d);
}
