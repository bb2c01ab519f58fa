// Hardware probe for the fused-kernel design (not part of the extension): how fast can SMs pull
// 4 KB weight rows out of L2 when the rows are picked at random per token, as the sparse up/down
// projection does? Prints GB/s for
//   stream   coalesced reads of an L2-resident 40 MB table (the L2 ceiling),
//   ldg-N    one warp per token, each pair's two 4 KB rows loaded with 16-byte LDG into registers,
//            N warps per block,
//   bulk-K   one warp per token, rows copied with cp.async.bulk into a K-deep shared ring,
//   dram     coalesced reads of a 1 GB buffer (DRAM ceiling).
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o l2_gather l2_gather.cu
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

constexpr int D = 2048;             // bf16 per row -> 4 KB
constexpr int H = 5632;

__global__ void stream_kernel(const uint4* __restrict__ p, size_t n, int reps, uint32_t* sink) {
  uint32_t acc = 0;
  for (int r = 0; r < reps; ++r)
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
      uint4 v = __ldg(p + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  if (acc == 0x12345678u) sink[0] = acc;
}

// One warp per token: for each of its nnz neurons load the up row and the down row (8 KB).
__global__ void ldg_kernel(const uint4* __restrict__ wu, const uint4* __restrict__ wd, const uint16_t* __restrict__ idx,
                           int M, int nnz, uint32_t* sink) {
  const int lane = threadIdx.x % 32;
  const int tok = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (tok >= M) return;
  uint32_t acc = 0;
  for (int k = 0; k < nnz; ++k) {
    const int n = idx[size_t(tok) * nnz + k];
    const uint4* a = wu + size_t(n) * (D / 8);
    const uint4* b = wd + size_t(n) * (D / 8);
    uint4 va[8], vb[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) { va[c] = __ldg(a + 32 * c + lane); vb[c] = __ldg(b + 32 * c + lane); }
#pragma unroll
    for (int c = 0; c < 8; ++c) acc ^= va[c].x ^ vb[c].y ^ va[c].z ^ vb[c].w;
  }
  if (acc == 0x12345678u) sink[tok] = acc;
}

// Gather from ONE table of `rows` rows (two rows per pair, so the bytes match ldg_kernel); optional
// evict-last policy on the table loads, and optional streaming of a polluting buffer (x rows).
template <bool HINT>
__global__ void ldg1_kernel(const uint4* __restrict__ tab, int rows, const uint16_t* __restrict__ idx, int M, int nnz,
                            const uint4* __restrict__ xs, uint32_t* sink) {
  const int lane = threadIdx.x % 32;
  const int tok = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (tok >= M) return;
  uint64_t first, last;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(last));
  uint32_t acc = 0;
  if (xs) {  // a 4 KB streamed row per token, as the x row of the real kernel
    const uint4* xr = xs + size_t(tok) * (D / 8);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      uint4 v;
      asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(xr + 32 * c + lane), "l"(first));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  for (int k = 0; k < nnz; ++k) {
    const int n = idx[size_t(tok) * nnz + k] % rows;
    const uint4* a = tab + size_t(n) * (D / 8);
    const uint4* b = tab + size_t((n * 7 + 1) % rows) * (D / 8);
    uint4 va[8], vb[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (HINT) {
        asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(va[c].x), "=r"(va[c].y), "=r"(va[c].z), "=r"(va[c].w) : "l"(a + 32 * c + lane), "l"(last));
        asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(vb[c].x), "=r"(vb[c].y), "=r"(vb[c].z), "=r"(vb[c].w) : "l"(b + 32 * c + lane), "l"(last));
      } else {
        va[c] = __ldg(a + 32 * c + lane); vb[c] = __ldg(b + 32 * c + lane);
      }
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) acc ^= va[c].x ^ va[c].y ^ va[c].z ^ va[c].w ^ vb[c].x ^ vb[c].y ^ vb[c].z ^ vb[c].w;
  }
  if (acc == 0x12345678u) sink[tok] = acc;
}

// Gather rows of 4 KB stored with a padded stride (bytes), two rows per pair as above.
__global__ void ldg_stride_kernel(const uint8_t* __restrict__ tab, int rows, size_t stride, const uint16_t* __restrict__ idx,
                                  int M, int nnz, uint32_t* sink) {
  const int lane = threadIdx.x % 32;
  const int tok = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (tok >= M) return;
  uint32_t acc = 0;
  for (int k = 0; k < nnz; ++k) {
    const int n = idx[size_t(tok) * nnz + k] % rows;
    const uint4* a = reinterpret_cast<const uint4*>(tab + size_t(n) * stride);
    const uint4* b = reinterpret_cast<const uint4*>(tab + size_t((n * 7 + 1) % rows) * stride);
    uint4 va[8], vb[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) { va[c] = __ldg(a + 32 * c + lane); vb[c] = __ldg(b + 32 * c + lane); }
#pragma unroll
    for (int c = 0; c < 8; ++c) acc ^= va[c].x ^ va[c].y ^ va[c].z ^ va[c].w ^ vb[c].x ^ vb[c].y ^ vb[c].z ^ vb[c].w;
  }
  if (acc == 0x12345678u) sink[tok] = acc;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// One warp per token; lane 0 keeps K pairs (2 x 4 KB each) in flight with bulk copies.
template <int K>
__global__ void bulk_kernel(const uint8_t* __restrict__ wu, const uint8_t* __restrict__ wd, const uint16_t* __restrict__ idx,
                            int M, int nnz, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  uint8_t* ring = smem + size_t(warp) * K * 8192;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + size_t(warps) * K * 8192) + warp * K;
  if (lane == 0)
    for (int s = 0; s < K; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[s])));
  __syncwarp();
  asm volatile("fence.proxy.async.shared::cta;");
  uint32_t acc = 0;
  uint32_t phase_bits = 0;
  for (int tok = blockIdx.x * warps + warp; tok < M; tok += gridDim.x * warps) {
    const uint16_t* ids = idx + size_t(tok) * nnz;
    auto issue = [&](int k) {
      const int s = k % K, n = ids[k];
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 8192;" ::"r"(smem_u32(&bars[s])) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                   ::"r"(smem_u32(ring + s * 8192)), "l"(wu + size_t(n) * 4096), "r"(smem_u32(&bars[s])) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                   ::"r"(smem_u32(ring + s * 8192 + 4096)), "l"(wd + size_t(n) * 4096), "r"(smem_u32(&bars[s])) : "memory");
    };
    if (lane == 0) for (int k = 0; k < K && k < nnz; ++k) issue(k);
    for (int k = 0; k < nnz; ++k) {
      const int s = k % K;
      const uint32_t parity = (phase_bits >> s) & 1;
      uint32_t done = 0;
      while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0,1,0,p;\n}"
                     : "=r"(done) : "r"(smem_u32(&bars[s])), "r"(parity) : "memory");
      phase_bits ^= 1u << s;
      const uint4* v = reinterpret_cast<const uint4*>(ring + s * 8192);
#pragma unroll
      for (int c = 0; c < 16; ++c) { uint4 w = v[32 * c + lane]; acc ^= w.x ^ w.w; }
      __syncwarp();
      if (lane == 0 && k + K < nnz) issue(k + K);
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <typename F>
float time_ms(F f, int reps = 5) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  f();
  CK(cudaDeviceSynchronize());
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); if (ms < best) best = ms;
  }
  CK(cudaGetLastError());
  return best;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int M = 65536;
  uint8_t *wu, *wd, *big; uint16_t* idx; uint32_t* sink;
  CK(cudaMalloc(&wu, size_t(H) * D * 2)); CK(cudaMalloc(&wd, size_t(H) * D * 2));
  CK(cudaMemset(wu, 1, size_t(H) * D * 2)); CK(cudaMemset(wd, 2, size_t(H) * D * 2));
  CK(cudaMalloc(&sink, M * 4));
  const size_t big_bytes = size_t(1) << 30;
  CK(cudaMalloc(&big, big_bytes)); CK(cudaMemset(big, 3, big_bytes));
  printf("probe,config,GB_per_s\n");
  // L2-resident stream: 40 MB read 20 times.
  const size_t l2n = (size_t(40) << 20) / 16;
  float ms = time_ms([&] { stream_kernel<<<sms * 4, 512>>>(reinterpret_cast<uint4*>(big), l2n, 20, sink); });
  printf("stream,L2 40MB x20,%.0f\n", 40.0 * 20 * 1.048576e6 / (ms * 1e6));
  ms = time_ms([&] { stream_kernel<<<sms * 4, 512>>>(reinterpret_cast<uint4*>(big), big_bytes / 16, 1, sink); });
  printf("dram,1GB,%.0f\n", big_bytes / (ms * 1e6));
  for (int nnz : {29}) {
    uint16_t* h = (uint16_t*)malloc(size_t(M) * nnz * 2);
    srand(1);
    for (size_t i = 0; i < size_t(M) * nnz; ++i) h[i] = uint16_t(rand() % H);
    CK(cudaMalloc(&idx, size_t(M) * nnz * 2)); CK(cudaMemcpy(idx, h, size_t(M) * nnz * 2, cudaMemcpyHostToDevice));
    const double bytes = double(M) * nnz * 8192;
    for (int wpb : {8}) {
      ms = time_ms([&] { ldg_kernel<<<(M + wpb - 1) / wpb, 32 * wpb>>>((uint4*)wu, (uint4*)wd, idx, M, nnz, sink); });
      printf("ldg,nnz%d two 23MB tables warps/block %d,%.0f (%.3f ms)\n", nnz, wpb, bytes / (ms * 1e6), ms);
    }
    for (int rows : {5632, 11264}) for (size_t pad : {0, 128, 256, 512, 1024}) {
      const size_t stride = 4096 + pad;
      ms = time_ms([&] { ldg_stride_kernel<<<M / 8, 256>>>(big, rows, stride, idx, M, nnz, sink); });
      printf("stride,nnz%d table %.1fMB pad %zu,%.0f (%.3f ms)\n", nnz, rows * stride / 1048576.0, pad,
             bytes / (ms * 1e6), ms);
    }
    for (int rows : {5632}) {
      for (int hint = 0; hint < 2; ++hint) for (int pollute = 0; pollute < 2; ++pollute) {
        const uint4* xs = pollute ? reinterpret_cast<const uint4*>(big + (size_t(512) << 20)) : nullptr;
        ms = time_ms([&] {
          if (hint) ldg1_kernel<true><<<M / 8, 256>>>((uint4*)wu, rows, idx, M, nnz, xs, sink);
          else ldg1_kernel<false><<<M / 8, 256>>>((uint4*)wu, rows, idx, M, nnz, xs, sink);
        });
        printf("ldg1,nnz%d table %.1fMB hint %d stream-x %d,%.0f (%.3f ms)\n", nnz, rows * 4096 / 1048576.0, hint,
               pollute, bytes / (ms * 1e6), ms);
      }
    }
    {
      constexpr int K = 3; const int warps = 8;
      const int sm = warps * K * 8192 + warps * K * 8;
      CK(cudaFuncSetAttribute(bulk_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
      ms = time_ms([&] { bulk_kernel<K><<<sms, 32 * warps, sm>>>(wu, wd, idx, M, nnz, sink); });
      printf("bulk,nnz%d K3 8warps 1blk/SM,%.0f (%.3f ms)\n", nnz, bytes / (ms * 1e6), ms);
    }
    {
      constexpr int K = 2; const int warps = 6;
      const int sm = warps * K * 8192 + warps * K * 8;
      CK(cudaFuncSetAttribute(bulk_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
      ms = time_ms([&] { bulk_kernel<K><<<sms * 2, 32 * warps, sm>>>(wu, wd, idx, M, nnz, sink); });
      printf("bulk,nnz%d K2 6warps 2blk/SM,%.0f (%.3f ms)\n", nnz, bytes / (ms * 1e6), ms);
    }
    CK(cudaFree(idx)); free(h);
  }
  return 0;
}
