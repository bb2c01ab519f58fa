// Block-union fused up/down projection on tensor cores, gated FFN, inference (docs/kernels.md §7).
//
// The per-row kernel (twell_ffn.cu) reads two 4 KB weight rows from L2 per (token, active neuron):
// it sits at the L2 gather ceiling (~7.5 TB/s). Tokens of a block share active neurons (trained
// models: 64 consecutive tokens need 2.3-4x fewer distinct rows than their tokens one by one), so
// here each weight row is read once per block of UB = 64 tokens, and the products run on the tensor
// cores over the block's union U of active neurons:
//   plan:  per block, the union U (sorted neuron ids) and each row's entries as (gate, rank in U);
//          a block takes this path when |U| <= ratio * (entries - base), else its rows go to the
//          per-row kernel
//          (so do rows with more than ROW_CAP entries and rows with an unresolved overflow);
//   up:    u = x_block @ w_up[U]^T (64 x |U|, K = D) with wgmma; the weight rows of U are gathered
//          into the 128-byte-swizzled layout with cp.async; the epilogue keeps u only where a
//          token is active: h = bf16(gate * bf16(u)), written over the entry's gate value;
//   down:  out_block = h @ w_down_t[U] (K = |U|, N = D in 512-column items); h is scattered into
//          a dense 64 x 64 tile per K step, the w_down_t rows of U are gathered (MN-major operand).
// Rounding as in the dense bf16 FFN: u and h are rounded to bf16, all sums in fp32.
#include <algorithm>

#include "common.cuh"
#include "twell_kernels.h"
#include "wgmma_loop.cuh"

namespace twell {
namespace uni {

constexpr int UB = 64;                      // tokens per block (wgmma M)
constexpr int ROW_CAP = 128;                // entries per row on this path
constexpr int BK = 64;                      // K per up stage: 64 bf16 = one 128-byte swizzle row
constexpr int NW = 256;                     // columns per consumer warpgroup (wgmma N)
constexpr int A_BYTES = UB * BK * 2;        // 8 KB: A tile (128-byte rows)
constexpr int UP_B_BYTES = 2 * NW * BK * 2; // 64 KB: one 32 KB operand per consumer warpgroup
constexpr int UP_STAGE = A_BYTES + UP_B_BYTES;
constexpr int UP_STAGES = 3;
constexpr int DK = 32;                      // K (union rows) per down stage: more, smaller stages
constexpr int DN_B_BYTES = DK * 2 * NW * 2; // 32 KB: 32 rows x 512 columns
constexpr int DN_STAGE = A_BYTES + DN_B_BYTES;  // A keeps the 128-byte row layout, half used
constexpr int DN_STAGES = 4;
constexpr int DCHUNK = 2 * NW;              // output columns per down item
constexpr int MAX_SLOT = 8192;              // union row offsets held in shared memory by the down kernel

// Union ids per block slot: H rounded up to 64, so every 64-id slice is 128-byte aligned.
__host__ __device__ constexpr int ulist_slot(int H) { return (H + 63) & ~63; }

constexpr int OFF_STRIDE = 36;              // up producer: words per row group of B row offsets
constexpr int UP_SMEM = UP_STAGES * UP_STAGE + 16 * OFF_STRIDE * 4 + 1024 + 64;
constexpr int DOWN_SMEM = DN_STAGES * DN_STAGE + UB * ROW_CAP * 4 + MAX_SLOT * 4 + (MAX_SLOT / DK + 4 + UB) * 4 + 1024 + 64;
static_assert(UP_SMEM <= 227 * 1024 && DOWN_SMEM <= 227 * 1024, "an H100 CTA has at most 227 KB of shared memory");

struct Params {
  const __nv_bfloat16* x;
  const uint32_t* tw;
  const uint32_t* spill;  // may be null
  const __nv_bfloat16* w_up;
  const __nv_bfloat16* w_down_t;
  __nv_bfloat16* out;
  Workspace w;
  int M, D, H, n_tiles, S, n_blocks;
  float ratio, base;
};

// The barrier receives one arrival from this thread once all its earlier cp.async have landed.
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Move registers from the producer warpgroup (address arithmetic only) to the two consumer
// warpgroups (128 accumulators each): 56 + 2 x 224 per thread fits the 64K-register file.
__device__ __forceinline__ void reg_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 56;"); }
__device__ __forceinline__ void reg_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 224;"); }

// Barrier of one consumer warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void wg_sync(int g) {
  if (g == 0) asm volatile("bar.sync 1, 128;" ::: "memory");
  else asm volatile("bar.sync 2, 128;" ::: "memory");
}

// Union block ubi of the plan's list: its block index, |U| and first row (up and down kernels, both
// warpgroup roles).
struct UnionBlock {
  int b, n_union, r0;
};
__device__ __forceinline__ UnionBlock union_block(const Params& p, int ubi) {
  const int b = int(p.w.ublocks[ubi]);
  return {b, int(p.w.usize[b]), b * UB};
}

// ---------------------------------------------------------------------------------------------
// plan: one CTA (8 warps) per block of UB rows.
__global__ void __launch_bounds__(256) plan_kernel(const Params p) {
  __shared__ uint32_t bits[2048];  // union bitmap (H <= 65536)
  __shared__ uint32_t pre[2048];   // union rank of each bitmap word's first bit
  __shared__ uint32_t cnt_s[UB];
  __shared__ uint32_t warp_tot[8];
  const int b = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nwords = (p.H + 31) / 32;
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) bits[i] = 0;
  __syncthreads();

  for (int rr = warp; rr < UB; rr += 8) {
    const int row = b * UB + rr;
    uint32_t n_row = NOT_HERE;
    if (row < p.M) {
      uint32_t* ent = p.w.ent + size_t(row) * ROW_CAP;
      const int n = row_entries<ROW_CAP>(ent, p.tw + size_t(row) * p.n_tiles * p.S, p.spill, p.n_tiles, p.S, lane);
      if (n >= 0) {
        for (int i = lane; i < n; i += 32) {
          const uint32_t c = entry_col(ent[i]);
          atomicOr(&bits[c >> 5], 1u << (c & 31));
        }
        n_row = uint32_t(n);
      }
    }
    if (lane == 0) cnt_s[rr] = n_row;
  }
  __syncthreads();

  // Exclusive prefix of the bitmap's popcounts: thread t owns words [t*per, (t+1)*per).
  const int per = (nwords + blockDim.x - 1) / blockDim.x;
  const int w0 = threadIdx.x * per, w1 = min(nwords, w0 + per);
  uint32_t mine = 0;
  for (int i = w0; i < w1; ++i) mine += __popc(bits[i]);
  const uint32_t incl = warp_incl_scan(mine, lane);
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  uint32_t before = 0, n_union = 0;
  for (int w = 0; w < 8; ++w) {
    if (w < warp) before += warp_tot[w];
    n_union += warp_tot[w];
  }
  uint32_t run = before + incl - mine;
  for (int i = w0; i < w1; ++i) {
    pre[i] = run;
    run += __popc(bits[i]);
  }
  uint32_t entries = 0;
  bool any = false;
  for (int rr = 0; rr < UB; ++rr) {
    if (cnt_s[rr] != NOT_HERE) { entries += cnt_s[rr]; any = true; }
  }
  __syncthreads();

  // Per-row cost ~ entries; union cost ~ a fixed part per block (worth `base` entries: the x tile,
  // filling two pipelines) plus |U| / ratio entries. base = 0 is the plain ratio rule.
  const bool use = any && p.ratio > 0.f && float(entries) >= p.base &&
                   float(n_union) <= p.ratio * (float(entries) - p.base);
  if (!use) {  // uniform over the CTA: every thread computed the same entries and n_union
    // Every row of the block goes to the per-row kernel: one claim per block. (One atomic per row
    // would put M atomics on one counter; row order in the list does not matter, each row's sum is
    // fixed.)
    __shared__ uint32_t first;
    const int n_rows = min(UB, p.M - b * UB);
    if (threadIdx.x == 0) first = atomicAdd(&p.w.ctr[0], uint32_t(n_rows));
    __syncthreads();
    for (int rr = threadIdx.x; rr < n_rows; rr += blockDim.x) p.w.light_rows[first + rr] = uint32_t(b * UB + rr);
    return;
  }
  if (threadIdx.x == 0) {
    p.w.ublocks[atomicAdd(&p.w.ctr[1], 1u)] = uint32_t(b);
    p.w.usize[b] = n_union;
  }
  uint16_t* U = p.w.ulist + size_t(b) * ulist_slot(p.H);
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) {
    uint32_t m = bits[i], r = pre[i];
    while (m) {
      U[r++] = uint16_t(32 * i + __ffs(m) - 1);
      m &= m - 1;
    }
  }
  for (int rr = warp; rr < UB; rr += 8) {
    const int row = b * UB + rr;
    const uint32_t n = cnt_s[rr];
    if (lane == 0) p.w.rowcnt[size_t(b) * UB + rr] = n;
    if (n == NOT_HERE) {
      if (lane == 0 && row < p.M) p.w.light_rows[atomicAdd(&p.w.ctr[0], 1u)] = uint32_t(row);
      continue;
    }
    uint32_t* ent = p.w.ent + size_t(row) * ROW_CAP;
    for (uint32_t i = lane; i < n; i += 32) {  // this lane wrote or read ent[i] above: same warp
      const uint32_t e = ent[i], c = entry_col(e);
      const uint32_t rank = pre[c >> 5] + __popc(bits[c >> 5] & ((1u << (c & 31)) - 1u));
      ent[i] = (e & 0xFFFF0000u) | rank;
    }
    // The down kernel walks each row's entries in rank order. TwELL words from the gate kernel or
    // pack_twell are in column order already (so ranks ascend); any other order is sorted here.
    __syncwarp();
    bool unsorted = false;
    for (uint32_t i = lane; i + 1 < n; i += 32) unsorted |= (ent[i] & 0xFFFFu) > (ent[i + 1] & 0xFFFFu);
    if (__any_sync(0xffffffffu, unsorted) && lane == 0) {
      for (uint32_t i = 1; i < n; ++i) {  // insertion sort by rank: rare, at most ROW_CAP entries
        const uint32_t e = ent[i];
        uint32_t j = i;
        for (; j > 0 && (ent[j - 1] & 0xFFFFu) > (e & 0xFFFFu); --j) ent[j] = ent[j - 1];
        ent[j] = e;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// up and down share the pipeline: warpgroup 0 (128 threads) gathers operands with cp.async into a
// ring of stages, warpgroups 1 and 2 each run wgmma m64n256k16 on their own 256 columns.

// Consumer side of one K loop over `steps` stages (wgmma_k_loop; the producers fill stages with
// cp.async and st.shared, hence the fence); zeroes acc first, returns with all MMAs done and the
// last stage used (held, with HOLD_LAST).
template <int TB, int KS, int NST, int STAGE, int B_OFF, bool HOLD_LAST = false, class DescB>
__device__ __forceinline__ int mma_loop(float (&acc)[128], int steps, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                         int& stage, uint32_t& phase, int g, int lane, DescB desc_b) {
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  return wgmma_k_loop<TB, KS, NST, true, HOLD_LAST>(
      acc, steps, full, stage, phase, [&](int st) { return smem_u32(smem + st * STAGE); },
      [&](int st, int k) { return desc_b(smem_u32(smem + st * STAGE) + A_BYTES + g * B_OFF, k); },
      [&](int st) { if (lane == 0) mbar_arrive(&empty[st]); });
}

__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages, uint32_t full_count) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], full_count);
      mbar_init(&empty[s], 8);  // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// Offset of 16-byte chunk `ch` of 128-byte row `r` in a 128B-swizzled tile.
__device__ __forceinline__ uint32_t swz(int r, int ch) { return uint32_t(r * 128 + ((ch ^ (r & 7)) << 4)); }

// Persistent: CTA c takes union blocks c, c + gridDim.x, ... of the plan's list, with one
// ring whose stages and phases run on across blocks. (Before, one CTA per block of M was launched and
// the CTAs without a union block exited: ~0.08 ms of empty CTAs where few blocks took the path.)
__global__ void __launch_bounds__(384, 1) up_kernel(const Params p) {
  const int n_ub = int(*reinterpret_cast<volatile uint32_t*>(&p.w.ctr[1]));
  if (int(blockIdx.x) >= n_ub) return;
  uint8_t* smem = aligned_smem<1024>();
  // Hide from the compiler that smem is shared memory (generic accesses, see aligned_smem): every
  // hot access here is an explicit shared-space instruction anyway, and with the pointer known as
  // shared, ptxas spills 4 bytes in this 168-register kernel.
  asm volatile("" : "+l"(smem));
  uint32_t* rowoff = reinterpret_cast<uint32_t*>(smem + UP_STAGES * UP_STAGE);  // [16][OFF_STRIDE]
  uint64_t* full = reinterpret_cast<uint64_t*>(rowoff + 16 * OFF_STRIDE);
  uint64_t* empty = full + UP_STAGES;
  init_ring(full, empty, UP_STAGES, 128);

  const int steps = p.D / BK;
  const int wg = threadIdx.x / 128;
  int stage = 0;

  if (wg == 0) {
    reg_dealloc();
    // Thread t copies 16-byte chunk ch of the B rows rg + 16 m (m < 32) of each pass. Every such row
    // is = rg (mod 8), so its swizzled chunk position is the same for all m: one destination offset
    // plus 2 KB per m. The rows' element offsets (neuron * D) sit in shared memory, 32 words per row
    // group (stride 36: the 4 groups of a warp read different banks), and are read 4 at a time: the
    // copy loop has no dependent load per copy (the first build spent most of its time on those;
    // docs/kernels.md §7).
    const int t = threadIdx.x, ch = t % 8, rg = t / 8;
    const uint32_t offs = smem_u32(rowoff + rg * OFF_STRIDE);
    const uint32_t dst0 = uint32_t(rg * 128 + ((ch ^ (rg & 7)) << 4));
    uint32_t phase = 1;  // a fresh barrier counts as released once
    for (int ubi = blockIdx.x; ubi < n_ub; ubi += gridDim.x) {
      const auto [b, n_union, r0] = union_block(p, ubi);
      const uint16_t* U = p.w.ulist + size_t(b) * ulist_slot(p.H);
      const int passes = (n_union + 2 * NW - 1) / (2 * NW);
      for (int pass = 0; pass < passes; ++pass) {
        const int rem = n_union - pass * 2 * NW;  // union rows left from this pass on
        __syncwarp();  // the row group's 8 threads (one warp) finished reading the previous pass's offsets
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = ch + 8 * i, j = rg + 16 * m;
          rowoff[rg * OFF_STRIDE + m] = j < rem ? uint32_t(__ldg(U + pass * 2 * NW + j)) * uint32_t(p.D) : 0u;
        }
        __syncwarp();
        const int mlim = rem > rg ? (rem - rg + 15) / 16 : 0;  // rows rg + 16 m < rem
        for (int kb = 0; kb < steps; ++kb) {
          mbar_wait(&empty[stage], phase);
          const uint32_t a = smem_u32(smem + stage * UP_STAGE);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            const int r = rg + 16 * m;
            const bool ok = r0 + r < p.M;
            cp_async16(a + swz(r, ch), p.x + size_t(ok ? r0 + r : 0) * p.D + kb * BK + ch * 8, ok);
          }
          const __nv_bfloat16* src = p.w_up + kb * BK + ch * 8;
          const uint32_t b = a + A_BYTES + dst0;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint4 o[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) o[i] = lds128(offs + 64 * h + 16 * i);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const uint32_t w[4] = {o[i].x, o[i].y, o[i].z, o[i].w};
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                const int m = 16 * h + 4 * i + c;
                cp_async16(b + 2048 * m, src + w[c], m < mlim);
              }
            }
          }
          cp_async_arrive(&full[stage]);
          if (++stage == UP_STAGES) { stage = 0; phase ^= 1; }
        }
      }
    }
    return;
  }

  reg_alloc();
  const int g = wg - 1, ct = threadIdx.x - 128 * wg;
  const int warp = ct / 32, lane = ct % 32, q = lane % 4;
  uint32_t phase = 0;
  float acc[128];
  // This thread's two rows of a block, R = 16 warp + lane / 4 + 8 hf, and where they sit in the
  // warpgroup's u tile of a stage (a warp writes and reads only its own 16 rows).
  int row[2];
  uint32_t srow[2], flip[2];  // byte offset of the row in a stage; its chunk swizzle (see step 1)
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    row[hf] = 16 * warp + lane / 4 + 8 * hf;
    srow[hf] = uint32_t(A_BYTES + g * (UP_B_BYTES / 2) + row[hf] * (NW * 2));
    flip[hf] = uint32_t(row[hf] & 1) << 2;
  }
  for (int ubi = blockIdx.x; ubi < n_ub; ubi += gridDim.x) {
    const auto [b, n_union, r0] = union_block(p, ubi);
    const int passes = (n_union + 2 * NW - 1) / (2 * NW);
    // A row's entries ascend in rank (the plan sorts them), so the entries on this warpgroup's 256
    // columns of a pass are one run: a cursor per row walks each entry about twice per block (its own
    // run, then skipped by the other warpgroup), where a scan per pass read all of them every pass
    // (ncu: ~35% of consumer time; docs/kernels.md §7).
    uint32_t* ent[2];
    uint32_t n[2], cur[2] = {0u, 0u};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint32_t c = p.w.rowcnt[size_t(b) * UB + row[hf]];
      n[hf] = c == NOT_HERE ? 0u : c;
      ent[hf] = p.w.ent + size_t(r0 + row[hf]) * ROW_CAP;
    }
    // Entry i of row hf, 0 past the row's end.
    auto entry = [&](int hf, uint32_t i) { return i < n[hf] ? __ldg(ent[hf] + i) : 0u; };
    for (int pass = 0; pass < passes; ++pass) {
      // Lane q of a row takes entry cur + q (the row's 4 lanes take 4 consecutive entries); loaded
      // before the MMAs, so the epilogue's first step does not wait on L2. Reading entries with
      // ld.global.nc is safe: before an entry is rewritten only its rank bits are used, and its
      // other reader (the other warpgroup) only skips it by rank.
      uint32_t v[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) v[hf] = entry(hf, cur[hf] + q);
      const int held = mma_loop<0, BK / 16, UP_STAGES, UP_STAGE, UP_B_BYTES / 2, true>(
          acc, steps, smem, full, empty, stage, phase, g, lane,
          [](uint32_t bb, int k) { return smem_desc(bb + 32 * k); });
      // The pass's last stage is held: this warpgroup's B half of it (32 KB, read only by its own
      // MMAs, which are done) takes the u tile, and each warp releases the stage after its epilogue.
      // (An earlier version kept the tile in global scratch; each entry then waited on L2 for its u.)
      const uint32_t tile = smem_u32(smem + held * UP_STAGE);
      // Shared address of 16-byte chunk ch of row hf's u (the layout below, in one place).
      auto u_chunk = [&](int hf, uint32_t ch) { return tile + srow[hf] + 16 * (ch ^ flip[hf]); };
      // Epilogue, step 1: bf16(u) of the tile to shared memory (in an earlier version each entry picked
      // its u out of the owner's 128 accumulators with a 32-way select, ~4000 instructions per warp
      // and pass). This thread holds columns 8 i + 2 q + {0, 1} of row R in acc[4 i + 2 hf + {0, 1}];
      // column c of a row sits in 16-byte chunk (i / 4) * 4 + q, word i % 4 (i = c / 8, q = c / 2 % 4),
      // half c % 2, so the row's 4 lanes store 64 contiguous bytes per instruction. Odd rows flip
      // chunk bit 2: the two rows of a quarter warp's store hit different banks.
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          uint32_t w[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(acc[4 * (4 * k + j) + 2 * hf], acc[4 * (4 * k + j) + 2 * hf + 1]);
            w[j] = *reinterpret_cast<const uint32_t*>(&b);
          }
          asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(u_chunk(hf, 4 * k + q)),
                       "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
        }
      }
      __syncwarp();  // a row's tile is written by its 4 lanes, all in this warp
      // Step 2: the entries of this warpgroup's 256 columns, gate -> h = bf16(gate * bf16(u)). A row's
      // entries ascend in rank (the plan sorts them), so they are one run from the cursor; the row's
      // 4 lanes walk it 4 entries at a time, and entries below c0 (the other warpgroup's) are skipped.
      // Every lane stays in the loop until the whole warp is done: the ballot needs all of them.
      const uint32_t c0 = uint32_t(pass * 2 * NW + g * NW), c1 = c0 + NW;
      bool more[2] = {true, true};
      while (__any_sync(0xffffffffu, more[0] || more[1])) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          // The next 4 entries are loaded before this step's u, so the two L2 round trips overlap;
          // used only when all 4 current ones are below c1.
          const uint32_t nxt = more[hf] ? entry(hf, cur[hf] + 4 + q) : 0u;
          const uint32_t rank = v[hf] & 0xFFFFu;
          const bool in = more[hf] && cur[hf] + q < n[hf] && rank < c1;
          if (in && rank >= c0) {
            const uint32_t col = rank - c0, i = col >> 3;
            uint32_t w;
            asm volatile("ld.shared.u32 %0, [%1];"
                         : "=r"(w) : "r"(u_chunk(hf, (i >> 2) * 4 + ((col >> 1) & 3u)) + 4 * (i & 3u)) : "memory");
            const float ub = __bfloat162float(__ushort_as_bfloat16(uint16_t((col & 1) ? w >> 16 : w & 0xFFFFu)));
            const __nv_bfloat16 h = __float2bfloat16_rn(entry_value(v[hf]) * ub);
            ent[hf][cur[hf] + q] = (uint32_t(__bfloat16_as_ushort(h)) << 16) | rank;
          }
          // Entries below c1 are a prefix of the 4: the cursor moves past them; fewer than 4 ends the run.
          const uint32_t below = __popc((__ballot_sync(0xffffffffu, in) >> (lane & ~3)) & 0xFu);
          if (more[hf]) {
            cur[hf] += below;
            more[hf] = below == 4;
            if (more[hf]) v[hf] = nxt;
          }
        }
      }
      __syncwarp();  // the warp's reads of its rows of the tile are done
      if (lane == 0) mbar_arrive(&empty[held]);
    }
  }
}

// Persistent like up_kernel. An item is (union block, 512-column chunk); CTA c takes the contiguous
// run of items [it0, it1), so its consecutive items mostly share a block, whose staging in shared
// memory is then done once (striding over items staged every item again; docs/kernels.md §7).
__global__ void __launch_bounds__(384, 1) down_kernel(const Params p) {
  const int n_items = p.D / DCHUNK;
  const long long n_work = (long long)(*reinterpret_cast<volatile uint32_t*>(&p.w.ctr[1])) * n_items;
  const int it0 = int(n_work * blockIdx.x / gridDim.x), it1 = int(n_work * (blockIdx.x + 1) / gridDim.x);
  if (it0 >= it1) return;
  uint8_t* smem = aligned_smem<1024>();
  uint32_t* sorted = reinterpret_cast<uint32_t*>(smem + DN_STAGES * DN_STAGE);  // [UB * ROW_CAP]
  uint32_t* offs = sorted + UB * ROW_CAP;                                        // [MAX_SLOT]
  uint32_t* bucket = offs + MAX_SLOT;                                            // [MAX_SLOT / DK + 4]
  uint32_t* nrow = bucket + MAX_SLOT / DK + 4;                                   // [UB]
  uint64_t* full = reinterpret_cast<uint64_t*>(nrow + UB);
  uint64_t* empty = full + DN_STAGES;
  init_ring(full, empty, DN_STAGES, 128);  // 64 cp.async issuers + 64 row builders

  const int wg = threadIdx.x / 128;
  int stage = 0;

  if (wg == 0) {
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    uint32_t phase = 1;
    for (int it = it0; it < it1; ++it) {
      const auto [b, n_union, r0] = union_block(p, it / n_items);
      const int steps = (n_union + DK - 1) / DK, col0 = (it % n_items) * DCHUNK;
      if (it == it0 || it % n_items == 0) {  // a block's first item in this CTA's run
        // Staged once per block by all producer threads (before, the gatherers unpacked a
        // 16-bit id and did 64-bit address arithmetic per copy, and each builder walked its own row's
        // entries with a cursor, one dependent, bank-conflicted shared load per entry):
        // - offs: the byte offset of each union row in w_down_t, 0 past the union;
        // - sorted: the block's entries bucketed by stage (rank / DK), each packed as
        //   h << 16 | row << 5 | rank % DK; bucket[k] ends stage k's bucket, which starts at
        //   bucket[k - 1] (0 for k = 0). Counting sort with shared atomics: the order inside a bucket
        //   does not matter, each (row, rank) is written once.
        const uint4* U4 = reinterpret_cast<const uint4*>(p.w.ulist + size_t(b) * ulist_slot(p.H));
        for (int i = t; i < (n_union + 7) / 8; i += 128) {
          const uint4 v = __ldg(U4 + i);
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
          uint32_t o[8];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            o[j] = 8 * i + j < n_union ? ((w[j / 2] >> (16 * (j % 2))) & 0xFFFFu) * uint32_t(p.D) * 2u : 0u;
          reinterpret_cast<uint4*>(offs)[2 * i] = make_uint4(o[0], o[1], o[2], o[3]);
          reinterpret_cast<uint4*>(offs)[2 * i + 1] = make_uint4(o[4], o[5], o[6], o[7]);
        }
        for (int i = t; i < steps; i += 128) bucket[i] = 0;
        if (t < UB) {
          const uint32_t n = p.w.rowcnt[size_t(b) * UB + t];
          nrow[t] = n == NOT_HERE ? 0u : n;
        }
        asm volatile("bar.sync 3, 128;" ::: "memory");
        // Warp w takes rows w + 4 j (j < 16); lane l holds entry l of each in w[j] (all loads issued
        // before any is used), later entries of long rows are read again where needed. Pass 1
        // counts, pass 2 places.
        constexpr int RPW = UB / 4;  // rows per warp
        uint32_t w[RPW];
#pragma unroll
        for (int j = 0; j < RPW; ++j)
          w[j] = uint32_t(lane) < nrow[warp + 4 * j] ? __ldg(p.w.ent + size_t(r0 + warp + 4 * j) * ROW_CAP + lane) : 0u;
        auto each_entry = [&](auto f) {
#pragma unroll
          for (int j = 0; j < RPW; ++j) {
            const int r = warp + 4 * j;
            const uint32_t n = nrow[r];
            if (uint32_t(lane) < n) f(r, w[j]);
            for (uint32_t e = lane + 32; e < n; e += 32) f(r, __ldg(p.w.ent + size_t(r0 + r) * ROW_CAP + e));
          }
        };
        each_entry([&](int, uint32_t v) { atomicAdd(&bucket[(v & 0xFFFFu) / DK], 1u); });
        asm volatile("bar.sync 3, 128;" ::: "memory");
        if (warp == 0) {  // exclusive scan of the counts (steps <= MAX_SLOT / DK = 8 per lane)
          constexpr int PER = MAX_SLOT / DK / 32;
          uint32_t c[PER], sum = 0;
#pragma unroll
          for (int j = 0; j < PER; ++j) {
            c[j] = lane * PER + j < steps ? bucket[lane * PER + j] : 0u;
            sum += c[j];
          }
          uint32_t run = warp_incl_scan(sum, lane) - sum;
#pragma unroll
          for (int j = 0; j < PER; ++j) {
            if (lane * PER + j < steps) bucket[lane * PER + j] = run;
            run += c[j];
          }
        }
        asm volatile("bar.sync 3, 128;" ::: "memory");
        each_entry([&](int r, uint32_t v) {
          const uint32_t rank = v & 0xFFFFu;
          sorted[atomicAdd(&bucket[rank / DK], 1u)] = (v & 0xFFFF0000u) | uint32_t(r) << 5 | rank % DK;
        });
        asm volatile("bar.sync 3, 128;" ::: "memory");  // producer warpgroup only
      }
      if (t < UB) {
        // Row builders: A of each stage = h at the stage's DK union columns, zeros elsewhere
        // (128-byte swizzled rows of which the first DK columns are used). Thread t zeroes row t,
        // then the 64 place the stage's bucket.
        for (int kb = 0; kb < steps; ++kb) {
          mbar_wait(&empty[stage], phase);
          uint8_t* base = smem + stage * DN_STAGE;
          uint4* row = reinterpret_cast<uint4*>(base + t * 128);
#pragma unroll
          for (int c = 0; c < DK / 8; ++c) row[c ^ (t & 7)] = make_uint4(0, 0, 0, 0);  // the chunks MMAs read
          asm volatile("bar.sync 4, 64;" ::: "memory");  // the builders: zeros before any entry
          const uint32_t e1 = bucket[kb];
          for (uint32_t e = (kb ? bucket[kb - 1] : 0u) + t; e < e1; e += UB) {
            const uint32_t w = sorted[e], r = (w >> 5) & (UB - 1), col = w & (DK - 1);
            *reinterpret_cast<uint16_t*>(base + swz(int(r), int(col >> 3)) + (col & 7) * 2) = uint16_t(w >> 16);
          }
          fence_async_smem();
          mbar_arrive(&full[stage]);
          if (++stage == DN_STAGES) { stage = 0; phase ^= 1; }
        }
      } else {
        // Gatherer: 16-byte chunk cc = t - 64 (of the item's 512 columns) of the stage's DK union rows.
        // MN-major 128B-swizzled operand: warpgroup half hw = cc / 32, atom (64 columns) at = cc % 32 / 8
        // every DK * 128 bytes, K row kk at (kk / 8) * 1 KB + (kk % 8) * 128.
        const int cc = t - UB, hw = cc / 32, at = (cc % 32) / 8, ch = cc % 8;
        const char* src0 = reinterpret_cast<const char*>(p.w_down_t + col0 + cc * 8);
        const uint32_t offs_s = smem_u32(offs);
        for (int kb = 0; kb < steps; ++kb) {
          mbar_wait(&empty[stage], phase);
          const uint32_t bsm = smem_u32(smem + stage * DN_STAGE) + A_BYTES + hw * (DN_B_BYTES / 2) + at * (DK * 128);
          // The stage's DK row offsets in 8 shared loads (the same for every gatherer: broadcast),
          // then one add and one copy per row. Rows past the union are zero-filled.
          const int rem = n_union - kb * DK;
          uint4 v[DK / 4];
#pragma unroll
          for (int i = 0; i < DK / 4; ++i) v[i] = lds128(offs_s + (kb * DK + 4 * i) * 4);
#pragma unroll
          for (int kk = 0; kk < DK; ++kk) {
            const uint32_t w[4] = {v[kk / 4].x, v[kk / 4].y, v[kk / 4].z, v[kk / 4].w};
            cp_async16(bsm + swz(kk, ch), src0 + w[kk % 4], kk < rem);
          }
          cp_async_arrive(&full[stage]);
          if (++stage == DN_STAGES) { stage = 0; phase ^= 1; }
        }
      }
      // The next block's staging rewrites offs, sorted and bucket: every producer thread is done reading them.
      if (it + 1 < it1 && (it + 1) % n_items == 0) asm volatile("bar.sync 3, 128;" ::: "memory");
    }
    return;
  }

  const int g = wg - 1, ct = threadIdx.x - 128 * wg;
  const int warp = ct / 32, lane = ct % 32, q = lane % 4;
  uint32_t phase = 0;
  float acc[128];
  for (int it = it0; it < it1; ++it) {
    const auto [b, n_union, r0] = union_block(p, it / n_items);
    const int steps = (n_union + DK - 1) / DK, col0 = (it % n_items) * DCHUNK;
    // B descriptor: K step k (16 rows) starts 2 KB further; atoms along N DK * 128 bytes apart.
    mma_loop<1, DK / 16, DN_STAGES, DN_STAGE, DN_B_BYTES / 2>(
        acc, steps, smem, full, empty, stage, phase, g, lane,
        [](uint32_t bb, int k) { return smem_desc(bb + 2048 * k, DK * 128, 1024); });
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * warp + lane / 4 + 8 * hf;
      if (r0 + r >= p.M || p.w.rowcnt[size_t(b) * UB + r] == NOT_HERE) continue;
      __nv_bfloat16* o = p.out + size_t(r0 + r) * p.D + col0 + g * NW + 2 * q;
#pragma unroll
      for (int i = 0; i < 32; ++i)
        *reinterpret_cast<__nv_bfloat162*>(o + 8 * i) =
            __floats2bfloat162_rn(acc[4 * i + 2 * hf], acc[4 * i + 2 * hf + 1]);
    }
  }
}

}  // namespace uni

std::string union_unsupported(int D, int H, bool gated) {
  if (!gated) return "the union path serves gated layers only";
  if (D <= 0 || D % uni::DCHUNK != 0 || D > 2048)  // 2048: the fused kernel's own limit
    return "the union path needs D a positive multiple of " + std::to_string(uni::DCHUNK) +
           " and at most 2048, got D = " + std::to_string(D);
  if (H <= 0 || uni::ulist_slot(H) > uni::MAX_SLOT)  // the down kernel keeps a block's union row offsets in smem
    return "the union path needs 0 < H <= " + std::to_string(uni::MAX_SLOT) + ", got H = " + std::to_string(H);
  return "";
}

bool union_supported(int D, int H, bool gated) { return union_unsupported(D, H, gated).empty(); }

size_t union_workspace_words(int M, int H) {
  const size_t nb = (size_t(M) + uni::UB - 1) / uni::UB;
  auto up4 = [](size_t w) { return (w + 3) & ~size_t(3); };
  return up4(2) + up4(M) + 2 * up4(nb) + up4(nb * uni::UB) + up4(nb * uni::ulist_slot(H) / 2) +
         nb * uni::UB * uni::ROW_CAP;
}

Workspace union_workspace(uint32_t* base, int M, int H) {
  const size_t nb = (size_t(M) + uni::UB - 1) / uni::UB;
  auto up4 = [](size_t w) { return (w + 3) & ~size_t(3); };
  Workspace w;
  w.ctr = base;
  w.light_rows = w.ctr + up4(2);
  w.ublocks = w.light_rows + up4(M);
  w.usize = w.ublocks + up4(nb);
  w.rowcnt = w.usize + up4(nb);
  w.ulist = reinterpret_cast<uint16_t*>(w.rowcnt + up4(nb * uni::UB));
  w.ent = reinterpret_cast<uint32_t*>(w.ulist) + up4(nb * uni::ulist_slot(H) / 2);
  return w;
}

// Plan, then (after the caller's per-row kernel on the rows left to it) up and down.
cudaError_t launch_union_plan(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                              const void* w_down_t, void* out, const Workspace& w, int M, int D, int H, int n_tiles,
                              int S, float ratio, float base, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(w.ctr, 0, 2 * sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  const int nb = (M + uni::UB - 1) / uni::UB;
  uni::Params p{static_cast<const __nv_bfloat16*>(x), tw, spill, static_cast<const __nv_bfloat16*>(w_up),
                static_cast<const __nv_bfloat16*>(w_down_t), static_cast<__nv_bfloat16*>(out), w, M, D, H, n_tiles,
                S, nb, ratio, base};
  uni::plan_kernel<<<nb, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_union_mma(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                             const void* w_down_t, void* out, const Workspace& w, int M, int D, int H, int n_tiles,
                             int S, cudaStream_t stream) {
  const int nb = (M + uni::UB - 1) / uni::UB;
  uni::Params p{static_cast<const __nv_bfloat16*>(x), tw, spill, static_cast<const __nv_bfloat16*>(w_up),
                static_cast<const __nv_bfloat16*>(w_down_t), static_cast<__nv_bfloat16*>(out), w, M, D, H, n_tiles,
                S, nb, 0.f, 0.f};
  cudaError_t err = cudaFuncSetAttribute(uni::up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, uni::UP_SMEM);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(uni::down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, uni::DOWN_SMEM);
  if (err != cudaSuccess) return err;
  // Persistent grids (one CTA per SM): the kernels read the number of union blocks on the device.
  int dev = 0, sms = 0;
  err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  uni::up_kernel<<<std::min(nb, sms), 384, uni::UP_SMEM, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  uni::down_kernel<<<std::min(nb * (D / uni::DCHUNK), sms), 384, uni::DOWN_SMEM, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace twell
