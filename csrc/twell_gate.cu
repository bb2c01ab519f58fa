// Gate GEMM that writes TwELL from its epilogue: packed = TwELL(relu(x @ w_gate^T)).
//
// Hopper (sm_90a) persistent kernel, 384 threads:
//   warpgroup 0     producer: one thread issues TMA loads of x and w_gate tiles into a ring of
//                   STAGES shared-memory buffers (128B swizzle), completing on mbarriers;
//   warpgroups 1,2  consumers: each multiplies 64 rows x 256 columns with wgmma m64n256k16,
//                   accumulating in 128 fp32 registers per thread.
// The GEMM tile (128 x 256) has the TwELL tile's width (or a multiple of it), so every TwELL
// tile row lives in the registers of 4 neighbouring lanes: the epilogue applies ReLU, rounds to
// bf16, counts the nonzeros with a 4-lane scan and stores count + (value, column) words
// directly. No dense activation is ever written. A tile row with more nonzeros than slots moves
// its entries to a spill area (count word = 0x80000000 | offset), so consumers still read exactly
// its nonzeros; if the spill area is full the count word keeps the true count and consumers
// recompute that tile exactly from x and the weights.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "common.cuh"
#include "twell_kernels.h"
#include "wgmma_m64n256.cuh"

namespace twell {
namespace gate {

constexpr int BM = 128;                 // rows (tokens) per tile
constexpr int BN = 256;                 // columns (neurons) per tile
constexpr int BK = 64;                  // 64 bf16 = 128 bytes = one swizzle row
constexpr int STAGES = 4;
constexpr int A_BYTES = BM * BK * 2;    // 16 KB
constexpr int B_BYTES = BN * BK * 2;    // 32 KB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024 /*align*/ + 2 * STAGES * 8 /*barriers*/;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  }
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c_inner, int c_outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c_inner), "r"(c_outer)
      : "memory");
}

// TMA load of a box into the same shared-memory offset of every CTA in `mask`, completing on the
// mbarrier at the same offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c_inner,
                                                      int c_outer, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c_inner), "r"(c_outer),
      "h"(mask)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// Shared-memory matrix descriptor: K-major tile, 128-byte swizzle, 8-row core groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  uint64_t d = 0;
  d |= uint64_t((smem_u32(p) & 0x3FFFF) >> 4);
  d |= uint64_t(1) << 16;              // leading byte offset (unused with 128B swizzle)
  d |= uint64_t(1024 >> 4) << 32;      // stride byte offset
  d |= uint64_t(1) << 62;              // swizzle mode: 128 bytes
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Where an overflowing tile row goes: a spill area of uint32 words (count, then entries), claimed
// with one atomicAdd per tile row. When the area is full the count word keeps the true count and
// consumers recompute that tile from x and the weights (slow but exact).
struct Spill {
  uint32_t* words;
  uint32_t* used;  // zeroed before the launch
  uint32_t cap;
};

// Store one TwELL tile row held by the 4 lanes of a quad (q = lane % 4). Columns of this lane:
// tile column 8*i + 2*q + e for i in [I0, I0 + T/8), e in {0, 1}; acc[4*i + 2*hf + e] is the fp32
// accumulator. Entries are written lane-major (lane q's entries, then lane q+1's).
template <int T, int I0>
__device__ __forceinline__ void store_twell_tile_row(const float (&acc)[128], int hf, uint32_t* row_out, bool row_ok,
                                                     int q, int S, uint32_t col0, const Spill& spill) {
  constexpr int NI = T / 8;
  uint64_t mask = 0;  // one bit per value of this lane: ReLU + bf16 rounding decide activity (NaN is active)
#pragma unroll
  for (int i = 0; i < NI; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool on = __bfloat16_as_ushort(relu_bf16(acc[4 * (I0 + i) + 2 * hf + e])) != 0;
      mask |= uint64_t(on) << (2 * i + e);
    }
  }
  const int cnt = __popcll(mask);
  int incl = cnt;  // inclusive scan over the 4 lanes of the quad
  int t = __shfl_up_sync(0xffffffffu, incl, 1, 4);
  if (q >= 1) incl += t;
  t = __shfl_up_sync(0xffffffffu, incl, 2, 4);
  if (q >= 2) incl += t;
  const int total = __shfl_sync(0xffffffffu, incl, 3, 4);
  const bool over = row_ok && total > S - 1;
  uint32_t off = 0;
  if (over && q == 0 && spill.words != nullptr) {
    off = atomicAdd(spill.used, uint32_t(total + 1));
  }
  off = __shfl_sync(0xffffffffu, off, 0, 4);
  if (!row_ok) return;
  const bool spilled = over && spill.words != nullptr && off + uint32_t(total) + 1 <= spill.cap && off < 0x80000000u;
  uint32_t* dst = spilled ? spill.words + off : row_out;  // slot 0 = count in both layouts
  const int limit = spilled ? total + 1 : S;
  if (q == 0) {
    row_out[0] = spilled ? (0x80000000u | off) : uint32_t(total);
    if (spilled) dst[0] = uint32_t(total);
  }
  int slot = 1 + incl - cnt;  // this lane's first entry slot
#pragma unroll
  for (int i = 0; i < NI; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if ((mask >> (2 * i + e)) & 1) {
        if (slot < limit) dst[slot] = pack_entry(relu_bf16(acc[4 * (I0 + i) + 2 * hf + e]), col0 + 8 * i + 2 * q + e);
        ++slot;
      }
    }
  }
}

// CL = CTAs per cluster (1 or 2). With CL = 2 the two CTAs of a cluster work on vertically
// adjacent tiles (same W_gate columns): each loads its own x tile and one half of the W_gate tile,
// multicast to both, so L2 serves each W_gate tile once per pair of tiles (the kernel is bound by
// L2->SM traffic otherwise). A stage is refilled only after the consumers of BOTH CTAs released it.
template <int T, int CL>
__global__ void __launch_bounds__(384, 1)
    gate_twell_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                      uint32_t* __restrict__ out, int M, int H, int D, int S, int n_twell_tiles, Spill spill) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;

  const int wg = threadIdx.x / 128;
  const int n_blocks_n = (H + BN - 1) / BN;
  const int n_blocks_m = (M + BM - 1) / BM;
  const int n_groups = ((n_blocks_m + CL - 1) / CL) * n_blocks_n;  // groups of CL vertically adjacent tiles
  const int k_blocks = D / BK;
  const uint32_t rank = CL > 1 ? cluster_rank() : 0;
  const int group0 = blockIdx.x / CL, group_step = gridDim.x / CL;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * CL);  // one arrival per consumer warp of every CTA that fills it
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CL > 1) cluster_sync(); else __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 1;  // a fresh barrier counts as released once
      for (int g = group0; g < n_groups; g += group_step) {
        const int m0 = ((g / n_blocks_n) * CL + int(rank)) * BM;
        const int n0 = (g % n_blocks_n) * BN;
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&empty[stage], phase);
          uint8_t* a = smem + stage * STAGE_BYTES;
          mbar_expect_tx(&full[stage], STAGE_BYTES);
          tma_load_2d(a, &map_x, &full[stage], kb * BK, m0);
          if constexpr (CL == 1) {
            tma_load_2d(a + A_BYTES, &map_w, &full[stage], kb * BK, n0);
          } else {
            constexpr int HALF = BN / CL;
            tma_load_2d_multicast(a + A_BYTES + rank * HALF * BK * 2, &map_w, &full[stage], kb * BK,
                                  n0 + int(rank) * HALF, uint16_t((1u << CL) - 1));
          }
          if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int ct = threadIdx.x - 128 * wg;  // thread index inside this consumer warpgroup
    const int warp = ct / 32, lane = ct % 32, q = lane % 4;
    const int row_in_tile = 64 * (wg - 1) + 16 * warp + lane / 4;
    int stage = 0;
    uint32_t phase = 0;
    float acc[128];
    auto release = [&](int st) {
      if (lane == 0) {
        if constexpr (CL == 1) {
          mbar_arrive(&empty[st]);
        } else {
          mbar_arrive(&empty[st]);  // own CTA: plain local arrive
#pragma unroll
          for (int r = 1; r < CL; ++r) mbar_arrive_cluster(&empty[st], (rank + uint32_t(r)) % CL);
        }
      }
    };
    for (int g = group0; g < n_groups; g += group_step) {
      const int m0 = ((g / n_blocks_n) * CL + int(rank)) * BM;
      const int nb = g % n_blocks_n;
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      int prev_stage = -1;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&full[stage], phase);
        const uint8_t* a = smem + stage * STAGE_BYTES + (wg - 1) * 64 * 128;
        const uint8_t* b = smem + stage * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k) {
          wgmma_m64n256k16_bf16(acc, smem_desc(a + 32 * k), smem_desc(b + 32 * k), 1);
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous k-block's products are done: release its buffers
        if (prev_stage >= 0) release(prev_stage);
        prev_stage = stage;
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
      wgmma_wait<0>();
      if (prev_stage >= 0) release(prev_stage);

      // Epilogue: two rows per thread (hf = 0: row, hf = 1: row + 8), 256/T TwELL tiles each.
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + row_in_tile + 8 * hf;
        const bool row_ok = row < M;
        uint32_t* row_out = out + size_t(row_ok ? row : 0) * size_t(n_twell_tiles) * S;
#pragma unroll
        for (int sub = 0; sub < BN / T; ++sub) {
          const int t = nb * (BN / T) + sub;
          const bool ok = row_ok && t < n_twell_tiles;
          if constexpr (T == 256) {
            store_twell_tile_row<T, 0>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
          } else if constexpr (T == 128) {
            if (sub == 0) store_twell_tile_row<T, 0>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
            else store_twell_tile_row<T, 16>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
          } else {
            if (sub == 0) store_twell_tile_row<T, 0>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
            else if (sub == 1) store_twell_tile_row<T, 8>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
            else if (sub == 2) store_twell_tile_row<T, 16>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
            else store_twell_tile_row<T, 24>(acc, hf, row_out + t * S, ok, q, S, t * T, spill);
          }
        }
      }
    }
  }
  // No CTA may leave while its partner can still multicast into it or arrive on its barriers.
  if constexpr (CL > 1) cluster_sync();
}

// ---------------------------------------------------------------------------------------------
// Host side

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    return (err == cudaSuccess && q == cudaDriverEntryPointSuccess) ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p)
                                                                    : nullptr;
  }();
  return fn;
}

// 2-D bf16 tensor map over a row-major [rows, cols] matrix; boxes of box_rows x 64 columns.
bool make_map(CUtensorMap* map, const void* ptr, int rows, int cols, int box_rows) {
  auto fn = encode_fn();
  if (fn == nullptr) {
    set_error("cannot resolve cuTensorMapEncodeTiled from the CUDA driver");
    return false;
  }
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {cuuint32_t(BK), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    char buf[128];
    snprintf(buf, sizeof(buf), "cuTensorMapEncodeTiled failed with CUresult %d", int(r));
    set_error(buf);
    return false;
  }
  return true;
}

template <int T, int CL>
cudaError_t launch(const void* x, const void* w, uint32_t* out, int M, int D, int H, int S, Spill spill, int device,
                   cudaStream_t stream) {
  CUtensorMap mx, mw;
  if (!make_map(&mx, x, M, D, BM) || !make_map(&mw, w, H, D, BN / CL)) return cudaErrorInvalidValue;
  auto kernel = gate_twell_kernel<T, CL>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (spill.used != nullptr) {
    err = cudaMemsetAsync(spill.used, 0, sizeof(uint32_t), stream);
    if (err != cudaSuccess) return err;
  }
  const int n_groups = ((((M + BM - 1) / BM) + CL - 1) / CL) * ((H + BN - 1) / BN);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.blockDim = dim3(384);
  cfg.dynamicSmemBytes = SMEM_BYTES;
  cfg.stream = stream;
  int clusters = sms / CL;
  if (CL > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CL;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(clusters * CL);
    if (getenv("TWELL_DEBUG_LAUNCH")) {
      int active = 0;
      cudaError_t q = cudaOccupancyMaxActiveClusters(&active, kernel, &cfg);
      fprintf(stderr, "twell gate: %d clusters of %d requested, occupancy query says %d (%s)\n", clusters, CL, active,
              cudaGetErrorString(q));
      cudaGetLastError();
    }
  }
  cfg.gridDim = dim3(std::min(n_groups, clusters) * CL);
  err = cudaLaunchKernelEx(&cfg, kernel, mx, mw, out, M, H, D, S, (H + T - 1) / T, spill);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace gate

namespace {
thread_local char g_error[256] = "";
}
const char* last_error() { return g_error; }
void set_error(const char* msg) { snprintf(g_error, sizeof(g_error), "%s", msg); }

cudaError_t launch_gate_twell(const void* x, const void* w, uint32_t* out, uint32_t* spill, uint32_t* spill_used,
                              uint32_t spill_cap, int M, int D, int H, int tile, int S, int device,
                              cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  if (D % gate::BK != 0 || H > 65536 || S < 2 || tile % S != 0) return cudaErrorInvalidValue;
  const gate::Spill sp{spill, spill_used, spill_cap};
  // TWELL_GATE_CLUSTER=1 selects the single-CTA variant (kept for comparison).
  static const bool single = [] { const char* e = getenv("TWELL_GATE_CLUSTER"); return e && e[0] == '1'; }();
  if (single) {
    switch (tile) {
      case 256: return gate::launch<256, 1>(x, w, out, M, D, H, S, sp, device, stream);
      case 128: return gate::launch<128, 1>(x, w, out, M, D, H, S, sp, device, stream);
      case 64: return gate::launch<64, 1>(x, w, out, M, D, H, S, sp, device, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (tile) {
    case 256: return gate::launch<256, 2>(x, w, out, M, D, H, S, sp, device, stream);
    case 128: return gate::launch<128, 2>(x, w, out, M, D, H, S, sp, device, stream);
    case 64: return gate::launch<64, 2>(x, w, out, M, D, H, S, sp, device, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace twell
