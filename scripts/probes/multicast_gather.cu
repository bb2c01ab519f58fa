// Hardware probe (not part of the extension): does TMA multicast raise the rate at which weight rows
// reach the SMs? The per-row kernel is held at ~7.5 TB/s by random 4 KB row gathers from L2
// (l2_gather.cu). Reuse designs would give a cluster of C CTAs the same rows (the union of their
// tokens' neurons); with `cp.async.bulk ... .multicast::cluster` one L2 read fills all C CTAs.
// If the ceiling is on the L2 side, delivered bytes grow ~C-fold; if it is on the SM / fabric
// side, they do not.
//
// Each CTA: 8 warps, each a ring of K stages of 8 KB (up row + down row of a random neuron, the
// light kernel's stage) or 4 KB (one row: twice the stages in the same shared memory). Warp w of every CTA in a cluster consumes the same item sequence; item k
// is copied by CTA k % C of the cluster into all C CTAs (one L2 read, C deliveries). A stage is
// refilled once every CTA has consumed it (an "empty" mbarrier of count C in each CTA, arrived on
// remotely). C = 1 is the plain per-warp ring of the light kernel.
// Prints: C, clusters, ms, delivered TB/s (bytes landing in shared memory), L2 TB/s (= / C).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o mc multicast_gather.cu
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

constexpr int D = 2048, H = 5632, WARPS = 8, ROW = D * 2;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint32_t cluster_rank() { uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ uint32_t cluster_id_x() { uint32_t r; asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ uint32_t n_clusters_x() { uint32_t r; asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0,1,0,p;\n}"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void arrive_remote(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
template <int C, int BYTES = ROW>
__device__ __forceinline__ void copy_row(void* dst, const void* src, uint64_t* bar) {
  if (C == 1)
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(BYTES), "r"(smem_u32(bar)) : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(BYTES), "r"(smem_u32(bar)), "h"(uint16_t((1u << C) - 1)) : "memory");
}

// tokens: M tokens x nnz neuron ids. Cluster c takes tokens c, c + n_clusters, ...; warp w of the
// cluster's CTAs takes every WARPS-th of those.
template <int C, int K, int ROWS>
__global__ void __launch_bounds__(WARPS * 32, 1) gather(const uint8_t* __restrict__ wu, const uint8_t* __restrict__ wd,
                                                        const uint16_t* __restrict__ ids, int M, int nnz, uint32_t* sink) {
  constexpr int STAGE = (ROWS == 1 ? 1 : 2) * ROW;  // up row (+ down row); ROWS 3: both rows in one 8 KB copy
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = smem + size_t(warp) * K * STAGE;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(WARPS) * K * STAGE) + warp * 2 * K;
  uint64_t* empty = full + K;
  const uint32_t rank = C > 1 ? cluster_rank() : 0;
  const uint32_t cid = C > 1 ? cluster_id_x() : blockIdx.x, ncl = C > 1 ? n_clusters_x() : gridDim.x;
  if (lane == 0)
    for (int s = 0; s < K; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])), "r"(C));
    }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  if (C > 1) cluster_sync();
  // The warp's items: flattened (token, j) over its tokens.
  const long first_tok = long(cid) * WARPS + warp, step = long(ncl) * WARPS;
  const long n_tok = first_tok < M ? (M - 1 - first_tok) / step + 1 : 0;
  const long n_items = n_tok * nnz;
  auto item_neuron = [&](long k) { return int(ids[(first_tok + (k / nnz) * step) * nnz + k % nnz]); };
  auto issue = [&](long k) {  // by the CTA whose turn it is, into every CTA of the cluster
    const int s = int(k % K);
    if (k >= K) wait_parity(&empty[s], uint32_t((k / K - 1) & 1));
    const int n = item_neuron(k);
    if (ROWS == 3) {
      copy_row<C, 2 * ROW>(ring + s * STAGE, wu + size_t(n) * 2 * ROW, &full[s]);
    } else {
      copy_row<C>(ring + s * STAGE, wu + size_t(n) * ROW, &full[s]);
      if (ROWS == 2) copy_row<C>(ring + s * STAGE + ROW, wd + size_t(n) * ROW, &full[s]);
    }
  };
  if (lane == 0) {
    for (long k = 0; k < K && k < n_items; ++k) expect_tx(&full[k], STAGE);
    if (C > 1) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if (C > 1) cluster_sync();  // every CTA expects its first stages before any copy lands
  if (lane == 0)
    for (long k = 0; k < K && k < n_items; ++k)
      if (k % C == rank) issue(k);
  uint32_t acc = 0;
  for (long k = 0; k < n_items; ++k) {
    const int s = int(k % K);
    wait_parity(&full[s], uint32_t((k / K) & 1));
    const uint4* v = reinterpret_cast<const uint4*>(ring + s * STAGE);
#pragma unroll
    for (int c = 0; c < STAGE / 512; ++c) { const uint4 w = v[32 * c + lane]; acc ^= w.x ^ w.w; }
    __syncwarp();
    if (lane == 0) {
      if (k + K < n_items) expect_tx(&full[s], STAGE);
      if (C == 1) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[s])) : "memory");
      else for (int r = 0; r < C; ++r) arrive_remote(&empty[s], r);  // this CTA is done with stage s
      if (k + K < n_items && (k + K) % C == rank) issue(k + K);
    }
  }
  if (C > 1) cluster_sync();  // no CTA leaves while others may still arrive on its barriers
  if (acc == 0x12345678u) sink[0] = acc;
}

// Launches kern 6 times with clusters of C CTAs, as many clusters as fit at once; returns the best of
// the last 5 times (ms) and sets *n_clusters.
template <class... KArgs, class... Args>
float time_clusters(void (*kern)(KArgs...), int C, int smem, int* n_clusters, Args... args) {
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (C > 1) CK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = attr; cfg.numAttrs = 1;
  int ncl = 0;
  cfg.gridDim = dim3(1024 * C);
  CK(cudaOccupancyMaxActiveClusters(&ncl, kern, &cfg));
  cfg.gridDim = dim3(ncl * C);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int r = 0; r < 6; ++r) {
    CK(cudaEventRecord(a));
    CK(cudaLaunchKernelEx(&cfg, kern, args...));
    CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0 && ms < best) best = ms;
  }
  CK(cudaGetLastError());
  *n_clusters = ncl;
  return best;
}

template <int C, int K, int ROWS>
void run(const uint8_t* wu, const uint8_t* wd, const uint16_t* ids, int M, int nnz, uint32_t* sink, const char* label) {
  auto kern = gather<C, K, ROWS>;
  constexpr int STAGE = (ROWS == 1 ? 1 : 2) * ROW;
  const int smem = WARPS * K * STAGE + WARPS * 2 * K * 8;
  int ncl = 0;
  const float best = time_clusters(kern, C, smem, &ncl, wu, wd, ids, M, nnz, sink);
  // Every cluster delivers all its items to each of its C CTAs.
  const double l2 = double(M) * nnz * STAGE;
  printf("%s,C=%d,K=%d,item %d KB,clusters=%d,SMs=%d,%.3f ms,delivered %.2f TB/s,L2 %.2f TB/s\n", label, C, K, STAGE / 1024, ncl, ncl * C, best,
         l2 * C / (best * 1e9), l2 / (best * 1e9));
}

// Variant with the synchronisation amortised: one ring per CTA of 2 stages of R rows of 4 KB (one
// table), filled by one thread, read by all 8 warps; one remote arrive per CTA and issuer per stage
// (instead of one per 4-8 KB item). Stage j is copied by CTA j % C into every CTA of the cluster.
template <int C, int R>
__global__ void __launch_bounds__(WARPS * 32, 1) gather_big(const uint8_t* __restrict__ wu, const uint16_t* __restrict__ ids,
                                                            long n_rows_total, uint32_t* sink) {
  constexpr int STAGE = R * ROW, S = 2;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + size_t(S) * STAGE);
  uint64_t* empty = full + S;     // count C: one arrive per CTA of the cluster
  uint64_t* consumed = empty + S; // count WARPS: this CTA's warps are done with the stage
  const uint32_t rank = C > 1 ? cluster_rank() : 0;
  const uint32_t cid = C > 1 ? cluster_id_x() : blockIdx.x, ncl = C > 1 ? n_clusters_x() : gridDim.x;
  if (threadIdx.x == 0)
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])), "r"(C));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&consumed[s])), "r"(WARPS));
    }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  // The cluster's stages: rows [j * R, (j + 1) * R) of its share of the id list.
  const long per_cluster = n_rows_total / ncl / R;  // whole stages only
  const uint16_t* my_ids = ids + long(cid) * per_cluster * R;
  auto issue = [&](long j) {
    const int s = int(j % S);
    if (j >= S) wait_parity(&empty[s], uint32_t((j / S - 1) & 1));
    for (int r = 0; r < R; ++r) copy_row<C>(smem + size_t(s) * STAGE + size_t(r) * ROW, wu + size_t(my_ids[j * R + r]) * ROW, &full[s]);
  };
  if (threadIdx.x == 0) for (long j = 0; j < S && j < per_cluster; ++j) expect_tx(&full[j], STAGE);
  if (C > 1) cluster_sync(); else __syncthreads();
  if (threadIdx.x == 0) for (long j = 0; j < S && j < per_cluster; ++j) if (j % C == rank) issue(j);
  uint32_t acc = 0;
  for (long j = 0; j < per_cluster; ++j) {
    const int s = int(j % S);
    wait_parity(&full[s], uint32_t((j / S) & 1));
    const uint4* v = reinterpret_cast<const uint4*>(smem + size_t(s) * STAGE);
    for (int c = warp; c < STAGE / 512; c += WARPS) { const uint4 w = v[32 * c + lane]; acc ^= w.x ^ w.w; }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&consumed[s])) : "memory");
    if (threadIdx.x == 0) {
      wait_parity(&consumed[s], uint32_t((j / S) & 1));
      if (j + S < per_cluster) expect_tx(&full[s], STAGE);
      if (C == 1) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[s])) : "memory");
      else for (int r = 0; r < C; ++r) arrive_remote(&empty[s], r);
      if (j + S < per_cluster && (j + S) % C == rank) issue(j + S);
    }
  }
  if (C > 1) cluster_sync();
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int C, int R>
void run_big(const uint8_t* wu, const uint16_t* ids, long n_rows, uint32_t* sink) {
  auto kern = gather_big<C, R>;
  const int smem = 2 * R * ROW + 6 * 8;
  int ncl = 0;
  const float best = time_clusters(kern, C, smem, &ncl, wu, ids, n_rows, sink);
  const double l2 = double(n_rows / ncl / R) * R * ncl * ROW;
  printf("stages of %d rows,C=%d,K=2,item %d KB,%d,%d,%.3f ms,delivered %.2f TB/s,L2 %.2f TB/s\n", R, C, R * 4, ncl,
         ncl * C, best, l2 * C / (best * 1e9), l2 / (best * 1e9));
}

int main() {
  // M tokens per cluster-set; the cluster's CTAs all see the same tokens, so L2 bytes = M * nnz * 8 KB.
  const int M = 65536, nnz = 29;
  uint8_t *wu, *wd; uint16_t* ids; uint32_t* sink;
  CK(cudaMalloc(&wu, size_t(H) * ROW)); CK(cudaMalloc(&wd, size_t(H) * ROW));
  CK(cudaMemset(wu, 1, size_t(H) * ROW)); CK(cudaMemset(wd, 2, size_t(H) * ROW));
  CK(cudaMalloc(&sink, 4));
  uint16_t* h = (uint16_t*)malloc(size_t(M) * nnz * 2);
  srand(1);
  for (size_t i = 0; i < size_t(M) * nnz; ++i) h[i] = uint16_t(rand() % H);
  CK(cudaMalloc(&ids, size_t(M) * nnz * 2));
  CK(cudaMemcpy(ids, h, size_t(M) * nnz * 2, cudaMemcpyHostToDevice));
  printf("probe,C,K,item,clusters,SMs,ms,delivered,L2\n");
  run<1, 3, 2>(wu, wd, ids, M, nnz, sink, "random rows");
  run<2, 3, 2>(wu, wd, ids, M, nnz, sink, "random rows");
  run<4, 3, 2>(wu, wd, ids, M, nnz, sink, "random rows");
  run<1, 6, 1>(wu, wd, ids, M, nnz, sink, "random rows");
  run<2, 6, 1>(wu, wd, ids, M, nnz, sink, "random rows");
  run<4, 6, 1>(wu, wd, ids, M, nnz, sink, "random rows");
  run<2, 3, 1>(wu, wd, ids, M, nnz, sink, "random rows");
  run<1, 3, 2>(wu, wd, ids, M, nnz, sink, "random rows (again)");
  // One 46 MB table of 8 KB rows (w_up[n] and w_down_t[n] adjacent): one copy per pair.
  uint8_t* wi;
  CK(cudaMalloc(&wi, size_t(H) * 2 * ROW)); CK(cudaMemset(wi, 3, size_t(H) * 2 * ROW));
  run<1, 3, 3>(wi, wd, ids, M, nnz, sink, "interleaved table");
  run<1, 3, 2>(wu, wd, ids, M, nnz, sink, "two tables");
  run<1, 3, 3>(wi, wd, ids, M, nnz, sink, "interleaved table");
  run<1, 3, 2>(wu, wd, ids, M, nnz, sink, "two tables");
  const long n_rows = long(M) * nnz / 4;  // ~118 MB of 4 KB rows
  run_big<1, 24>(wu, ids, n_rows, sink);
  run_big<2, 24>(wu, ids, n_rows, sink);
  run_big<4, 24>(wu, ids, n_rows, sink);
  run_big<1, 12>(wu, ids, n_rows, sink);
  run_big<2, 12>(wu, ids, n_rows, sink);
  run_big<4, 12>(wu, ids, n_rows, sink);
  return 0;
}
