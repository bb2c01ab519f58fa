// Hardware probe (not part of the extension): how fast do 128-byte pieces of random weight rows
// move from L2 into shared memory? The block-union path's first build (csrc/twell_union.cu;
// docs/kernels.md §7 and §12) gathers, per pipeline stage, one 128-byte K-slice of each of 512 union
// rows; with 16-byte cp.async it moved only ~3.4 TB/s. A bulk copy per 128-byte slice issues 8x fewer
// instructions. Here a CTA streams "passes" of 512 random rows of a 23 MB table (like the up kernel's
// W_up[U] over D = 2048 in 32 stages of 64 KB) through a ring of STAGES buffers; the consumers only
// wait and release, so the rate is the transfer rate. Two tables as in the real kernels (up and down
// rows alternate passes).
//   cpasync16   128 producer threads, 16-byte cp.async (the first union build's producer)
//   bulk128-W   W producer warps, each lane issues its share of the 512 128-byte bulk copies
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o bulk128 bulk128.cu
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

// A device copy of a host vector.
template <class T>
T* to_device(const std::vector<T>& h) {
  void* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(d);
}

constexpr int ROWS_PER_STAGE = 512;  // default stage: 512 rows x 128 bytes = 64 KB
constexpr int SEG = 128;
constexpr int STAGES = 3;
constexpr int KSTEPS = 2048 / 64;                   // 32 slices of 128 bytes per 4 KB row
constexpr int NROWS = 5632;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0,1,0,p;\n}"
                 : "=r"(done) : "r"(smem_u32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_arrive(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(b)) : "memory");
}

// MODE 0: cp.async16 by 128 threads; MODE W > 0: bulk copies by W warps. RPS rows of 128 bytes per
// stage, NST stages. HOLD > 0: the consumers keep each stage HOLD clocks (standing in for its MMAs)
// and release it only once the next stage has arrived, as a wgmma_wait<1> pipeline does.
template <int MODE, int RPS = ROWS_PER_STAGE, int NST = STAGES, int HOLD = 0>
__global__ void __launch_bounds__(256, 1) gather(const uint8_t* __restrict__ tab0, const uint8_t* __restrict__ tab1,
                                                 const uint16_t* __restrict__ rows, int passes, uint32_t* sink) {
  constexpr int STAGE_BYTES = RPS * SEG, STAGES = NST, ROWS_PER_STAGE = RPS;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  constexpr int PRODUCERS = MODE == 0 ? 128 : 32 * MODE;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], PRODUCERS);
      mbar_init(&empty[s], 4);  // the 4 consumer warps
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int t = threadIdx.x;
  uint32_t acc = 0;
  if (t < PRODUCERS) {
    int stage = 0;
    uint32_t phase = 1;
    for (int ps = blockIdx.x; ps < passes; ps += gridDim.x) {
      const uint8_t* tab = (ps & 1) ? tab1 : tab0;
      const uint16_t* r = rows + size_t(ps) * RPS;
      for (int kb = 0; kb < KSTEPS; ++kb) {
        mbar_wait(&empty[stage], phase);
        const uint32_t base = smem_u32(smem + stage * STAGE_BYTES);
        if constexpr (MODE == 0) {
          const int ch = t % 8;
#pragma unroll 4
          for (int m = 0; m < RPS / 16; ++m) {
            const int j = t / 8 + 16 * m;
            cp16(base + j * SEG + ((ch ^ (j & 7)) << 4), tab + size_t(r[j]) * 4096 + kb * SEG + ch * 16);
          }
          cp_arrive(&full[stage]);
        } else {
          if (t % 32 == 0 && t / 32 == 0) expect_tx(&full[stage], STAGE_BYTES);
          else mbar_arrive(&full[stage]);
          for (int j = t; j < ROWS_PER_STAGE; j += PRODUCERS)
            bulk(base + j * SEG, tab + size_t(r[j]) * 4096 + kb * SEG, SEG, &full[stage]);
        }
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
    }
  } else if (t >= 128) {
    const int w = (t - 128) / 32, lane = t % 32;
    int stage = 0, prev = -1;
    uint32_t phase = 0;
    for (int ps = blockIdx.x; ps < passes; ps += gridDim.x) {
      for (int kb = 0; kb < KSTEPS; ++kb) {
        mbar_wait(&full[stage], phase);
        acc ^= reinterpret_cast<const uint32_t*>(smem + stage * STAGE_BYTES)[w * 32 + lane];
        if constexpr (HOLD > 0) {
          const long long t0 = clock64();
          while (clock64() - t0 < HOLD) {}
          __syncwarp();
          if (lane == 0 && prev >= 0) mbar_arrive(&empty[prev]);
          prev = stage;
        } else {
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[stage]);
        }
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
    }
    if (HOLD > 0 && lane == 0 && prev >= 0) mbar_arrive(&empty[prev]);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int MODE, int RPS = ROWS_PER_STAGE, int NST = STAGES, int HOLD = 0>
void run(const char* name, const uint8_t* t0, const uint8_t* t1, const uint16_t* rows, int passes, uint32_t* sink,
         int sms) {
  const int smem = NST * RPS * SEG + 2 * NST * 8 + 64;
  auto kern = gather<MODE, RPS, NST, HOLD>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  passes = passes * (ROWS_PER_STAGE / RPS);  // same bytes for every stage size
  auto f = [&] { kern<<<sms, 256, smem>>>(t0, t1, rows, passes, sink); };
  const float ms = median_ms(f);
  const double bytes = double(passes) * RPS * 4096;
  printf("%s,%d,%d,%d,%d,%.3f,%.0f\n", name, RPS * SEG / 1024, NST, HOLD, passes, ms, bytes / (ms * 1e6));
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int passes = 4096;  // 8.6 GB
  uint8_t *t0, *t1;
  uint32_t* sink;
  CK(cudaMalloc(&t0, size_t(NROWS) * 4096));
  CK(cudaMalloc(&t1, size_t(NROWS) * 4096));
  CK(cudaMemset(t0, 1, size_t(NROWS) * 4096));
  CK(cudaMemset(t1, 2, size_t(NROWS) * 4096));
  CK(cudaMalloc(&sink, 4));
  std::vector<uint16_t> h(size_t(passes) * ROWS_PER_STAGE);  // enough for every stage size
  srand(1);
  for (auto& v : h) v = uint16_t(rand() % NROWS);
  const uint16_t* rows = to_device(h);
  printf("mode,stage_kb,stages,hold_clk,passes,ms,GB_per_s\n");
  run<0>("cpasync16", t0, t1, rows, passes, sink, sms);
  // Consumers that hold stages as a wgmma pipeline does (HOLD ~ the MMA time of the stage: 64 x 512
  // x 64 MACs at H100's 2048 bf16 MAC/clk/SM = 1024 clocks per 64 KB of weights; 2048: twice that).
  run<0, 512, 3, 2048>("cpasync16-hold", t0, t1, rows, passes, sink, sms);
  run<0, 512, 3, 1024>("cpasync16-hold", t0, t1, rows, passes, sink, sms);
  run<0, 256, 6, 1024>("cpasync16-hold", t0, t1, rows, passes, sink, sms);
  run<0, 256, 6, 512>("cpasync16-hold", t0, t1, rows, passes, sink, sms);
  run<0, 128, 12, 512>("cpasync16-hold", t0, t1, rows, passes, sink, sms);
  run<0, 128, 12, 256>("cpasync16-hold", t0, t1, rows, passes, sink, sms);
  run<0, 256, 6, 0>("cpasync16", t0, t1, rows, passes, sink, sms);
  run<0, 128, 12, 0>("cpasync16", t0, t1, rows, passes, sink, sms);
  run<1>("bulk128-1warp", t0, t1, rows, passes, sink, sms);
  run<2>("bulk128-2warps", t0, t1, rows, passes, sink, sms);
  run<4>("bulk128-4warps", t0, t1, rows, passes, sink, sms);
  return 0;
}
