// Hardware probe for a weight-stationary design (not part of the extension): how fast can the
// CUDA cores run the two inner loops when the weights sit in shared memory and each thread owns
// one token row? This is the roof that decides whether a stationary path can beat the per-row
// kernel (which is bound by L2 gathers, csrc/NOTES.md).
//
// Layout probed (one CTA per SM, 512 threads, 128 CTAs = 32 column chunks x 4 slices of H):
//   - the CTA holds W[slice of 1408 neurons, 64 columns] bf16 (176 KB) in shared memory;
//   - each thread takes one row and its entries in the slice (ELL, CAP slots, read 4 at a time);
//   - a row's 128-byte weight chunk is read as 8 x 16 bytes starting at (lane + i) % 8: threads of a
//     quarter-warp start on different banks, so random rows do not conflict;
//   - down: acc[64] += h * W[n, :] for every entry; up: u = x[row, chunk] . W[n, :] per entry (x
//     chunk loaded once per row, same rotation).
// Also the down loop on the tensor cores (mma_down_kernel, see there): plain, rotated rows, and rotated
// rows with each 8-record run packed to 8 distinct residues mod 8 (conflict-free gathers).
// Results are folded into a checksum (no stores): this times the loops only, not the reductions
// across slices / chunks that a full design adds.
// Rows of a 512-row block are optionally sorted by entry count (a warp then runs rows of similar
// length instead of the longest of 32 random ones); entries and counts are stored in that order and
// loaded one block ahead.
//
// Build (in scripts/probes, next to stationary_probe.cuh):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o stationary_loop stationary_loop.cu
// Prints: case, mean and max entries per (row, slice), ms per loop, and MAC per clock per SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "stationary_probe.cuh"

__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

struct P {
  const uint4* tiles;       // [NQ * NC] tiles of TILE_BYTES
  const uint32_t* ent;      // [NQ][M][cap], in processing order
  const uint8_t* cnt;       // [NQ][M], in processing order
  const uint32_t* order;    // [NQ][M]: the row at each position (x of that row for up)
  const __nv_bfloat16* x;   // [M][D]
  int cap;
  float* sink;
};

template <bool UP>
__global__ void __launch_bounds__(THREADS, 1) loop_kernel(const P p) {
  const int q = blockIdx.x % NQ, c = blockIdx.x / NQ;
  const uint32_t tile = load_tile(p.tiles, q, c);
  const int lane = threadIdx.x % 32;
  uint32_t rot[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) rot[i] = 16 * ((lane + i) & 7);
  float chk = 0.f;
  // The next block's row, count and first entries are loaded a block ahead (their latency would
  // otherwise stall every warp at every block: three dependent L2 round trips).
  size_t pos = size_t(q) * M + threadIdx.x;
  uint32_t row_n = p.order[pos];
  int cnt_n = p.cnt[pos];
  uint4 e_n = __ldg(reinterpret_cast<const uint4*>(p.ent + pos * p.cap));
  for (int base = 0; base < M; base += THREADS, pos += THREADS) {
    const uint32_t row = row_n;
    const int n = cnt_n;
    const uint4* e4 = reinterpret_cast<const uint4*>(p.ent + pos * p.cap);
    uint4 nxt = e_n;
    if (base + THREADS < M) {
      row_n = p.order[pos + THREADS];
      cnt_n = p.cnt[pos + THREADS];
      e_n = __ldg(reinterpret_cast<const uint4*>(p.ent + (pos + THREADS) * p.cap));
    }
    float x[64];
    if (UP) {
      const __nv_bfloat16* xr = p.x + size_t(row) * D + c * DC;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(xr) + rot[i]));
        x[8 * i + 0] = lo(v.x); x[8 * i + 1] = hi(v.x); x[8 * i + 2] = lo(v.y); x[8 * i + 3] = hi(v.y);
        x[8 * i + 4] = lo(v.z); x[8 * i + 5] = hi(v.z); x[8 * i + 6] = lo(v.w); x[8 * i + 7] = hi(v.w);
      }
    }
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    for (int g = 0; g < n; g += 4) {
      const uint4 cur = nxt;
      if (g + 4 < n) nxt = __ldg(e4 + g / 4 + 1);
      const uint32_t ew[4] = {cur.x, cur.y, cur.z, cur.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (g + j < n) {
          const float h = hi(ew[j]);
          const uint32_t a = tile + (ew[j] & 0xFFFFu) * (DC * 2);
          uint4 w[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) w[i] = lds128(a + rot[i]);
          if (UP) {
            float part[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const float* xi = x + 8 * i;
              float s = xi[0] * lo(w[i].x);
              s = fmaf(xi[1], hi(w[i].x), s); s = fmaf(xi[2], lo(w[i].y), s); s = fmaf(xi[3], hi(w[i].y), s);
              s = fmaf(xi[4], lo(w[i].z), s); s = fmaf(xi[5], hi(w[i].z), s); s = fmaf(xi[6], lo(w[i].w), s);
              s = fmaf(xi[7], hi(w[i].w), s);
              part[i] = s;
            }
            const float u = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
            chk = fmaf(h, u, chk);
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              float* ai = acc + 8 * i;
              ai[0] = fmaf(h, lo(w[i].x), ai[0]); ai[1] = fmaf(h, hi(w[i].x), ai[1]);
              ai[2] = fmaf(h, lo(w[i].y), ai[2]); ai[3] = fmaf(h, hi(w[i].y), ai[3]);
              ai[4] = fmaf(h, lo(w[i].z), ai[4]); ai[5] = fmaf(h, hi(w[i].z), ai[5]);
              ai[6] = fmaf(h, lo(w[i].w), ai[6]); ai[7] = fmaf(h, hi(w[i].w), ai[7]);
            }
          }
        }
      }
    }
    if (!UP) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < 64; ++i) s += acc[i] * float(i + 1);
      chk += s;
    }
  }
  if (chk == 1234.5f) p.sink[0] = chk;  // keeps the loops alive; never true for random data
}


// Down loop on the tensor cores (mma.sync m16n8k16, bf16 -> fp32): a warp takes a group of 16 rows;
// the group's (row, neuron) pairs in the slice are packed 16 to a k-step (record: h << 16 | row in
// group << 11 | neuron). A[16 rows x 16 pairs] holds each pair's h in its row's line (zeros elsewhere,
// so 1/16 of the MMA is useful), B[16 pairs x 8 columns] is the pairs' weight rows, gathered from
// shared memory by ldmatrix.trans (a lane gives each row's address). No unpacking on the CUDA cores.
// ROT: chunk j of neuron n's 128-byte row stored at slot (j + n) % 8, so the 8 rows of one 8x8
// matrix do not all hit the same 16-byte bank group.
struct PM {
  const uint4* tiles;
  const uint32_t* pairs;  // all slices, groups padded to 16 records
  const uint32_t* goff;   // [NQ][G + 1] record offsets
  float* sink;
};
constexpr int G = M / 16;

__device__ __forceinline__ uint32_t hsel(uint32_t r, uint32_t row) { return ((r >> 11) & 15u) == row ? (r >> 16) : 0u; }

// One k-step of 16 records: A from the lane's 4 records (r0..r3), B gathered from the weight rows
// (nb: the neuron whose row this lane addresses), 8 MMAs over the 64 columns.
template <bool ROT>
__device__ __forceinline__ void kstep(float (&acc)[8][4], uint32_t tile, uint32_t r0, uint32_t r1, uint32_t r2,
                                      uint32_t r3, uint32_t nb, uint32_t row0, uint32_t row1, int half) {
  const uint32_t a0 = hsel(r0, row0) | (hsel(r1, row0) << 16), a1 = hsel(r0, row1) | (hsel(r1, row1) << 16);
  const uint32_t a2 = hsel(r2, row0) | (hsel(r3, row0) << 16), a3 = hsel(r2, row1) | (hsel(r3, row1) << 16);
#pragma unroll
  for (int jt = 0; jt < 4; ++jt) {
    const uint32_t chunk = 2 * jt + half;
    const uint32_t addr = tile + nb * (DC * 2) + 16 * (ROT ? ((chunk + nb) & 7u) : chunk);
    uint32_t b0, b1, b2, b3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(acc[2 * jt][0]), "+f"(acc[2 * jt][1]), "+f"(acc[2 * jt][2]), "+f"(acc[2 * jt][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(acc[2 * jt + 1][0]), "+f"(acc[2 * jt + 1][1]), "+f"(acc[2 * jt + 1][2]), "+f"(acc[2 * jt + 1][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b2), "r"(b3));
  }
}

template <bool ROT>
__global__ void __launch_bounds__(THREADS, 1) mma_down_kernel(const PM p) {
  const int q = blockIdx.x % NQ, c = blockIdx.x / NQ;
  const uint32_t tile = load_tile(p.tiles, q, c);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t row0 = lane >> 2, row1 = row0 + 8;
  const int c4 = 2 * (lane & 3), kb = ((lane >> 3) & 1) * 8 + (lane & 7), half = lane >> 4;
  const uint32_t* go = p.goff + size_t(q) * (G + 1);
  float chk = 0.f;
  for (int g = warp; g < G; g += THREADS / 32) {
    const uint32_t b = go[g], e = go[g + 1];
    float acc[8][4] = {};
    // records of the next k-step are loaded one step ahead
    uint32_t n0 = 0, n1 = 0, n2 = 0, n3 = 0, nn = 0;
    if (b < e) {
      const uint32_t* pr = p.pairs + b;
      n0 = __ldg(pr + c4); n1 = __ldg(pr + c4 + 1); n2 = __ldg(pr + c4 + 8); n3 = __ldg(pr + c4 + 9); nn = __ldg(pr + kb);
    }
    for (uint32_t s = b; s < e; s += 16) {
      const uint32_t r0 = n0, r1 = n1, r2 = n2, r3 = n3, nb = nn & 0x7FFu;
      if (s + 16 < e) {
        const uint32_t* pr = p.pairs + s + 16;
        n0 = __ldg(pr + c4); n1 = __ldg(pr + c4 + 1); n2 = __ldg(pr + c4 + 8); n3 = __ldg(pr + c4 + 9); nn = __ldg(pr + kb);
      }
      kstep<ROT>(acc, tile, r0, r1, r2, r3, nb, row0, row1, half);
    }
#pragma unroll
    for (int t = 0; t < 8; ++t) chk += (acc[t][0] + acc[t][1]) * float(t + 1) + (acc[t][2] - acc[t][3]);
  }
  if (chk == 1234.5f) p.sink[0] = chk;
}

// As mma_down_kernel, with the next group's records staged into a per-warp shared buffer by
// cp.async while the current group runs (records past STAGE_REC come from global memory).
constexpr int STAGE_REC = 384;

template <bool ROT>
__global__ void __launch_bounds__(THREADS, 1) mma_down_staged_kernel(const PM p) {
  const int q = blockIdx.x % NQ, c = blockIdx.x / NQ;
  const uint32_t tile = load_tile(p.tiles, q, c);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t stage0 = tile + TILE_BYTES + warp * 2 * STAGE_REC * 4;
  const uint32_t row0 = lane >> 2, row1 = row0 + 8;
  const int c4 = 2 * (lane & 3), kb = ((lane >> 3) & 1) * 8 + (lane & 7), half = lane >> 4;
  const uint32_t* go = p.goff + size_t(q) * (G + 1);
  auto stage = [&](int g, uint32_t buf) {
    if (g < G) {
      const uint32_t b = go[g], n = min(go[g + 1] - b, uint32_t(STAGE_REC));
      for (uint32_t i = 4 * lane; i < n; i += 128)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(buf + 4 * i), "l"(p.pairs + b + i) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  float chk = 0.f;
  int it = 0;
  stage(warp, stage0);
  for (int g = warp; g < G; g += THREADS / 32, ++it) {
    const uint32_t buf = stage0 + (it & 1) * STAGE_REC * 4;
    stage(g + THREADS / 32, stage0 + ((it + 1) & 1) * STAGE_REC * 4);
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncwarp();
    const uint32_t b = go[g], e = go[g + 1];
    float acc[8][4] = {};
    for (uint32_t s = b; s < e; s += 16) {
      uint32_t r0, r1, r2, r3, nb;
      if (s - b < uint32_t(STAGE_REC)) {
        const uint32_t a = buf + 4 * (s - b);
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r0) : "r"(a + 4 * c4));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r1) : "r"(a + 4 * c4 + 4));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r2) : "r"(a + 4 * c4 + 32));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r3) : "r"(a + 4 * c4 + 36));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(nb) : "r"(a + 4 * kb));
      } else {
        const uint32_t* pr = p.pairs + s;
        r0 = __ldg(pr + c4); r1 = __ldg(pr + c4 + 1); r2 = __ldg(pr + c4 + 8); r3 = __ldg(pr + c4 + 9); nb = __ldg(pr + kb);
      }
      nb &= 0x7FFu;
      kstep<ROT>(acc, tile, r0, r1, r2, r3, nb, row0, row1, half);
    }
    __syncwarp();  // every lane is done with buf before it is refilled
#pragma unroll
    for (int t = 0; t < 8; ++t) chk += (acc[t][0] + acc[t][1]) * float(t + 1) + (acc[t][2] - acc[t][3]);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (chk == 1234.5f) p.sink[0] = chk;
}

int main() {
  int dev = 0;
  CK(cudaSetDevice(dev));
  int clk_khz = 0, sms = 0;
  CK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> un(0, R - 1);

  std::vector<uint16_t> tiles(size_t(NQ) * NC * R * DC);
  for (auto& v : tiles) {
    const float f = 0.02f * nd(rng);
    uint32_t b;
    memcpy(&b, &f, 4);
    v = uint16_t(b >> 16);
  }
  std::vector<uint16_t> xh(size_t(M) * D);
  for (auto& v : xh) {
    const float f = nd(rng);
    uint32_t b;
    memcpy(&b, &f, 4);
    v = uint16_t(b >> 16);
  }
  uint4* d_tiles = to_device<uint4>(tiles);
  __nv_bfloat16* d_x = to_device<__nv_bfloat16>(xh);
  float* d_sink;
  CK(cudaMalloc(&d_sink, 4));
  CK(cudaFuncSetAttribute(loop_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, TILE_BYTES));
  CK(cudaFuncSetAttribute(loop_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, TILE_BYTES));
  CK(cudaFuncSetAttribute(mma_down_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, TILE_BYTES));
  CK(cudaFuncSetAttribute(mma_down_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, TILE_BYTES));
  constexpr int STAGED_BYTES = TILE_BYTES + THREADS / 32 * 2 * STAGE_REC * 4;
  CK(cudaFuncSetAttribute(mma_down_staged_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGED_BYTES));

  printf("case,loop,sorted,mean_per_slice,max_per_slice,clamped_rows,ms,mac_per_clk_per_sm\n");
  struct Case { const char* name; float nnz, tail; int cap; };
  for (const Case cs : {Case{"nnz8", 8.f, 0.1f, 16}, Case{"nnz29", 29.f, 0.1f, 32}, Case{"nnz64", 64.f, 0.1f, 48},
                        Case{"nnz29-heavy", 29.f, 0.35f, 32}}) {
    // Entries per (row, slice): Poisson around mean * s^k with a per-row scale s = exp(tail * z); k = 6.8
    // makes the spread of a ReLU threshold at ~2.6 sigma (the generator's nnz 29), then ~mean by
    // renormalisation. Rows over cap are clamped (a full design sends them to the per-row kernel).
    std::vector<float> scale(M);
    double ssum = 0;
    for (int m = 0; m < M; ++m) ssum += (scale[m] = std::exp(6.8f * cs.tail * nd(rng)));
    std::vector<uint32_t> ent(size_t(NQ) * M * cs.cap, 0);
    std::vector<uint8_t> cnt(size_t(NQ) * M);
    std::vector<uint32_t> order(size_t(NQ) * M);
    long total = 0, clamped = 0;
    int mx = 0;
    for (int q = 0; q < NQ; ++q) {
      for (int m = 0; m < M; ++m) {
        std::poisson_distribution<int> pd(cs.nnz / NQ * scale[m] * M / ssum);
        int k = pd(rng);
        mx = std::max(mx, k);
        if (k > cs.cap) { k = cs.cap; ++clamped; }
        cnt[size_t(q) * M + m] = uint8_t(k);
        total += k;
        for (int j = 0; j < k; ++j) {
          const float h = std::fabs(nd(rng));
          uint32_t b;
          memcpy(&b, &h, 4);
          ent[(size_t(q) * M + m) * cs.cap + j] = (b & 0xFFFF0000u) | uint32_t(un(rng));
        }
      }
    }
    uint32_t* d_ent;
    uint8_t* d_cnt;
    uint32_t* d_order;
    CK(cudaMalloc(&d_ent, ent.size() * 4));
    CK(cudaMalloc(&d_cnt, cnt.size()));
    CK(cudaMalloc(&d_order, order.size() * 4));
    for (int sorted = 0; sorted < 2; ++sorted) {
      for (int q = 0; q < NQ; ++q) {
        uint32_t* o = order.data() + size_t(q) * M;
        for (int m = 0; m < M; ++m) o[m] = m;
        if (sorted)
          for (int b = 0; b < M; b += THREADS)
            std::stable_sort(o + b, o + b + THREADS, [&](uint32_t a, uint32_t c) {
              return cnt[size_t(q) * M + a] > cnt[size_t(q) * M + c];
            });
      }
      std::vector<uint32_t> ent_o(ent.size());
      std::vector<uint8_t> cnt_o(cnt.size());
      for (int q = 0; q < NQ; ++q)
        for (int i = 0; i < M; ++i) {
          const size_t src = size_t(q) * M + order[size_t(q) * M + i], dst = size_t(q) * M + i;
          cnt_o[dst] = cnt[src];
          std::copy(ent.begin() + src * cs.cap, ent.begin() + (src + 1) * cs.cap, ent_o.begin() + dst * cs.cap);
        }
      CK(cudaMemcpy(d_ent, ent_o.data(), ent_o.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_cnt, cnt_o.data(), cnt_o.size(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_order, order.data(), order.size() * 4, cudaMemcpyHostToDevice));
      P p{d_tiles, d_ent, d_cnt, d_order, d_x, cs.cap, d_sink};
      for (int up = 0; up < 2; ++up) {
        auto k = up ? loop_kernel<true> : loop_kernel<false>;
        const float ms = median_ms([&] { k<<<NQ * NC, THREADS, TILE_BYTES>>>(p); });
        const double macs = double(total) * DC * NC;  // every (row, entry) of a slice, in all 32 chunks
        const double per_sm_clk = macs / (NQ * NC) / (ms * 1e-3 * clk_khz * 1e3);
        printf("%s,%s,%d,%.2f,%d,%ld,%.3f,%.1f\n", cs.name, up ? "up" : "down", sorted, double(total) / (NQ * M), mx,
               clamped, ms, per_sm_clk);
        fflush(stdout);
      }
    }
    // Tensor-core down loop: pairs of each 16-row group, padded to 16. packed: each run of 8 records
    // (one 8x8 matrix of ldmatrix) holds neurons of 8 different residues mod 8 (zero records fill the
    // gaps), which with ROT makes the gather conflict-free.
    for (int packed = 0; packed < 2; ++packed) {
      std::vector<uint32_t> pairs, goff(size_t(NQ) * (G + 1));
      long real = 0;
      for (int q = 0; q < NQ; ++q)
        for (int g = 0; g <= G; ++g) {
          goff[size_t(q) * (G + 1) + g] = uint32_t(pairs.size());
          if (g == G) break;
          std::vector<uint32_t> bucket[8];
          for (int r = 0; r < 16; ++r) {
            const size_t m = size_t(q) * M + g * 16 + r;
            for (int j = 0; j < cnt[m]; ++j) {
              const uint32_t w = ent[m * cs.cap + j];
              const uint32_t rec = (w & 0xFFFF0000u) | (uint32_t(r) << 11) | (w & 0x7FFu);
              if (packed) bucket[w & 7u].push_back(rec);
              else pairs.push_back(rec);
              ++real;
            }
          }
          if (packed) {
            size_t most = 0;
            for (auto& b : bucket) most = std::max(most, b.size());
            most += most % 2;  // whole k-steps of 16
            for (size_t i = 0; i < most; ++i)
              for (uint32_t res = 0; res < 8; ++res) pairs.push_back(i < bucket[res].size() ? bucket[res][i] : res);
          }
          while (pairs.size() % 16) pairs.push_back(0u);
        }
      if (packed) printf("# %s packed: %.2f records per pair\n", cs.name, double(pairs.size()) / real);
      uint32_t* d_pairs = to_device<uint32_t>(pairs);
      uint32_t* d_goff = to_device<uint32_t>(goff);
      PM pm{d_tiles, d_pairs, d_goff, d_sink};
      for (int rot = packed; rot < 3; ++rot) {  // rot 2: rotated rows, records staged in shared memory
        auto k = rot == 2 ? mma_down_staged_kernel<true> : rot ? mma_down_kernel<true> : mma_down_kernel<false>;
        const int smem = rot == 2 ? STAGED_BYTES : TILE_BYTES;
        const float ms = median_ms([&] { k<<<NQ * NC, THREADS, smem>>>(pm); });
        const double per_sm_clk = double(real) * DC * NC / (NQ * NC) / (ms * 1e-3 * clk_khz * 1e3);
        printf("%s,%s,-,%.2f,%d,%ld,%.3f,%.1f\n", cs.name, (std::string(rot == 0 ? "down-mma" : rot == 1 ? "down-mma-rot" : "down-mma-rot-staged") + (packed ? "-packed" : "")).c_str(), double(total) / (NQ * M),
               mx, clamped, ms, per_sm_clk);
        fflush(stdout);
      }
      CK(cudaFree(d_pairs));
      CK(cudaFree(d_goff));
    }
    CK(cudaFree(d_ent));
    CK(cudaFree(d_cnt));
    CK(cudaFree(d_order));
  }
  printf("# %d SMs, clock %d MHz (attribute), 128 CTAs of %d threads\n", sms, clk_khz / 1000, THREADS);
  return 0;
}
