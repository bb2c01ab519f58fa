// Gate GEMM that writes TwELL from its epilogue: packed = TwELL(relu(x @ w_gate^T)).
//
// Hopper (sm_90a) persistent kernel, 384 threads:
//   warpgroup 0     warp 0, one thread: producer, issues TMA loads of x and w_gate tiles into a
//                   ring of STAGES shared-memory buffers (128B swizzle), completing on mbarriers;
//                   warps 1-3: packers, turn a finished tile into TwELL (below);
//   warpgroups 1,2  consumers: each multiplies 64 rows x 256 columns with wgmma m64n256k16,
//                   accumulating in 128 fp32 registers per thread.
// Epilogue in two halves so the tensor cores do not wait for the packing: the consumers only
// apply ReLU, round to bf16 and drop the tile into a 64 KB staging buffer in shared memory, then
// start the next tile's MMAs; the packer warps read the staged tile one row per lane (no shuffles,
// no scans: an earlier warp-per-row packer spent ~5.8k instructions per tile and warp and held the
// consumers back), count each TwELL tile row's nonzeros and store count + (value, column) words,
// in column order. No dense activation is ever written to global
// memory. The GEMM tile (128 x 256) is a multiple of the TwELL tile's width, so every TwELL tile
// row comes from one staged row. A tile row with more nonzeros than slots moves
// its entries to a spill area (count word = 0x80000000 | offset), so consumers still read exactly
// its nonzeros; if the spill area is full the count word keeps the true count and consumers
// recompute that tile exactly from x and the weights.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "common.cuh"
#include "tma.cuh"
#include "twell_kernels.h"
#include "wgmma_loop.cuh"

namespace twell {
namespace gate {

constexpr int BM = 128;                 // rows (tokens) per tile
constexpr int BN = 256;                 // columns (neurons) per tile
constexpr int BK = 64;                  // 64 bf16 = 128 bytes = one swizzle row
constexpr int STAGES = 3;              // 3 x 48 KB ring + the 64 KB staging buffer fit in 227 KB
constexpr int A_BYTES = BM * BK * 2;    // 16 KB
constexpr int B_BYTES = BN * BK * 2;    // 32 KB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int STG_ROW_BYTES = BN * 2;   // one staged tile row: 256 bf16
constexpr int STG_BYTES = BM * STG_ROW_BYTES;
constexpr int PACK_WARPS = 3;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STG_BYTES + 1024 /*align*/ + (2 * STAGES + 2) * 8 /*barriers*/;

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

// Where an overflowing tile row goes: a spill area of uint32 words (count, then entries), claimed
// with one atomicAdd per tile row. When the area is full the count word keeps the true count and
// consumers recompute that tile from x and the weights (slow but exact).
// ready (may be null; zeroed before the launch): one counter per 32 rows, raised by one when a
// packer warp has stored those rows' words for one GEMM column block; the rows are final at
// ready_target(H). The fused kernel, launched to overlap this one (docs/kernels.md §6), waits on them.
struct Spill {
  uint32_t* words;
  uint32_t* used;  // zeroed before the launch
  uint32_t cap;
  uint32_t* ready;
};

// Staged tile: row r holds 32 chunks of 16 bytes (8 bf16 columns each); chunk c sits at position
// c ^ (r % 8), so that the consumers' stores (8 rows x 4 words per instruction) and the packers'
// reads (32 lanes, 32 consecutive rows, one chunk each) are both free of bank conflicts.
__device__ __forceinline__ uint32_t stg_offset(int r, int chunk) {
  return uint32_t(r * STG_ROW_BYTES + ((chunk ^ (r & 7)) << 4));
}

__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// Bit j set when the j-th of the 8 bf16 values in v is nonzero; NaN counts as nonzero (set.neu).
__device__ __forceinline__ uint32_t nonzero8(const uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t m[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("set.neu.u32.bf16x2 %0, %1, %2;" : "=r"(m[i]) : "r"(w[i]), "r"(0u));
  // Low halves (even columns) to bits 0, 2, 4, 6; high halves to bits 17, 19, 21, 23.
  const uint32_t t = (m[0] & 0x00020001u) | (m[1] & 0x00080004u) | (m[2] & 0x00200010u) | (m[3] & 0x00800040u);
  return (t | (t >> 16)) & 0xFFu;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// Pack staged row r (one lane, no cross-lane work) into its BN / T TwELL tile rows. Pass 1 reads
// the tile row's T / 8 chunks and keeps an 8-bit nonzero mask per chunk; pass 2 walks the set bits,
// re-reading each value, and stores the entries in column order.
template <int T>
__device__ __forceinline__ void pack_row(uint32_t stg, int r, int m0, int M, uint32_t* __restrict__ out, int nb, int S,
                                         int n_twell_tiles, int H, const Spill& spill) {
  constexpr int CH = T / 8;         // 16-byte chunks per TwELL tile row
  constexpr int MW = (CH + 3) / 4;  // mask words, 4 chunks each
  const int row = m0 + r;
  if (row >= M) return;
#pragma unroll 1
  for (int tt = 0; tt < BN / T; ++tt) {
    const int t = nb * (BN / T) + tt;
    if (t >= n_twell_tiles) return;
    uint32_t mw[MW];
#pragma unroll
    for (int i = 0; i < MW; ++i) mw[i] = 0;
#pragma unroll
    for (int c = 0; c < CH; ++c) mw[c / 4] |= nonzero8(lds128(stg + stg_offset(r, tt * CH + c))) << (8 * (c % 4));
    // Columns past H (the last tile's padding): W_gate's rows there are TMA zero fill, so their value
    // is x . 0, which is NaN when x holds a NaN or an Inf. Never an entry: bit b of mw[i] is column 32 i + b.
    const int valid = H - t * T;
    if (valid < T) {
#pragma unroll
      for (int i = 0; i < MW; ++i)
        mw[i] &= valid >= 32 * (i + 1) ? 0xFFFFFFFFu : valid <= 32 * i ? 0u : (1u << (valid - 32 * i)) - 1u;
    }
    int total = 0;
#pragma unroll
    for (int i = 0; i < MW; ++i) total += __popc(mw[i]);
    uint32_t* tile_out = out + (size_t(row) * size_t(n_twell_tiles) + size_t(t)) * size_t(S);
    uint32_t* dst = tile_out;  // slot 0 = count in both layouts
    int limit = S;
    if (total > S - 1 && spill.words != nullptr) {  // rare: claim spill space
      const uint32_t off = atomicAdd(spill.used, uint32_t(total + 1));
      if (off + uint32_t(total) + 1 <= spill.cap && off < 0x80000000u) {
        tile_out[0] = 0x80000000u | off;
        dst = spill.words + off;
        limit = total + 1;
      }
    }
    dst[0] = uint32_t(total);
    int slot = 1;
    const uint32_t col0 = uint32_t(t * T);
#pragma unroll
    for (int i = 0; i < MW; ++i) {
      for (uint32_t m = mw[i]; m != 0 && slot < limit; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const int c = 4 * i + (b >> 3), j = b & 7;  // chunk, column in chunk
        const uint32_t w = lds32(stg + stg_offset(r, tt * CH + c) + 4 * (j >> 1));
        dst[slot] = ((j & 1) ? (w & 0xFFFF0000u) : (w << 16)) | (col0 + uint32_t(8 * c + j));
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
  const uint32_t stg = smem_u32(smem + STAGES * STAGE_BYTES);  // staging buffer (shared address)
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES + STG_BYTES);
  uint64_t* empty = full + STAGES;
  uint64_t* stg_full = empty + STAGES;  // consumers staged a tile (256 arrivals)
  uint64_t* stg_empty = stg_full + 1;   // packers finished reading it (PACK_WARPS * 32 arrivals)

  const int wg = threadIdx.x / 128;
  const int n_blocks_n = (H + BN - 1) / BN;
  const int n_blocks_m = (M + BM - 1) / BM;
  const int n_groups = ((n_blocks_m + CL - 1) / CL) * n_blocks_n;  // groups of CL vertically adjacent tiles
  const int k_blocks = D / BK;
  const uint32_t rank = CL > 1 ? cluster_rank() : 0;
  const int group0 = blockIdx.x / CL, group_step = gridDim.x / CL;
  // A kernel launched after this one with programmatic stream serialization (the fused kernel)
  // may start as SMs free up; it waits on the ready counters, not on this grid's end.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * CL);  // one arrival per consumer warp of every CTA that fills it
    }
    mbar_init(stg_full, 256);
    mbar_init(stg_empty, PACK_WARPS * 32);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CL > 1) cluster_sync(); else __syncthreads();

  // No setmaxnreg: the whole kernel is compiled for 168 registers (384 threads, 1 CTA per SM), which
  // the consumers' 128 accumulators fit, and the packers need their registers too.
  if (wg == 0) {
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
    } else if (threadIdx.x >= 32) {
      const int pw = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
      uint32_t sphase = 0;
      for (int g = group0; g < n_groups; g += group_step) {
        const int m0 = ((g / n_blocks_n) * CL + int(rank)) * BM;
        const int nb = g % n_blocks_n;
        mbar_wait(stg_full, sphase);
        sphase ^= 1;
        // Units of 32 consecutive rows, one row per lane, dealt round-robin to the packer warps.
        for (int u = pw; u < BM / 32; u += PACK_WARPS) {
          pack_row<T>(stg, 32 * u + lane, m0, M, out, nb, S, n_twell_tiles, H, spill);
          if (spill.ready != nullptr && m0 + 32 * u < M) {
            // Release: every lane's stores, then the counter (the pattern of a grid barrier).
            __syncwarp();
            if (lane == 0) {
              __threadfence();
              atomicAdd(spill.ready + (m0 / 32 + u), 1u);
            }
          }
        }
        mbar_arrive(stg_empty);
      }
    }
  } else {
    const int ct = threadIdx.x - 128 * wg;  // thread index inside this consumer warpgroup
    const int warp = ct / 32, lane = ct % 32, q = lane % 4;
    const int row_in_tile = 64 * (wg - 1) + 16 * warp + lane / 4;
    int stage = 0;
    uint32_t phase = 0, sphase = 1;  // a fresh staging buffer counts as free once
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
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      wgmma_k_loop<0, BK / 16, STAGES, false>(
          acc, k_blocks, full, stage, phase,
          [&](int st) { return smem_u32(smem + st * STAGE_BYTES + (wg - 1) * 64 * 128); },
          [&](int st, int k) { return smem_desc(smem + st * STAGE_BYTES + A_BYTES + 32 * k); }, release);

      // Epilogue, consumer half: ReLU, bf16, into the staging buffer once the packers released it.
      // This thread holds rows row_in_tile (hf = 0) and row_in_tile + 8 (hf = 1), columns
      // 8i + 2q + {0, 1} in acc[4i + 2hf + {0, 1}]: one 4-byte word per (hf, i).
      mbar_wait(stg_empty, sphase);
      sphase ^= 1;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = row_in_tile + 8 * hf;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          sts32(stg + stg_offset(r, i) + 4 * q,
                pack_bf16x2(relu_bf16(acc[4 * i + 2 * hf]), relu_bf16(acc[4 * i + 2 * hf + 1])));
        }
      }
      mbar_arrive(stg_full);
    }
  }
  // No CTA may leave while its partner can still multicast into it or arrive on its barriers.
  if constexpr (CL > 1) cluster_sync();
}

// ---------------------------------------------------------------------------------------------
// Host side

template <int T, int CL>
cudaError_t launch(const void* x, const void* w, uint32_t* out, int M, int D, int H, int S, Spill spill, int device,
                   cudaStream_t stream, int max_sms) {
  CUtensorMap mx, mw;
  if (!make_map(&mx, x, M, D, BM) || !make_map(&mw, w, H, D, BN / CL)) return cudaErrorInvalidValue;
  auto kernel = gate_twell_kernel<T, CL>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (max_sms > 0) sms = std::max(CL, std::min(sms, max_sms));
  if (spill.used != nullptr) {  // the ready counters, when asked for, follow it: one memset
    const size_t words = 1 + (spill.ready != nullptr ? size_t(gate_ready_words(M)) : 0);
    err = cudaMemsetAsync(spill.used, 0, words * sizeof(uint32_t), stream);
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
  }
  cfg.gridDim = dim3(std::min(n_groups, clusters) * CL);
  err = cudaLaunchKernelEx(&cfg, kernel, mx, mw, out, M, H, D, S, (H + T - 1) / T, spill);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace gate

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    return (err == cudaSuccess && q == cudaDriverEntryPointSuccess) ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p)
                                                                    : nullptr;
  }();
  return fn;
}

// Declared in tma.cuh.
bool make_map(CUtensorMap* map, const void* ptr, int rows, int cols, int box_rows) {
  auto fn = encode_fn();
  if (fn == nullptr) {
    set_error("cannot resolve cuTensorMapEncodeTiled from the CUDA driver");
    return false;
  }
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};  // 64 bf16 = one 128-byte swizzle row
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

namespace {
thread_local char g_error[256] = "";
}
const char* last_error() { return g_error; }
void set_error(const char* msg) { snprintf(g_error, sizeof(g_error), "%s", msg); }

int gate_ready_words(int M) { return 4 * ((M + gate::BM - 1) / gate::BM); }
uint32_t gate_ready_target(int H) { return uint32_t((H + gate::BN - 1) / gate::BN); }

cudaError_t launch_gate_twell(const void* x, const void* w, uint32_t* out, uint32_t* spill, uint32_t* spill_used,
                              uint32_t spill_cap, int M, int D, int H, int tile, int S, int device,
                              cudaStream_t stream, int cluster, int max_sms, bool ready) {
  if (cluster != 1 && cluster != 2) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  if (D % gate::BK != 0 || H > 65536 || S < 2 || tile % S != 0) return cudaErrorInvalidValue;
  if (ready && spill_used == nullptr) return cudaErrorInvalidValue;
  const gate::Spill sp{spill, spill_used, spill_cap, ready ? spill_used + 1 : nullptr};
  if (cluster == 1) {
    switch (tile) {
      case 256: return gate::launch<256, 1>(x, w, out, M, D, H, S, sp, device, stream, max_sms);
      case 128: return gate::launch<128, 1>(x, w, out, M, D, H, S, sp, device, stream, max_sms);
      case 64: return gate::launch<64, 1>(x, w, out, M, D, H, S, sp, device, stream, max_sms);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (tile) {
    case 256: return gate::launch<256, 2>(x, w, out, M, D, H, S, sp, device, stream, max_sms);
    case 128: return gate::launch<128, 2>(x, w, out, M, D, H, S, sp, device, stream, max_sms);
    case 64: return gate::launch<64, 2>(x, w, out, M, D, H, S, sp, device, stream, max_sms);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace twell
