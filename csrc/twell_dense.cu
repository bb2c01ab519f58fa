// Dense path for heavy rows.
//
// A row with more active neurons than the light kernel's list holds (LIST_CAP) goes to the heavy
// queue. Per entry the per-row heavy kernel gathers 8 KB of weights (~1.2 ns at the ~7 TB/s L2
// ceiling), so a heavy-tail row with ~400 entries costs ~0.5 us there, against ~0.1 us as one row
// of a dense tensor-core FFN. So heavy rows are computed densely:
//   light kernel   copies the x row of queued heavy row h < cap into xh[h] (twell_ffn.cu);
//   hidden kernel  hidden[h] = relu(xh[h] @ w_act^T) * (xh[h] @ w_up^T), or relu(xh[h] @ w_act^T)
//                  when non-gated, rounded to bf16 where dense PyTorch rounds;
//   down kernel    out[row of h] = hidden[h] @ w_down_t.
// Both are the gate kernel's pipeline (one TMA producer thread, two wgmma m64n256k16 consumer
// warpgroups, 128 x 256 tiles, persistent CTAs) with a plain epilogue. Their tile counts come from
// the queue's count on the device: no host synchronisation, so CUDA graphs capture the call, and an
// empty queue costs launches of CTAs that return at once.
//
// Rounds: the buffers hold cap rows (the workspace stays at cap x (D + H) bf16 whatever the input).
// Queue entries past cap go through the same two GEMMs in rounds of cap rows, in one cooperative
// kernel that copies each round's x rows into xh and separates the round's steps with grid barriers.
// Without it a near-dense input (most rows heavy) ran the rows past cap on the per-row heavy kernel,
// tens of times slower than dense (measured in docs/kernels.md §5).
//
// The path takes the whole queue or none of it (dense_takes_queue): fewer than kDenseMinRows rows
// are faster on the per-row kernel, and a partial share would depend on the queue's order (device
// atomics), so a row's rounding could change from call to call. Either way every row's sums have a
// fixed order and two calls agree bit for bit (a row gives the same bits in any round). The path
// recomputes the gate, so it needs w_act; it never reads TwELL and is exact for any activation
// pattern.
#include <cooperative_groups.h>
#include <cuda.h>

#include "common.cuh"
#include "tma.cuh"
#include "twell_kernels.h"
#include "wgmma_loop.cuh"

namespace twell {
namespace dense {

constexpr int BM = 128;  // rows per tile (two warpgroups of 64)
constexpr int BN = 256;  // columns per wgmma (the hidden kernel's gated tile: 128 gate + 128 up)
constexpr int BK = 64;   // 64 bf16 = one 128-byte swizzle row
constexpr int STAGES = 4;
constexpr int A_BYTES = BM * BK * 2;
constexpr int B_BYTES = BN * BK * 2;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024 /*align*/ + 2 * STAGES * 8 /*barriers*/;

enum Mode : int { HIDDEN_GATED = 0, HIDDEN_ACT = 1, DOWN = 2 };

struct Args {
  const uint32_t* count;   // heavy rows queued (device)
  const uint32_t* rows;    // their row ids, in queue order
  int cap;                 // rows of one round (a multiple of BM)
  const __nv_bfloat16* x;  // [M, D], for the rounds past the first
  __nv_bfloat16* xh;       // [cap, D]
  __nv_bfloat16* hidden;   // [cap, HP]
  __nv_bfloat16* out;      // [M, D]
  int D, H, HP;            // HP: H rounded up to BN
  int min_rows;            // the path runs when at least this many rows are queued
  float* l1_part;          // gated hidden only, may be null: [queue, HP / (BN / 2)] sums of |hidden| per tile
};

// Rows of the queue the dense path computes in total (0 or all of them), and in its first round.
__device__ __forceinline__ int queued_rows(const Args& a) {
  const uint32_t queued = *reinterpret_cast<const volatile uint32_t*>(a.count);
  return a.cap > 0 && queued >= uint32_t(a.min_rows) ? int(queued) : 0;
}

template <int MODE>
__device__ __forceinline__ int tile_count(int n, const Args& a) {
  constexpr int NCOL = MODE == HIDDEN_GATED ? BN / 2 : BN;  // output columns per tile
  const int n_blocks = MODE == DOWN ? (a.D + BN - 1) / BN : a.HP / NCOL;
  return (n + BM - 1) / BM * n_blocks;
}

__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}

__device__ __forceinline__ void init_barriers(uint64_t* full, uint64_t* empty) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// MODE HIDDEN_*: A = xh [cap, D] (map_a), B = w_act rows (map_b0) and w_up rows (map_b1, gated),
// both K-major. MODE DOWN: A = hidden [cap, HP], B = w_down_t [H, D] read MN-major: a stage's B is
// four 64 x 64 boxes (64 K rows of 128 bytes each, 8 KB apart along N), wgmma with B transposed.
// The CTA's share of the tiles of one GEMM over the first n rows of the buffers; DOWN stores row r
// to out[rows[r]]. (stage, phase) is the thread's place in the ring, kept across calls: the
// producer thread and the consumers step through the same stages in the same order.
template <int MODE>
__device__ __forceinline__ void gemm_tiles(const CUtensorMap* map_a, const CUtensorMap* map_b0,
                                           const CUtensorMap* map_b1, const Args& a, int n, const uint32_t* rows,
                                           int base, uint8_t* smem, uint64_t* full, uint64_t* empty, int& stage,
                                           uint32_t& phase) {
  const int m_blocks = (n + BM - 1) / BM;
  constexpr int NCOL = MODE == HIDDEN_GATED ? BN / 2 : BN;  // output columns per tile
  const int k_blocks = MODE == DOWN ? a.HP / BK : a.D / BK;
  const int tiles = tile_count<MODE>(n, a);
  const int wg = threadIdx.x / 128;

  // Tiles in column-block-major order: CTAs running at the same time share the weight tile.
  if (wg == 0) {
    if (threadIdx.x != 0) return;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int mb = t % m_blocks, nb = t / m_blocks;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&empty[stage], phase);
        uint8_t* s = smem + stage * STAGE_BYTES;
        mbar_expect_tx(&full[stage], STAGE_BYTES);
        tma_load_2d(s, map_a, &full[stage], kb * BK, mb * BM);
        uint8_t* b = s + A_BYTES;
        if constexpr (MODE == HIDDEN_GATED) {
          tma_load_2d(b, map_b0, &full[stage], kb * BK, nb * NCOL);
          tma_load_2d(b + B_BYTES / 2, map_b1, &full[stage], kb * BK, nb * NCOL);
        } else if constexpr (MODE == HIDDEN_ACT) {
          tma_load_2d(b, map_b0, &full[stage], kb * BK, nb * NCOL);
        } else {
#pragma unroll
          for (int j = 0; j < BN / 64; ++j) tma_load_2d(b + j * (BK * 128), map_b0, &full[stage], nb * BN + 64 * j, kb * BK);
        }
        if (++stage == STAGES) { stage = 0; phase ^= 1; }
      }
    }
    return;
  }

  const int ct = threadIdx.x - 128 * wg;
  const int warp = ct / 32, lane = ct % 32, q = lane % 4;
  const int row_in_tile = 64 * (wg - 1) + 16 * warp + lane / 4;
  float acc[128];
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int mb = t % m_blocks, nb = t / m_blocks;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    // B: K-major (hidden modes) or MN-major, 64-column atoms 8 KB apart (down).
    auto b_desc = [&](int st, int k) {
      const uint32_t sb = smem_u32(smem + st * STAGE_BYTES + A_BYTES);
      return MODE == DOWN ? smem_desc(sb + 2048 * k, BK * 128, 1024) : smem_desc(sb + 32 * k);
    };
    wgmma_k_loop<MODE == DOWN ? 1 : 0, BK / 16, STAGES, false>(
        acc, k_blocks, full, stage, phase,
        [&](int st) { return smem_u32(smem + st * STAGE_BYTES + (wg - 1) * 64 * 128); }, b_desc,
        [&](int st) { if (lane == 0) mbar_arrive(&empty[st]); });

    // This thread holds rows row_in_tile (hf = 0) and row_in_tile + 8 (hf = 1), columns
    // 8i + 2q + {0, 1} in acc[4i + 2hf + {0, 1}]. Rows of the last block past n hold whatever xh held
    // there: the hidden kernel computes them (rows of a GEMM are independent), the down kernel does not
    // store them.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = mb * BM + row_in_tile + 8 * hf;
      if constexpr (MODE == DOWN) {
        if (r >= n) continue;
        __nv_bfloat16* o = a.out + size_t(rows[r]) * a.D + nb * BN + 2 * q;
#pragma unroll
        for (int i = 0; i < 32; ++i)
          if (nb * BN + 8 * i + 2 * q < a.D)
            *reinterpret_cast<__nv_bfloat162*>(o + 8 * i) =
                __floats2bfloat162_rn(acc[4 * i + 2 * hf], acc[4 * i + 2 * hf + 1]);
      } else {
        uint32_t* o = reinterpret_cast<uint32_t*>(a.hidden + size_t(r) * a.HP + nb * NCOL + 2 * q);
        // Columns past H: zero, not x . 0 from the zero-filled weight rows (NaN when x holds a NaN or an
        // Inf), so that the down GEMM's zero-filled rows of w_down_t meet zeros.
        const int col0 = nb * NCOL + 2 * q;
        auto keep = [&](int col, __nv_bfloat16 v) { return col < a.H ? v : __float2bfloat16_rn(0.f); };
        if constexpr (MODE == HIDDEN_GATED) {
          // Gate column j in acc[.. j / 8 ..], up column j sixteen words further: as dense PyTorch,
          // h = bf16(relu(bf16(gate)) * bf16(up)).
          float l1 = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            __nv_bfloat16 h[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float g = __bfloat162float(relu_bf16(acc[4 * i + 2 * hf + e]));
              const float u = __bfloat162float(__float2bfloat16_rn(acc[4 * (i + 16) + 2 * hf + e]));
              h[e] = keep(col0 + 8 * i + e, __float2bfloat16_rn(g * u));
              l1 += fabsf(__bfloat162float(h[e]));
            }
            o[4 * i] = pack_bf16x2(h[0], h[1]);
          }
          if (a.l1_part != nullptr) {  // uniform over the grid: every lane of the quad shuffles
            // The four lanes of a quad hold this row's 128 columns of the tile: a fixed-order sum.
            l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
            l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
            if (q == 0 && r < n) a.l1_part[size_t(base + r) * (a.HP / NCOL) + nb] = l1;
          }
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i)
            o[4 * i] = pack_bf16x2(keep(col0 + 8 * i, relu_bf16(acc[4 * i + 2 * hf])),
                                   keep(col0 + 8 * i + 1, relu_bf16(acc[4 * i + 2 * hf + 1])));
        }
      }
    }
  }
}

// The first round: min(queued, cap) rows, whose x the light kernel copied into xh.
template <int MODE>
__global__ void __launch_bounds__(384, 1)
    dense_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b0,
                      const __grid_constant__ CUtensorMap map_b1, const Args a) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  const int n = min(queued_rows(a), a.cap);
  if (int(blockIdx.x) >= tile_count<MODE>(n, a)) return;  // the whole CTA, before any barrier exists
  init_barriers(full, empty);
  int stage = 0;
  uint32_t phase = threadIdx.x < 128 ? 1u : 0u;  // the producer: a fresh barrier counts as released once
  gemm_tiles<MODE>(&map_a, &map_b0, &map_b1, a, n, a.rows, 0, smem, full, empty, stage, phase);
}

// x rows of queue entries base .. base + n into xh, spread over the grid (16-byte vectors).
__device__ __forceinline__ void copy_queue_rows(const Args& a, int base, int n) {
  const int vecs = a.D / 8;
  const size_t threads = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(n) * vecs; i += threads) {
    const size_t r = i / vecs, c = i % vecs;
    reinterpret_cast<uint4*>(a.xh + r * a.D)[c] = reinterpret_cast<const uint4*>(a.x + size_t(a.rows[base + r]) * a.D)[c];
  }
}

// The first round's x rows, for a caller without a light kernel to copy them (the training forward).
__global__ void first_round_copy_kernel(const Args a) { copy_queue_rows(a, 0, min(queued_rows(a), a.cap)); }

// Global writes of this thread (generic proxy) ordered before later TMA reads (async proxy) that a
// grid barrier releases.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// The rounds past the first (queue entries cap, 2 cap, ...), launched cooperatively: every CTA is
// resident, so the grid barriers between a round's steps cannot deadlock. Returns at once (the whole
// grid, before any barrier) when the first round took the whole queue.
template <bool GATED>
__global__ void __launch_bounds__(384, 1)
    dense_rounds_kernel(const __grid_constant__ CUtensorMap map_xh, const __grid_constant__ CUtensorMap map_act,
                        const __grid_constant__ CUtensorMap map_up, const __grid_constant__ CUtensorMap map_hidden,
                        const __grid_constant__ CUtensorMap map_down, const Args a) {
  const int queued = queued_rows(a);
  if (queued <= a.cap) return;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  init_barriers(full, empty);
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  int stage = 0;
  uint32_t phase = threadIdx.x < 128 ? 1u : 0u;
  for (int base = a.cap; base < queued; base += a.cap) {
    const int n = min(a.cap, queued - base);
    // The previous step (the first round's down kernel, or the last grid barrier) has finished
    // every read of xh and hidden.
    copy_queue_rows(a, base, n);
    fence_async_global();
    grid.sync();
    gemm_tiles<GATED ? HIDDEN_GATED : HIDDEN_ACT>(&map_xh, &map_act, GATED ? &map_up : &map_act, a, n, nullptr,
                                                  base, smem, full, empty, stage, phase);
    fence_async_global();
    grid.sync();
    gemm_tiles<DOWN>(&map_hidden, &map_down, &map_down, a, n, a.rows + base, base, smem, full, empty, stage, phase);
    grid.sync();  // the next round rewrites xh, and its hidden GEMM rewrites hidden
  }
}

template <int MODE>
cudaError_t launch_mode(const CUtensorMap& ma, const CUtensorMap& mb0, const CUtensorMap& mb1, const Args& a, int sms,
                        cudaStream_t stream) {
  auto kernel = dense_gemm_kernel<MODE>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (err != cudaSuccess) return err;
  kernel<<<sms, 384, SMEM_BYTES, stream>>>(ma, mb0, mb1, a);
  return cudaGetLastError();
}

template <bool GATED>
cudaError_t launch_rounds(const CUtensorMap& xh, const CUtensorMap& act, const CUtensorMap& up,
                          const CUtensorMap& hidden, const CUtensorMap& down, const Args& a, int ctas,
                          cudaStream_t stream) {
  auto kernel = dense_rounds_kernel<GATED>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(384);
  cfg.dynamicSmemBytes = SMEM_BYTES;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, xh, act, up, hidden, down, a);
}

}  // namespace dense

int dense_hidden_width(int H) { return (H + dense::BN - 1) / dense::BN * dense::BN; }

int dense_l1_tiles(int H) { return dense_hidden_width(H) / (dense::BN / 2); }

size_t dense_workspace_words(int cap, int D, int H) {
  return (size_t(cap) * size_t(D + dense_hidden_width(H))) / 2;  // bf16 pairs
}

cudaError_t launch_dense_rows(const void* x, const void* w_act, const void* w_up, const void* w_down_t, void* out,
                              const uint32_t* count, const uint32_t* rows, void* xh, void* hidden, int cap, int D, int H,
                              int ctas, cudaStream_t stream, int min_rows, float* l1_part, bool copy_first) {
  if (cap <= 0) return cudaSuccess;
  if (cap % dense::BM != 0 || D % dense::BK != 0 || w_act == nullptr || x == nullptr || ctas <= 0 ||
      (l1_part != nullptr && w_up == nullptr))
    return cudaErrorInvalidValue;
  const int HP = dense_hidden_width(H);
  const dense::Args a{count, rows, cap, static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(xh),
                      static_cast<__nv_bfloat16*>(hidden), static_cast<__nv_bfloat16*>(out), D, H, HP,
                      min_rows > 1 ? min_rows : 1, l1_part};
  CUtensorMap m_xh, m_act, m_up, m_hidden, m_down;
  const bool gated = w_up != nullptr;
  if (!make_map(&m_xh, xh, cap, D, dense::BM) || !make_map(&m_act, w_act, H, D, gated ? dense::BN / 2 : dense::BN) ||
      (gated && !make_map(&m_up, w_up, H, D, dense::BN / 2)) || !make_map(&m_hidden, hidden, cap, HP, dense::BM) ||
      !make_map(&m_down, w_down_t, H, D, 64))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  if (copy_first) {
    dense::first_round_copy_kernel<<<ctas, 256, 0, stream>>>(a);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess)
    err = gated ? dense::launch_mode<dense::HIDDEN_GATED>(m_xh, m_act, m_up, a, ctas, stream)
                : dense::launch_mode<dense::HIDDEN_ACT>(m_xh, m_act, m_act, a, ctas, stream);
  if (err == cudaSuccess) err = dense::launch_mode<dense::DOWN>(m_hidden, m_down, m_down, a, ctas, stream);
  if (err != cudaSuccess) return err;
  return gated ? dense::launch_rounds<true>(m_xh, m_act, m_up, m_hidden, m_down, a, ctas, stream)
               : dense::launch_rounds<false>(m_xh, m_act, m_act, m_hidden, m_down, a, ctas, stream);
}

}  // namespace twell
