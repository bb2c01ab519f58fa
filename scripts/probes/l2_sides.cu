// Hardware probe (not part of the extension): does the H100's L2 keep a line once per side (partition)
// for the SMs of that side, so that weights gathered by every SM take twice their size in L2?
// If so, a fused kernel whose SMs on each side gather only half of the neurons would see a 23 MB
// working set per side instead of 46 MB (docs/kernels.md §12, "Faster gathers").
//
// 1. Side map: SM 0 reads one set of 128-byte lines per SM (they land in L2); then every SM times a
//    dependent chain through its own set. SMs on SM 0's side should find the lines near, the others far.
// 2. Gather rate of random 4 KB rows (16-byte ld.global.cg, L1 bypassed; 8 warps per block, 2 blocks
//    per SM) from two 23 MB tables, picked by SM:
//      all        every SM from both tables (46 MB, what the fused kernel does)
//      side       SMs of side 0 from table 0, side 1 from table 1 (side from step 1)
//      one        every SM from table 0 (23 MB in all)
//      parity     control split: even SM ids table 0, odd table 1
//      half-ids   control split: SM id < nsm/2 table 0, else table 1
//    If L2 keeps lines per side, "side" should run like "one" and faster than "all", and the controls
//    like "all" (unless they happen to match the sides).
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o l2_sides l2_sides.cu ; run: ./l2_sides OUT.csv
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

constexpr int LINE_WORDS = 32;     // 128-byte line of uint32
constexpr int SET_LINES = 256;     // lines per SM's set (32 KB)
constexpr int ROW_U4 = 256;        // 4 KB row = 256 x 16 bytes
constexpr int TABLE_ROWS = 5632;   // 23 MB per table (H x D bf16)

__device__ __forceinline__ unsigned smid() { unsigned r; asm volatile("mov.u32 %0, %%smid;" : "=r"(r)); return r; }
__device__ __forceinline__ unsigned ld_cg(const unsigned* p) { unsigned v; asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p)); return v; }
__device__ __forceinline__ uint4 ld_cg4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// chain[set][line * LINE_WORDS] = index (within the set) of the next line: a random cycle per set.
__global__ void side_latency(const unsigned* __restrict__ chain, int nsets, int* flag, float* lat, unsigned* sink) {
  if (threadIdx.x != 0) return;
  const unsigned s = smid();
  if (s == 0) {
    unsigned acc = 0;
    for (int i = 0; i < nsets * SET_LINES; ++i) acc += ld_cg(chain + size_t(i) * LINE_WORDS);
    sink[0] = acc;
    __threadfence();
    atomicExch(flag, 1);
  } else {
    for (long spin = 0; atomicAdd(flag, 0) == 0; ++spin) {
      if (spin > 20000000) { lat[s] = -1.f; return; }  // SM 0 never came: no hang
      __nanosleep(200);
    }
  }
  if (s >= unsigned(nsets)) return;
  const unsigned* set = chain + size_t(s) * SET_LINES * LINE_WORDS;
  unsigned j = 0;
  long long t0 = clock64();
  for (int k = 0; k < SET_LINES; ++k) j = ld_cg(set + size_t(j) * LINE_WORDS);  // first touch from this SM
  long long t1 = clock64();
  lat[s] = float(t1 - t0) / SET_LINES;
  sink[1 + s] = j;
}

__device__ __forceinline__ unsigned hash32(unsigned x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16; return x;
}

// mode: 0 all, 1 side, 2 one, 3 parity, 4 half-ids
__global__ void gather(const uint4* __restrict__ tables, const unsigned char* __restrict__ side, int nsm, int mode,
                       int iters, unsigned seed, unsigned* sink) {
  const int lane = threadIdx.x % 32;
  const unsigned warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const unsigned s = smid();
  int table;  // -1: either
  switch (mode) {
    case 1: table = side[s]; break;
    case 2: table = 0; break;
    case 3: table = s & 1; break;
    case 4: table = s >= unsigned(nsm / 2); break;
    default: table = -1;
  }
  uint32_t acc = 0;
  for (int i = 0; i < iters; ++i) {
    const unsigned h = hash32(seed ^ (warp * 0x9e3779b9U) ^ (i * 0x85ebca6bU));
    const unsigned row = (table < 0 ? h % (2 * TABLE_ROWS) : table * TABLE_ROWS + h % TABLE_ROWS);
    const uint4* p = tables + size_t(row) * ROW_U4;
    uint4 v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = ld_cg4(p + 32 * c + lane);
#pragma unroll
    for (int c = 0; c < 8; ++c) acc ^= v[c].x ^ v[c].y ^ v[c].z ^ v[c].w;
  }
  if (acc == 0x12345678u) sink[warp] = acc;
}

__global__ void flush(uint4* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(unsigned(i), 0, 0, 0);
}

int main(int argc, char** argv) {
  const char* csv = argc > 1 ? argv[1] : "l2_sides.csv";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int nsm = prop.multiProcessorCount;
  printf("%s: %d SMs, L2 %d MB\n", prop.name, nsm, prop.l2CacheSize >> 20);

  // ---- 1. side map
  std::vector<unsigned> h_chain(size_t(nsm) * SET_LINES * LINE_WORDS, 0);
  srand(1);
  for (int s = 0; s < nsm; ++s) {
    std::vector<int> perm(SET_LINES);
    for (int i = 0; i < SET_LINES; ++i) perm[i] = i;
    for (int i = SET_LINES - 1; i > 0; --i) std::swap(perm[i], perm[rand() % (i + 1)]);
    for (int i = 0; i < SET_LINES; ++i)  // a single cycle through the set in perm order
      h_chain[(size_t(s) * SET_LINES + perm[i]) * LINE_WORDS] = perm[(i + 1) % SET_LINES];
  }
  unsigned *d_chain, *d_sink;
  int* d_flag;
  float* d_lat;
  CK(cudaMalloc(&d_chain, h_chain.size() * 4));
  CK(cudaMemcpy(d_chain, h_chain.data(), h_chain.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_sink, (1 << 20) * 4));
  CK(cudaMalloc(&d_flag, 4));
  CK(cudaMalloc(&d_lat, nsm * 4));
  const size_t flush_n = size_t(2) * prop.l2CacheSize * 2 / 16;  // 4x L2 in uint4
  uint4* d_flush;
  CK(cudaMalloc(&d_flush, flush_n * 16));
  const int big_smem = 200 * 1024;  // one block per SM
  CK(cudaFuncSetAttribute(side_latency, cudaFuncAttributeMaxDynamicSharedMemorySize, big_smem));
  std::vector<float> lat_sum(nsm, 0.f);
  const int rounds = 5;
  for (int r = 0; r < rounds; ++r) {
    flush<<<4 * nsm, 512>>>(d_flush, flush_n);
    CK(cudaMemset(d_flag, 0, 4));
    side_latency<<<nsm, 32, big_smem>>>(d_chain, nsm, d_flag, d_lat, d_sink);
    CK(cudaGetLastError());
    std::vector<float> lat(nsm);
    CK(cudaMemcpy(lat.data(), d_lat, nsm * 4, cudaMemcpyDeviceToHost));
    for (int s = 0; s < nsm; ++s) lat_sum[s] += lat[s] / rounds;
  }
  // Two groups: split at the largest gap of the sorted latencies.
  std::vector<float> sorted(lat_sum.begin(), lat_sum.end());
  std::sort(sorted.begin(), sorted.end());
  int gap_at = 1;
  for (int i = 1; i < nsm; ++i) if (sorted[i] - sorted[i - 1] > sorted[gap_at] - sorted[gap_at - 1]) gap_at = i;
  const float cut = 0.5f * (sorted[gap_at] + sorted[gap_at - 1]);
  std::vector<unsigned char> h_side(nsm);
  int near = 0;
  float near_mean = 0, far_mean = 0;
  for (int s = 0; s < nsm; ++s) {
    h_side[s] = lat_sum[s] > cut;
    if (!h_side[s]) { ++near; near_mean += lat_sum[s]; } else far_mean += lat_sum[s];
  }
  near_mean /= std::max(near, 1);
  far_mean /= std::max(nsm - near, 1);
  printf("first-touch latency of lines SM 0 brought in: %d SMs near (mean %.0f cycles), %d far (mean %.0f); "
         "largest gap %.0f cycles at %.0f; min %.0f max %.0f\n", near, near_mean, nsm - near, far_mean,
         sorted[gap_at] - sorted[gap_at - 1], cut, sorted[0], sorted[nsm - 1]);
  printf("side by SM id:");
  for (int s = 0; s < nsm; ++s) printf("%s%d", s % 33 == 0 ? "\n  " : "", h_side[s]);
  printf("\nlatency by SM id:");
  for (int s = 0; s < nsm; ++s) printf("%s%4.0f", s % 22 == 0 ? "\n  " : " ", lat_sum[s]);
  printf("\n");

  // ---- 2. gather rates
  unsigned char* d_side;
  CK(cudaMalloc(&d_side, nsm));
  CK(cudaMemcpy(d_side, h_side.data(), nsm, cudaMemcpyHostToDevice));
  uint4* d_tab;
  const size_t tab_u4 = size_t(2) * TABLE_ROWS * ROW_U4;
  CK(cudaMalloc(&d_tab, tab_u4 * 16));
  flush<<<4 * nsm, 512>>>(d_tab, tab_u4);
  const int warps_per_block = 8, blocks = 2 * nsm, iters = 256;
  const double bytes = double(blocks) * warps_per_block * iters * 4096.0;
  const char* names[] = {"all", "side", "one", "parity", "half-ids"};
  FILE* f = fopen(csv, "w");
  fprintf(f, "mode,round,ms,TB_per_s\n");
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<std::vector<float>> ms(5);
  for (int round = 0; round < 7; ++round) {
    for (int mode = 0; mode < 5; ++mode) {
      flush<<<4 * nsm, 512>>>(d_flush, flush_n);
      // warm: one pass so the tables' lines sit in L2 the way the mode reads them
      gather<<<blocks, 32 * warps_per_block>>>(d_tab, d_side, nsm, mode, iters, 1234u + round, d_sink);
      CK(cudaEventRecord(e0));
      gather<<<blocks, 32 * warps_per_block>>>(d_tab, d_side, nsm, mode, iters, 777u + round, d_sink);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (round > 0) ms[mode].push_back(t);  // round 0: warm-up
      fprintf(f, "%s,%d,%.4f,%.3f\n", names[mode], round, t, bytes / (t * 1e-3) / 1e12);
    }
  }
  fclose(f);
  printf("gather of random 4 KB rows (%.2f GB per call), median of %zu rounds:\n", bytes / 1e9, ms[0].size());
  for (int mode = 0; mode < 5; ++mode) {
    std::sort(ms[mode].begin(), ms[mode].end());
    const float med = ms[mode][ms[mode].size() / 2];
    printf("  %-9s %.3f ms  %.2f TB/s\n", names[mode], med, bytes / (med * 1e-3) / 1e12);
  }
  return 0;
}
