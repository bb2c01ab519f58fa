// Weight-stationary sparse up/down projection (v7), gated FFN, inference.
//
// The per-row kernel (twell_ffn.cu) moves two 4 KB weight rows from L2 per (token, active neuron)
// and sits at the L2 gather ceiling (~7.5 TB/s): 2.1 ms at nnz 29, M = 65536. Here the weights stay
// in shared memory and the tokens stream past them, so weight traffic no longer grows with nnz:
//   plan:     per row, its entries (TwELL -> ELL, at most ROW_CAP; heavier rows and unresolved
//             overflows go to the per-row kernels); per block of PB rows and quarter of H, the
//             list of (row, entry) pairs whose neuron lies in that quarter;
//   up:       CTA (d-chunk c of 64 columns, quarter q) holds w_up[q, c] (R x 128 B) and computes
//             each listed pair's partial dot product over its 64 columns. The pairs are split
//             evenly over 8-lane groups (a heavy row costs no imbalance); each lane group reads a
//             whole 128-byte weight row per pair, so shared-memory reads are conflict-free. The
//             CL CTAs of a cluster (consecutive d-chunks) sum their partials through DSMEM in rank
//             order, NP = D / (64 CL) partials per pair remain;
//   finalize: h = bf16(gate * bf16(sum of the NP partials)), written over the entry's gate value;
//   down:     CTA (16 output columns) holds w_down_t[:, c] (H x 32 B); a warp takes a token, its
//             16 lane pairs split the token's entries and reduce by shuffles.
// Rounding as in the dense bf16 FFN: u and h rounded to bf16, all sums in fp32; every sum has a
// fixed order (the result does not depend on scheduling).
#include "common.cuh"
#include "twell_kernels.h"

namespace twell {
namespace st {

constexpr int ROW_CAP = 128;         // entries per row on this path
constexpr int PB = 256;              // rows per plan block: one pair list per block and quarter
constexpr int MAX_NQ = 8;            // quarters (H slices) at most
constexpr int RQ_MAX = 1408;         // neurons per up tile: 1408 x 128 B = 176 KB
constexpr int UP_THREADS = 512;      // 64 lane groups of 8
constexpr int SUB = 2048;            // pairs per up sub-chunk (one cluster exchange each)
constexpr int NBUF = 3;              // exchange buffers: a peer may still read the one before last
constexpr int DN_THREADS = 512;
constexpr int DN_COLS = 16;          // output columns per down CTA (32-byte weight rows)
constexpr int DN_MAX_H = 6400;       // down tile H x 32 B <= 200 KB
constexpr int NPF = 4;               // entry words per lane prefetched per token (64 entries)

struct Params {
  const __nv_bfloat16* x;
  const uint32_t* tw;
  const uint32_t* spill;  // may be null
  const __nv_bfloat16* w_up;
  const __nv_bfloat16* w_down_t;
  __nv_bfloat16* out;
  StWorkspace w;
  int M, D, H, n_tiles, S;
  int NQ, R, n_blocks, CL;
};

struct Geometry {
  int NQ, R, CL, NP;
};

inline Geometry geometry(int D, int H) {
  Geometry g;
  g.NQ = (H + RQ_MAX - 1) / RQ_MAX;
  g.R = ((H + g.NQ - 1) / g.NQ + 7) & ~7;
  const int nd = D / 64;
  g.CL = nd % 8 == 0 ? 8 : nd % 4 == 0 ? 4 : nd % 2 == 0 ? 2 : 1;
  g.NP = nd / g.CL;
  return g;
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// A float in the shared memory of cluster CTA `rank`, at the address `local` has here.
__device__ __forceinline__ float ld_peer(uint32_t local, uint32_t rank) {
  uint32_t a;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// plan: one CTA (8 warps) per block of PB rows.
__global__ void __launch_bounds__(256) plan_kernel(const Params p) {
  __shared__ uint32_t cq[PB][MAX_NQ];  // entries per row and quarter, then the row's offset
  __shared__ uint32_t rown[PB];
  __shared__ uint32_t seg_start[MAX_NQ];
  const int b = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < PB * MAX_NQ; i += blockDim.x) (&cq[0][0])[i] = 0;
  __syncthreads();

  for (int rr = warp; rr < PB; rr += 8) {
    const int row = b * PB + rr;
    uint32_t n_row = NOT_HERE;
    if (row < p.M) {
      uint32_t* ent = p.w.ent + size_t(row) * ROW_CAP;
      const int n = row_entries<ROW_CAP>(ent, p.tw + size_t(row) * p.n_tiles * p.S, p.spill, p.n_tiles, p.S, lane);
      if (n >= 0) {
        for (int i = lane; i < n; i += 32) atomicAdd(&cq[rr][entry_col(ent[i]) / p.R], 1u);
        n_row = uint32_t(n);
      } else if (lane == 0) {
        p.w.light_rows[atomicAdd(p.w.ctr, 1u)] = uint32_t(row);
      }
      if (lane == 0) p.w.rowcnt[row] = n_row;
    }
    if (lane == 0) rown[rr] = n_row;
  }
  __syncthreads();

  // Per quarter (warp q): exclusive prefix over the block's rows and the segment of the block.
  if (warp < p.NQ) {
    constexpr int PER = PB / 32;
    uint32_t v[PER], s = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      v[j] = cq[lane * PER + j][warp];
      s += v[j];
    }
    const uint32_t incl = warp_incl_scan(s, lane);
    uint32_t run = incl - s;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      cq[lane * PER + j][warp] = run;
      run += v[j];
    }
    if (lane == 31) {
      const uint32_t start = incl ? atomicAdd(p.w.ctr + 1, incl) : 0u;
      seg_start[warp] = start;
      p.w.seg[2 * (size_t(b) * p.NQ + warp)] = start;
      p.w.seg[2 * (size_t(b) * p.NQ + warp) + 1] = incl;
    }
  }
  __syncthreads();

  // Place the pairs: a quarter's pairs in row order, a row's in entry order.
  for (int rr = warp; rr < PB; rr += 8) {
    const uint32_t n = rown[rr];
    if (n == NOT_HERE) continue;
    const uint32_t row = uint32_t(b * PB + rr);
    const uint32_t* ent = p.w.ent + size_t(row) * ROW_CAP;
    uint32_t placed[MAX_NQ];
#pragma unroll
    for (int q = 0; q < MAX_NQ; ++q) placed[q] = 0;
    for (uint32_t base = 0; base < n; base += 32) {
      const uint32_t i = base + lane;
      const uint32_t qi = i < n ? entry_col(ent[i]) / p.R : MAX_NQ;
#pragma unroll
      for (int q = 0; q < MAX_NQ; ++q) {
        if (q >= p.NQ) break;
        const uint32_t bal = __ballot_sync(0xffffffffu, qi == uint32_t(q));
        if (qi == uint32_t(q)) {
          const uint32_t pos = seg_start[q] + cq[rr][q] + placed[q] + __popc(bal & ((1u << lane) - 1));
          p.w.qpair[pos] = (row << 7) | i;
          p.w.qcol[pos] = uint16_t(entry_col(ent[i]));
        }
        placed[q] += __popc(bal);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// up: CTA (blockIdx.x = d-chunk of 64 columns, blockIdx.y = quarter), clusters of CL d-chunks.
__device__ __forceinline__ void unpack8(float* f, const uint4& v) {
  f[0] = bf16lo(v.x); f[1] = bf16hi(v.x);
  f[2] = bf16lo(v.y); f[3] = bf16hi(v.y);
  f[4] = bf16lo(v.z); f[5] = bf16hi(v.z);
  f[6] = bf16lo(v.w); f[7] = bf16hi(v.w);
}

// Partial dot products of pairs [0, m) of the list at s0 into buf; lane group lg takes a run of
// `per` consecutive pairs (consecutive pairs mostly share a row, so x is reloaded rarely).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Pair j's row and neuron (relative to the tile), loaded one batch ahead.
__device__ __forceinline__ void pair_meta(uint32_t& t, uint32_t& nl, uint32_t s, bool valid, const Params& p, int n0) {
  t = valid ? p.w.qpair[s] >> 7 : 0u;
  nl = valid ? uint32_t(p.w.qcol[s]) - n0 : 0u;
}

__device__ __forceinline__ void up_compute(float* buf, uint32_t s0, uint32_t m, const Params& p, uint32_t tile,
                                           int n0, int c, int tid) {
  const int li = tid & 7, lg = tid >> 3;
  const uint32_t gmask = 0xFFu << (tid & 24);
  const uint32_t per = ((m + 63) / 64 + 7) & ~7u;
  const uint32_t lo = lg * per, hi = min(m, lo + per);
  const __nv_bfloat16* xb = p.x + c * 64 + li * 8;
  uint32_t t, nl;
  pair_meta(t, nl, s0 + lo + li, lo + li < hi, p, n0);
  for (uint32_t i0 = lo; i0 < hi; i0 += 8) {
    const uint32_t j = i0 + li;
    uint32_t tk[8], nk[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      tk[k] = __shfl_sync(gmask, t, k, 8);
      nk[k] = __shfl_sync(gmask, nl, k, 8);
    }
    uint4 xr[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (i0 + k < hi && (k == 0 || tk[k] != tk[k - 1])) xr[k] = ldg_nc(xb + size_t(tk[k]) * p.D);
    // Next batch: its pairs' metadata now, and its x rows into L2 (hidden behind this batch's math).
    pair_meta(t, nl, s0 + j + 8, j + 8 < hi, p, n0);
    if (j + 8 < hi) prefetch_l2(p.x + size_t(t) * p.D + c * 64);
    float v[8], xf[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = 0.f;
      if (i0 + k < hi) {
        if (k == 0 || tk[k] != tk[k - 1]) unpack8(xf, xr[k]);
        v[k] = dot8(xf, lds128(tile + nk[k] * 128 + li * 16));
      }
    }
    // Transpose-reduce over the 8 lanes: lane li ends with the sum of pair i0 + li.
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const bool up = li & 4;
      const float send = up ? v[s] : v[s + 4];
      v[s] = (up ? v[s + 4] : v[s]) + __shfl_xor_sync(gmask, send, 4, 8);
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const bool up = li & 2;
      const float send = up ? v[s] : v[s + 2];
      v[s] = (up ? v[s + 2] : v[s]) + __shfl_xor_sync(gmask, send, 2, 8);
    }
    {
      const bool up = li & 1;
      const float send = up ? v[0] : v[1];
      v[0] = (up ? v[1] : v[0]) + __shfl_xor_sync(gmask, send, 1, 8);
    }
    if (j < hi) buf[j] = v[0];
  }
}

// Sum sub-chunk (s0, m)'s partials over the cluster's CTAs (rank order): this CTA takes a 1/CL slice.
__device__ __forceinline__ void up_reduce(uint32_t buf, uint32_t s0, uint32_t m, const Params& p, uint32_t rank,
                                          int cl, int tid) {
  const uint32_t per = (m + p.CL - 1) / p.CL, lo = rank * per, hi = min(m, lo + per);
  float* part = p.w.part + size_t(cl) * size_t(p.M) * ROW_CAP + s0;
  for (uint32_t i = lo + tid; i < hi; i += UP_THREADS) {
    float s = 0.f;
    for (int r = 0; r < p.CL; ++r) s += ld_peer(buf + 4 * i, uint32_t(r));
    part[i] = s;
  }
}

__global__ void __launch_bounds__(UP_THREADS, 1) up_kernel(const Params p) {
  uint8_t* tile = aligned_smem<128>();
  float* red = reinterpret_cast<float*>(tile + size_t(p.R) * 128);  // same offset in every CTA
  const int c = blockIdx.x, q = blockIdx.y, tid = threadIdx.x, cl = c / p.CL;
  const uint32_t rank = cluster_rank();
  const int n0 = q * p.R;
  for (int i = tid; i < p.R * 8; i += UP_THREADS) {
    const int r = i >> 3, k = i & 7, n = n0 + r;
    const bool valid = n < p.H;
    cp_async16(smem_u32(tile + r * 128 + k * 16), p.w_up + size_t(valid ? n : 0) * p.D + c * 64 + k * 8, valid);
  }
  cp_async_wait_all();
  cluster_arrive();  // tiles loaded; every CTA of the cluster has started (before any DSMEM access)
  cluster_wait();

  const uint32_t tile_a = smem_u32(tile), red_a = smem_u32(red);
  // Sub-chunk k: compute(k) -> [wait for k-1's exchange, reduce(k-1)] -> arrive(k). A peer may still
  // be reducing k-1 while this CTA computes k+1, so k+1 writes the third buffer.
  uint32_t k = 0, prev_s0 = 0, prev_m = 0;
  for (int b = 0; b < p.n_blocks; ++b) {
    const uint32_t s_start = p.w.seg[2 * (size_t(b) * p.NQ + q)], s_cnt = p.w.seg[2 * (size_t(b) * p.NQ + q) + 1];
    for (uint32_t sub = 0; sub < s_cnt; sub += SUB) {
      const uint32_t m = min(uint32_t(SUB), s_cnt - sub), s0 = s_start + sub;
      up_compute(red + (k % NBUF) * SUB, s0, m, p, tile_a, n0, c, tid);
      if (k > 0) {
        cluster_wait();
        up_reduce(red_a + ((k - 1) % NBUF) * SUB * 4, prev_s0, prev_m, p, rank, cl, tid);
      }
      cluster_arrive();
      prev_s0 = s0;
      prev_m = m;
      ++k;
    }
  }
  if (k > 0) {
    cluster_wait();
    up_reduce(red_a + ((k - 1) % NBUF) * SUB * 4, prev_s0, prev_m, p, rank, cl, tid);
    cluster_arrive();
  }
  cluster_wait();  // no CTA leaves while a peer may still read its buffers
}

// ---------------------------------------------------------------------------------------------
// finalize: h = bf16(gate * bf16(u)) over every listed pair.
__global__ void finalize_kernel(const Params p, int NP) {
  const uint32_t total = *reinterpret_cast<const volatile uint32_t*>(p.w.ctr + 1);
  const size_t cap = size_t(p.M) * ROW_CAP;
  for (uint32_t s = blockIdx.x * blockDim.x + threadIdx.x; s < total; s += gridDim.x * blockDim.x) {
    const uint32_t w = p.w.qpair[s];
    uint32_t* e = p.w.ent + size_t(w >> 7) * ROW_CAP + (w & 127);
    float u = 0.f;
    for (int j = 0; j < NP; ++j) u += p.w.part[j * cap + s];
    const uint32_t g = *e;
    const __nv_bfloat16 h = __float2bfloat16_rn(entry_value(g) * __bfloat162float(__float2bfloat16_rn(u)));
    *e = (uint32_t(__bfloat16_as_ushort(h)) << 16) | entry_col(g);
  }
}

// ---------------------------------------------------------------------------------------------
// down: CTA c holds w_down_t[:, 16c .. 16c + 16); warp w takes rows in batches of 32 (batch
// w, w + 16, ...). Lane = 2 * (lane pair) + half: lane pair lp takes entries lp, lp + 16, ...,
// half selects 8 of the 16 columns.
__device__ __forceinline__ void load_entries(uint32_t (&e)[NPF], const Params& p, int row, uint32_t n, int lp) {
#pragma unroll
  for (int j = 0; j < NPF; ++j) {
    const uint32_t k = uint32_t(lp + 16 * j);
    e[j] = n != NOT_HERE && k < n ? __ldg(p.w.ent + size_t(row) * ROW_CAP + k) : 0u;
  }
}

__global__ void __launch_bounds__(DN_THREADS, 1) down_kernel(const Params p) {
  uint8_t* tile = aligned_smem<128>();
  const int c = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < p.H * 2; i += DN_THREADS) {
    const int n = i >> 1, k = i & 1;
    cp_async16(smem_u32(tile + n * 32 + k * 16), p.w_down_t + size_t(n) * p.D + c * DN_COLS + k * 8, true);
  }
  cp_async_wait_all();
  __syncthreads();
  const uint32_t tile_a = smem_u32(tile) + (lane & 1) * 16;
  const int lp = lane >> 1;
  constexpr int WARPS = DN_THREADS / 32, G = 4;  // rows per prefetch group
  uint32_t cnt_next = warp * 32 + lane < p.M ? __ldg(p.w.rowcnt + warp * 32 + lane) : NOT_HERE;
  for (int base = warp * 32; base < p.M; base += WARPS * 32) {
    const uint32_t cnt_l = cnt_next;
    const int nb = base + WARPS * 32 + lane;
    cnt_next = nb < p.M ? __ldg(p.w.rowcnt + nb) : NOT_HERE;
    uint32_t cur[G][NPF], nxt[G][NPF];
#pragma unroll
    for (int j = 0; j < G; ++j) load_entries(cur[j], p, base + j, __shfl_sync(0xffffffffu, cnt_l, j), lp);
    for (int g0 = 0; g0 < 32; g0 += G) {
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int i = (g0 + G + j) & 31;  // the last group loads the first again, unused
        load_entries(nxt[j], p, base + i, __shfl_sync(0xffffffffu, cnt_l, i), lp);
      }
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int row = base + g0 + j;
        const uint32_t n = __shfl_sync(0xffffffffu, cnt_l, g0 + j);
        if (n == NOT_HERE) continue;  // also rows past M
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = 0.f;
#pragma unroll
        for (int q = 0; q < NPF; ++q)
          if (uint32_t(lp + 16 * q) < n) axpy8(acc, entry_value(cur[j][q]), lds128(tile_a + entry_col(cur[j][q]) * 32));
        for (uint32_t k = lp + 16 * NPF; k < n; k += 16) {
          const uint32_t e = __ldg(p.w.ent + size_t(row) * ROW_CAP + k);
          axpy8(acc, entry_value(e), lds128(tile_a + entry_col(e) * 32));
        }
        // Sum over the 16 lane pairs (lane bits 1..4); lane ends with column 8 half + 4 b4 + 2 b3 + b2.
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const bool up = lane & 16;
          const float send = up ? acc[s] : acc[s + 4];
          acc[s] = (up ? acc[s + 4] : acc[s]) + __shfl_xor_sync(0xffffffffu, send, 16);
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const bool up = lane & 8;
          const float send = up ? acc[s] : acc[s + 2];
          acc[s] = (up ? acc[s + 2] : acc[s]) + __shfl_xor_sync(0xffffffffu, send, 8);
        }
        {
          const bool up = lane & 4;
          const float send = up ? acc[0] : acc[1];
          acc[0] = (up ? acc[1] : acc[0]) + __shfl_xor_sync(0xffffffffu, send, 4);
        }
        acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], 2);
        if (!(lane & 2)) {
          const int col = c * DN_COLS + (lane & 1) * 8 + ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
          p.out[size_t(row) * p.D + col] = __float2bfloat16_rn(acc[0]);
        }
      }
#pragma unroll
      for (int j = 0; j < G; ++j)
#pragma unroll
        for (int q = 0; q < NPF; ++q) cur[j][q] = nxt[j][q];
    }
  }
}

inline int up_smem(int R) { return R * 128 + NBUF * SUB * 4 + 128; }
inline int down_smem(int H) { return H * 32 + 128; }

}  // namespace st

bool stationary_supported(int D, int H, bool gated) {
  return gated && D % 64 == 0 && H <= st::DN_MAX_H && (H + st::RQ_MAX - 1) / st::RQ_MAX <= st::MAX_NQ;
}

bool stationary_used(int mode, int D, int H, bool gated) { return mode == 1 && stationary_supported(D, H, gated); }

static size_t up4(size_t w) { return (w + 3) & ~size_t(3); }

size_t stationary_workspace_words(int M, int D, int H) {
  const st::Geometry g = st::geometry(D, H);
  const size_t nb = (size_t(M) + st::PB - 1) / st::PB, cap = size_t(M) * st::ROW_CAP;
  return up4(2) + 2 * up4(M) + up4(2 * nb * g.NQ) + 2 * cap + cap / 2 + size_t(g.NP) * cap;
}

StWorkspace stationary_workspace(uint32_t* base, int M, int D, int H) {
  const st::Geometry g = st::geometry(D, H);
  const size_t nb = (size_t(M) + st::PB - 1) / st::PB, cap = size_t(M) * st::ROW_CAP;
  StWorkspace w;
  w.ctr = base;
  w.light_rows = w.ctr + up4(2);
  w.rowcnt = w.light_rows + up4(M);
  w.seg = w.rowcnt + up4(M);
  w.ent = w.seg + up4(2 * nb * g.NQ);
  w.qpair = w.ent + cap;
  w.qcol = reinterpret_cast<uint16_t*>(w.qpair + cap);
  w.part = reinterpret_cast<float*>(w.qpair + cap + cap / 2);
  return w;
}

static st::Params st_params(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                            const void* w_down_t, void* out, const StWorkspace& w, int M, int D, int H, int n_tiles,
                            int S) {
  const st::Geometry g = st::geometry(D, H);
  return st::Params{static_cast<const __nv_bfloat16*>(x), tw, spill, static_cast<const __nv_bfloat16*>(w_up),
                    static_cast<const __nv_bfloat16*>(w_down_t), static_cast<__nv_bfloat16*>(out), w, M, D, H,
                    n_tiles, S, g.NQ, g.R, (M + st::PB - 1) / st::PB, g.CL};
}

cudaError_t launch_stationary_plan(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                                   const void* w_down_t, void* out, const StWorkspace& w, int M, int D, int H,
                                   int n_tiles, int S, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(w.ctr, 0, 2 * sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  const st::Params p = st_params(x, tw, spill, w_up, w_down_t, out, w, M, D, H, n_tiles, S);
  st::plan_kernel<<<p.n_blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_stationary_products(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                                       const void* w_down_t, void* out, const StWorkspace& w, int M, int D, int H,
                                       int n_tiles, int S, int device, cudaStream_t stream) {
  const st::Params p = st_params(x, tw, spill, w_up, w_down_t, out, w, M, D, H, n_tiles, S);
  const st::Geometry g = st::geometry(D, H);
  const int us = st::up_smem(p.R), ds = st::down_smem(H);
  cudaError_t err = cudaFuncSetAttribute(st::up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, us);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(st::down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ds);
  if (err != cudaSuccess) return err;

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(D / 64, p.NQ, 1);
  cfg.blockDim = dim3(st::UP_THREADS, 1, 1);
  cfg.dynamicSmemBytes = us;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = p.CL;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  err = cudaLaunchKernelEx(&cfg, st::up_kernel, p);
  if (err != cudaSuccess) return err;

  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  st::finalize_kernel<<<2 * sms, 512, 0, stream>>>(p, g.NP);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  st::down_kernel<<<D / st::DN_COLS, st::DN_THREADS, ds, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace twell
