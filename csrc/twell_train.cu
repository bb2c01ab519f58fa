// Training kernels of the ReLU-gated FFN on a row-ELL / dense hybrid (docs/training_kernels.md).
//
// The gate GEMM's output is compacted per row into `slots` (value, column) pairs; a row with more
// nonzeros is heavy and goes through dense GEMMs on its own (the caller's part). Light rows then run
// on CUDA cores, one block per row, reading the weight rows of their active neurons only:
//
//   forward   u = x . w_up[n], h = relu(g) * u, out = sum_n h * w_down_t[n], |h| per row
//   backward  dh = dy . w_down_t[n], ds = dh + l1 * sign(h), du = ds * relu(g), dg = ds * u,
//             dx = sum_n du * w_up[n] + dg * w_gate[n]
//   weights   per neuron n, over its rows m (a column-sorted entry list):
//             d_w_down_t[n] = sum h * dy[m], d_w_up[n] = sum du * x[m], d_w_gate[n] = sum dg * x[m]
//
// Every accumulation is fp32 and runs in a fixed order (rows in slot order, neurons' rows ascending,
// long neurons split into chunks summed in chunk order), so results are deterministic.
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "common.cuh"
#include "twell_kernels.h"

namespace twell {
namespace {

constexpr int kRowsPerBlock = 8;  // rows per block (one warp each) of the compaction and work-list kernels
// Entries per step of the weight-gradient kernel, their loads issued first (4 was measured slower:
// 64 registers, fewer blocks per SM; docs/training_kernels.md §3).
constexpr int kColumnBatch = 2;

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// L2 policy of the streamed rows of x, dy and the outputs (evict_first): the weight rows a pass
// gathers stay in L2 across its rows.
__device__ __forceinline__ uint64_t l2_stream() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint4 ld_policy(const void* ptr, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr), "l"(pol));
  return v;
}
__device__ __forceinline__ void st_policy(void* ptr, const uint4& v, uint64_t pol) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(pol)
               : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Active means "not <= 0": a NaN gate value is active (its NaN then reaches the row's output, as in
// dense PyTorch, where relu(NaN) is NaN).
__device__ __forceinline__ bool active(float v) { return !(v <= 0.f); }

// One warp per row: the row's active columns in ascending order, the first `slots` of them stored
// (column, relu(g)); nnz gets the true count (a row with nnz > slots is heavy). neuron_active[n] = 1
// for every active n of every row.
template <bool kVec>
__global__ void compact_kernel(const __nv_bfloat16* __restrict__ g, int M, int H, int slots, int* __restrict__ idx,
                               __nv_bfloat16* __restrict__ val, int* __restrict__ nnz,
                               uint8_t* __restrict__ neuron_active) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const __nv_bfloat16* src = g + size_t(row) * H;
  int* out_idx = idx + size_t(row) * slots;
  __nv_bfloat16* out_val = val + size_t(row) * slots;
  int base = 0;
  for (int c0 = 0; c0 < H; c0 += 256) {
    const int col = c0 + lane * 8;
    float f[8];
    if (kVec && col < H) {
      unpack8(__ldg(reinterpret_cast<const uint4*>(src + col)), f);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = col + e < H ? __bfloat162float(src[col + e]) : 0.f;
    }
    unsigned mask = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) mask |= unsigned(col + e < H && active(f[e])) << e;
    const int cnt = __popc(mask);
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    int slot = base + incl - cnt;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (mask >> e & 1) {
        if (slot < slots) {
          out_idx[slot] = col + e;
          out_val[slot] = __float2bfloat16_rn(f[e]);
        }
        neuron_active[col + e] = 1;
        ++slot;
      }
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) nnz[row] = base;
}

// Light rows, one block of 256 threads per row: thread t owns V vectors of 8 columns of D, vector v
// columns 8 (t + 256 v) .. + 8 (V = ceil(D / 2048): D <= 2048 one, up to 8192 four).
// The weight rows of a batch of kStages active neurons are copied into shared memory with cp.async,
// each thread its own V x 16 bytes (so no barrier guards the ring; registers do not bound the bytes in
// flight). Phase A: per neuron a dot product with the row's x (or dy), reduced over the block once
// per batch; phase B: the weighted sum of another weight's rows.
constexpr int kStages = 8;
constexpr int kRowThreads = 256;
constexpr int kMaxRowVectors = 4;  // D <= 8 * 256 * 4 = 8192

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  float fa[8], fb[8];
  unpack8(a, fa);
  unpack8(b, fb);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(fa[i], fb[i], s);
  return s;
}

// The block's sums of part[0 .. kStages) into red[kStages] (visible to all threads on return).
__device__ __forceinline__ void block_sums(float* part, float (*scratch)[kStages], float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int s = 0; s < kStages; ++s) part[s] = warp_sum(part[s]);
  if (lane == 0)
#pragma unroll
    for (int s = 0; s < kStages; ++s) scratch[warp][s] = part[s];
  __syncthreads();
  if (threadIdx.x < kStages) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kRowThreads / 32; ++w) v += scratch[w][threadIdx.x];
    red[threadIdx.x] = v;
  }
  __syncthreads();
}

// This thread's columns: vector v covers 8 (t + 256 v) .. + 8; ring slot s of vector v.
__device__ __forceinline__ int row_col(int v) { return 8 * (int(threadIdx.x) + kRowThreads * v); }
template <int V>
__device__ __forceinline__ uint4* ring_at(uint4* ring, int s, int v) {
  return ring + (s * V + v) * kRowThreads + threadIdx.x;
}

// The block's dot products of v (this thread's V vectors of a row of x or dy) with the rows of w of
// the active neurons k0 .. k0 + kStages, staged with cp.async: red[s] holds them on return.
template <int V>
__device__ __forceinline__ void batch_dots(const uint4 (&v)[V], const __nv_bfloat16* __restrict__ w, const int* sidx,
                                           int k0, int n, int D, uint4* ring, float (*scratch)[kStages], float* red) {
#pragma unroll
  for (int s = 0; s < kStages; ++s)
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (row_col(j) < D && k0 + s < n) cp_async16(ring_at<V>(ring, s, j), w + size_t(sidx[k0 + s]) * D + row_col(j));
  cp_async_commit();
  cp_async_wait_all();
  float part[kStages];
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    part[s] = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (row_col(j) < D && k0 + s < n) part[s] += dot8(v[j], *ring_at<V>(ring, s, j));
  }
  block_sums(part, scratch, red);
}

template <int V>
__global__ void __launch_bounds__(kRowThreads) rows_forward_kernel(
    const __nv_bfloat16* __restrict__ x, const int* __restrict__ idx, const __nv_bfloat16* __restrict__ val,
    const int* __restrict__ nnz, const __nv_bfloat16* __restrict__ w_up, const __nv_bfloat16* __restrict__ w_down_t,
    __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ u_out, __nv_bfloat16* __restrict__ h_out,
    float* __restrict__ row_l1, int D, int slots) {
  extern __shared__ uint4 ring[];  // kStages x V x 256 vectors, then hs[slots] floats, sidx[slots] ints
  __shared__ float scratch[kRowThreads / 32][kStages];
  __shared__ float red[kStages];
  float* hs = reinterpret_cast<float*>(ring + kStages * V * kRowThreads);
  int* sidx = reinterpret_cast<int*>(hs + slots);
  const int row = blockIdx.x, t = threadIdx.x;
  const int n = nnz[row];
  if (n > slots) {  // heavy: the dense part writes this row
    if (t == 0) row_l1[row] = 0.f;
    return;
  }
  const size_t r0 = size_t(row) * slots;
  for (int k = t; k < n; k += kRowThreads) {
    sidx[k] = idx[r0 + k];
    hs[k] = __bfloat162float(val[r0 + k]);  // relu(g), replaced by h below
  }
  __syncthreads();
  const uint64_t stream = l2_stream();
  uint4 xv[V];
#pragma unroll
  for (int j = 0; j < V; ++j)
    xv[j] = row_col(j) < D ? ld_policy(x + size_t(row) * D + row_col(j), stream) : make_uint4(0, 0, 0, 0);
  float l1 = 0.f;
  for (int k0 = 0; k0 < n; k0 += kStages) {
    batch_dots<V>(xv, w_up, sidx, k0, n, D, ring, scratch, red);
    if (t < kStages && k0 + t < n) {
      const int k = k0 + t;
      // dense bf16 rounds u (a GEMM output) and the product relu(g) * u
      const float u = round_bf16(red[t]), h = round_bf16(hs[k] * u);
      hs[k] = h;
      u_out[r0 + k] = __float2bfloat16_rn(u);
      h_out[r0 + k] = __float2bfloat16_rn(h);
      l1 += fabsf(h);
    }
  }
  if (t < kStages) scratch[0][t] = l1;
  __syncthreads();  // hs (now h) and the l1 parts visible to every thread
  if (t == 0) {
    float v = 0.f;
    for (int s = 0; s < kStages; ++s) v += scratch[0][s];
    row_l1[row] = v;
  }
  float acc[V][8];
#pragma unroll
  for (int j = 0; j < V; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  for (int k0 = 0; k0 < n; k0 += kStages) {
#pragma unroll
    for (int s = 0; s < kStages; ++s)
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (row_col(j) < D && k0 + s < n)
          cp_async16(ring_at<V>(ring, s, j), w_down_t + size_t(sidx[k0 + s]) * D + row_col(j));
    cp_async_commit();
    cp_async_wait_all();
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      if (k0 + s >= n) continue;
      const float h = hs[k0 + s];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (row_col(j) < D) {
          float f[8];
          unpack8(*ring_at<V>(ring, s, j), f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][i] = fmaf(h, f[i], acc[j][i]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (row_col(j) < D) st_policy(out + size_t(row) * D + row_col(j), pack8(acc[j]), stream);
}

template <int V>
__global__ void __launch_bounds__(kRowThreads) rows_backward_kernel(
    const __nv_bfloat16* __restrict__ dy, const int* __restrict__ idx, const __nv_bfloat16* __restrict__ val,
    const __nv_bfloat16* __restrict__ u_in, const __nv_bfloat16* __restrict__ h_in, const int* __restrict__ nnz,
    const __nv_bfloat16* __restrict__ w_down_t, const __nv_bfloat16* __restrict__ w_up,
    const __nv_bfloat16* __restrict__ w_gate, const float* __restrict__ l1_grad, __nv_bfloat16* __restrict__ dx,
    __nv_bfloat16* __restrict__ du_out, __nv_bfloat16* __restrict__ dg_out, int D, int slots) {
  extern __shared__ uint4 ring[];  // kStages x V x 256 vectors, then dus, dgs [slots] floats, sidx [slots] ints
  __shared__ float scratch[kRowThreads / 32][kStages];
  __shared__ float red[kStages];
  float* dus = reinterpret_cast<float*>(ring + kStages * V * kRowThreads);
  float* dgs = dus + slots;
  int* sidx = reinterpret_cast<int*>(dgs + slots);
  const int row = blockIdx.x, t = threadIdx.x;
  const int n = nnz[row];
  if (n > slots) return;  // heavy: the dense part writes this row
  const size_t r0 = size_t(row) * slots;
  for (int k = t; k < n; k += kRowThreads) sidx[k] = idx[r0 + k];
  __syncthreads();
  const float l1g = l1_grad == nullptr ? 0.f : *l1_grad;
  const uint64_t stream = l2_stream();
  uint4 dv[V];
#pragma unroll
  for (int j = 0; j < V; ++j)
    dv[j] = row_col(j) < D ? ld_policy(dy + size_t(row) * D + row_col(j), stream) : make_uint4(0, 0, 0, 0);
  for (int k0 = 0; k0 < n; k0 += kStages) {
    batch_dots<V>(dv, w_down_t, sidx, k0, n, D, ring, scratch, red);
    if (t < kStages && k0 + t < n) {
      const int k = k0 + t;
      const float h = __bfloat162float(h_in[r0 + k]);
      const float sgn = h > 0.f ? 1.f : (h < 0.f ? -1.f : (h == h ? 0.f : h));
      // dh is a bf16 GEMM output in dense PyTorch; the L1 term's gradient adds to it
      const float ds = round_bf16(red[t]) + l1g * sgn;
      const float du = round_bf16(ds * __bfloat162float(val[r0 + k]));
      const float dg = round_bf16(ds * __bfloat162float(u_in[r0 + k]));
      dus[k] = du;
      dgs[k] = dg;
      du_out[r0 + k] = __float2bfloat16_rn(du);
      dg_out[r0 + k] = __float2bfloat16_rn(dg);
    }
  }
  __syncthreads();  // dus, dgs visible to every thread
  float acc[V][8];
#pragma unroll
  for (int j = 0; j < V; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  constexpr int kPairs = kStages / 2;  // w_up and w_gate rows of a neuron share a batch
  for (int k0 = 0; k0 < n; k0 += kPairs) {
#pragma unroll
    for (int s = 0; s < kPairs; ++s) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (row_col(j) < D && k0 + s < n) {
          const size_t off = size_t(sidx[k0 + s]) * D + row_col(j);
          cp_async16(ring_at<V>(ring, 2 * s, j), w_up + off);
          cp_async16(ring_at<V>(ring, 2 * s + 1, j), w_gate + off);
        }
      }
    }
    cp_async_commit();
    cp_async_wait_all();
#pragma unroll
    for (int s = 0; s < kPairs; ++s) {
      if (k0 + s >= n) continue;
      const float du = dus[k0 + s], dg = dgs[k0 + s];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (row_col(j) < D) {
          float fu[8], fg[8];
          unpack8(*ring_at<V>(ring, 2 * s, j), fu);
          unpack8(*ring_at<V>(ring, 2 * s + 1, j), fg);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][i] = fmaf(dg, fg[i], fmaf(du, fu[i], acc[j][i]));
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (row_col(j) < D) st_policy(dx + size_t(row) * D + row_col(j), pack8(acc[j]), stream);
}

// Weight gradients, one block per work item (a neuron's entries lo..hi of the column-sorted list):
// thread t owns columns 8 t .. 8 t + 8 of D. An item that is the whole neuron adds the dense rows'
// part (`heavy_*`, may be null) and writes bf16; a chunk of a long neuron writes an fp32 partial.
__global__ void __launch_bounds__(256) columns_kernel(
    const int* __restrict__ ent, const int* __restrict__ item_col, const int* __restrict__ item_lo,
    const int* __restrict__ item_hi, const int* __restrict__ item_part, const __nv_bfloat16* __restrict__ h,
    const __nv_bfloat16* __restrict__ du, const __nv_bfloat16* __restrict__ dg, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ heavy_down,
    const __nv_bfloat16* __restrict__ heavy_up, const __nv_bfloat16* __restrict__ heavy_gate,
    __nv_bfloat16* __restrict__ d_down_t, __nv_bfloat16* __restrict__ d_up, __nv_bfloat16* __restrict__ d_gate,
    float* __restrict__ partial, int D, int slots, int part_cols) {
  // blockIdx.y picks a slice of D: the grid runs every item of slice 0 before slice 1, so the rows
  // of x and dy that the resident blocks gather (part_cols columns of each) stay in L2.
  const int item = blockIdx.x, t = threadIdx.x, col = blockIdx.y * part_cols + t * 8;
  if (t * 8 >= part_cols || col >= D) return;
  const int lo = item_lo[item], hi = item_hi[item];
  float ad[8], au[8], ag[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) ad[i] = au[i] = ag[i] = 0.f;
  // kColumnBatch entries per step: their 2 x kColumnBatch row loads are issued before any is used.
  int p = lo;
  for (; p + kColumnBatch <= hi; p += kColumnBatch) {
    uint4 xv[kColumnBatch], yv[kColumnBatch];
    int e[kColumnBatch];
#pragma unroll
    for (int j = 0; j < kColumnBatch; ++j) {
      e[j] = ent[p + j];
      const size_t m = size_t(e[j] / slots) * D + col;
      xv[j] = __ldg(reinterpret_cast<const uint4*>(x + m));
      yv[j] = __ldg(reinterpret_cast<const uint4*>(dy + m));
    }
#pragma unroll
    for (int j = 0; j < kColumnBatch; ++j) {
      const float h0 = __bfloat162float(h[e[j]]), u0 = __bfloat162float(du[e[j]]), g0 = __bfloat162float(dg[e[j]]);
      float fx[8], fy[8];
      unpack8(xv[j], fx);
      unpack8(yv[j], fy);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        ad[i] = fmaf(h0, fy[i], ad[i]);
        au[i] = fmaf(u0, fx[i], au[i]);
        ag[i] = fmaf(g0, fx[i], ag[i]);
      }
    }
  }
  for (; p < hi; ++p) {
    const int e0 = ent[p], m0 = e0 / slots;
    float fx[8], fy[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(x + size_t(m0) * D + col)), fx);
    unpack8(__ldg(reinterpret_cast<const uint4*>(dy + size_t(m0) * D + col)), fy);
    const float h0 = __bfloat162float(h[e0]), u0 = __bfloat162float(du[e0]), g0 = __bfloat162float(dg[e0]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ad[i] = fmaf(h0, fy[i], ad[i]);
      au[i] = fmaf(u0, fx[i], au[i]);
      ag[i] = fmaf(g0, fx[i], ag[i]);
    }
  }
  const int part = item_part[item];
  if (part >= 0) {
    float* dst = partial + size_t(part) * 3 * D + col;
    *reinterpret_cast<float4*>(dst) = make_float4(ad[0], ad[1], ad[2], ad[3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(ad[4], ad[5], ad[6], ad[7]);
    *reinterpret_cast<float4*>(dst + D) = make_float4(au[0], au[1], au[2], au[3]);
    *reinterpret_cast<float4*>(dst + D + 4) = make_float4(au[4], au[5], au[6], au[7]);
    *reinterpret_cast<float4*>(dst + 2 * D) = make_float4(ag[0], ag[1], ag[2], ag[3]);
    *reinterpret_cast<float4*>(dst + 2 * D + 4) = make_float4(ag[4], ag[5], ag[6], ag[7]);
    return;
  }
  const size_t o = size_t(item_col[item]) * D + col;
  if (heavy_down != nullptr) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(heavy_down + o), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ad[i] += f[i];
    unpack8(*reinterpret_cast<const uint4*>(heavy_up + o), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) au[i] += f[i];
    unpack8(*reinterpret_cast<const uint4*>(heavy_gate + o), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ag[i] += f[i];
  }
  *reinterpret_cast<uint4*>(d_down_t + o) = pack8(ad);
  *reinterpret_cast<uint4*>(d_up + o) = pack8(au);
  *reinterpret_cast<uint4*>(d_gate + o) = pack8(ag);
}

// Long neurons: their chunks' partials summed in chunk order, plus the dense rows' part.
__global__ void __launch_bounds__(256) columns_reduce_kernel(
    const int* __restrict__ cols, const int* __restrict__ part_lo, const int* __restrict__ part_n,
    const float* __restrict__ partial, const __nv_bfloat16* __restrict__ heavy_down,
    const __nv_bfloat16* __restrict__ heavy_up, const __nv_bfloat16* __restrict__ heavy_gate,
    __nv_bfloat16* __restrict__ d_down_t, __nv_bfloat16* __restrict__ d_up, __nv_bfloat16* __restrict__ d_gate,
    int D, int part_cols) {
  const int i = blockIdx.x, col = blockIdx.y * part_cols + threadIdx.x * 8;
  if (threadIdx.x * 8 >= part_cols || col >= D) return;
  float a[3][8];
#pragma unroll
  for (int r = 0; r < 3; ++r)
#pragma unroll
    for (int e = 0; e < 8; ++e) a[r][e] = 0.f;
  const int lo = part_lo[i], np = part_n[i];
  for (int p = lo; p < lo + np; ++p) {
#pragma unroll
    for (int r = 0; r < 3; ++r) {
      const float* src = partial + (size_t(p) * 3 + r) * D + col;
      const float4 v0 = *reinterpret_cast<const float4*>(src), v1 = *reinterpret_cast<const float4*>(src + 4);
      a[r][0] += v0.x, a[r][1] += v0.y, a[r][2] += v0.z, a[r][3] += v0.w;
      a[r][4] += v1.x, a[r][5] += v1.y, a[r][6] += v1.z, a[r][7] += v1.w;
    }
  }
  const size_t o = size_t(cols[i]) * D + col;
  const __nv_bfloat16* hv[3] = {heavy_down, heavy_up, heavy_gate};
  __nv_bfloat16* dst[3] = {d_down_t, d_up, d_gate};
#pragma unroll
  for (int r = 0; r < 3; ++r) {
    if (hv[r] != nullptr) {
      float f[8];
      unpack8(*reinterpret_cast<const uint4*>(hv[r] + o), f);
#pragma unroll
      for (int e = 0; e < 8; ++e) a[r][e] += f[e];
    }
    *reinterpret_cast<uint4*>(dst[r] + o) = pack8(a[r]);
  }
}

// -- the weight-gradient kernel's work list ------------------------------------------------------
// Entries of the light rows per neuron (atomics), then their positions in neuron order.
__global__ void entry_count_kernel(const int* __restrict__ idx, const int* __restrict__ nnz, int M, int slots,
                                   int* __restrict__ counts) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const int n = nnz[row];
  if (n > slots) return;
  for (int k = lane; k < n; k += 32) atomicAdd(counts + idx[size_t(row) * slots + k], 1);
}

__global__ void entry_fill_kernel(const int* __restrict__ idx, const int* __restrict__ nnz, int M, int slots,
                                  int* __restrict__ cursor, int* __restrict__ ent) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const int n = nnz[row];
  if (n > slots) return;
  for (int k = lane; k < n; k += 32) {
    const int e = row * slots + k;
    ent[atomicAdd(cursor + idx[e], 1)] = e;
  }
}

// The work list in row order without a sort: rows in bands of `band` rows. Per band and neuron a count
// (band_count), then per neuron a scan down the bands (band_scan: each band's offset within the
// neuron's segment, and the neuron's total), then each band places its entries, rows in order
// (band_place). Every position is fixed by the pattern alone: deterministic, and no host sync.
__global__ void band_count_kernel(const int* __restrict__ idx, const int* __restrict__ nnz, int M, int H, int slots,
                                  int band, int* __restrict__ band_cnt) {
  extern __shared__ int cnt[];  // [H]
  for (int c = threadIdx.x; c < H; c += blockDim.x) cnt[c] = 0;
  __syncthreads();
  const int r0 = blockIdx.x * band, r1 = min(M, r0 + band), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = r0 + warp; r < r1; r += blockDim.x / 32) {
    const int n = nnz[r];
    if (n > slots) continue;  // heavy rows run dense
    for (int k = lane; k < n; k += 32) atomicAdd(cnt + idx[size_t(r) * slots + k], 1);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < H; c += blockDim.x) band_cnt[size_t(blockIdx.x) * H + c] = cnt[c];
}

__global__ void band_scan_kernel(int* __restrict__ band_cnt, int bands, int H, int* __restrict__ totals) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= H) return;
  int run = 0;
#pragma unroll 8
  for (int b = 0; b < bands; ++b) {
    const int v = band_cnt[size_t(b) * H + c];
    band_cnt[size_t(b) * H + c] = run;
    run += v;
  }
  totals[c] = run;
}

__global__ void band_place_kernel(const int* __restrict__ idx, const int* __restrict__ nnz, int M, int H, int slots,
                                  int band, const int* __restrict__ band_off, const int* __restrict__ col_ptr,
                                  int* __restrict__ ent) {
  extern __shared__ int sm[];
  int* cur = sm;           // [H]: the next position of each neuron in this band
  int* rows = sm + H;      // [band][slots]: the band's entries, staged at once
  int* counts = rows + size_t(band) * slots;  // [band]
  const int r0 = blockIdx.x * band, nr = min(M - r0, band);
  for (int c = threadIdx.x; c < H; c += blockDim.x) cur[c] = col_ptr[c] + band_off[size_t(blockIdx.x) * H + c];
  for (int i = threadIdx.x; i < nr; i += blockDim.x) {
    const int n = nnz[r0 + i];
    counts[i] = n > slots ? 0 : n;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nr * slots; i += blockDim.x) {
    const int k = i % slots;
    if (k < counts[i / slots]) rows[i] = idx[size_t(r0) * slots + i];
  }
  __syncthreads();
  // A row's neurons are distinct: its entries take their positions at once; the next row after a barrier.
  for (int i = 0; i < nr; ++i) {
    const int n = counts[i];
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
      const int c = rows[i * slots + k];
      const int pos = cur[c];
      cur[c] = pos + 1;
      ent[pos] = (r0 + i) * slots + k;
    }
    __syncthreads();
  }
}

// Per neuron: chunks (at least one, so that every neuron's gradient row is written), partial slots
// (chunks of neurons with more than one), and whether it is long.
__global__ void plan_count_kernel(const int* __restrict__ col_ptr, int H, int chunk, int* __restrict__ sizes) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= H) return;
  const int cnt = col_ptr[c + 1] - col_ptr[c];
  const int nch = max(1, (cnt + chunk - 1) / chunk);
  sizes[c] = nch;
  sizes[H + c] = nch > 1 ? nch : 0;
  sizes[2 * H + c] = nch > 1;
}

// `incl`: inclusive prefix sums of plan_count_kernel's three rows.
__global__ void plan_fill_kernel(const int* __restrict__ col_ptr, const int* __restrict__ sizes,
                                 const int* __restrict__ incl, int H, int chunk, int* __restrict__ item_col,
                                 int* __restrict__ item_lo, int* __restrict__ item_hi, int* __restrict__ item_part,
                                 int* __restrict__ long_col, int* __restrict__ long_lo, int* __restrict__ long_n) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= H) return;
  const int nch = sizes[c], first = incl[c] - nch, part0 = incl[H + c] - sizes[H + c];
  const int lo = col_ptr[c], hi = col_ptr[c + 1];
  for (int i = 0; i < nch; ++i) {
    item_col[first + i] = c;
    item_lo[first + i] = lo + i * chunk;
    item_hi[first + i] = min(hi, lo + (i + 1) * chunk);
    item_part[first + i] = nch > 1 ? part0 + i : -1;
  }
  if (nch > 1) {
    const int li = incl[2 * H + c] - 1;
    long_col[li] = c;
    long_lo[li] = part0;
    long_n[li] = nch;
  }
}

// bf16 [R, C] -> [C, R] through 32 x 32 tiles in shared memory (W_down and its gradient: the row
// kernels gather rows of W_down transposed).
__global__ void __launch_bounds__(256) transpose_kernel(const __nv_bfloat16* __restrict__ src,
                                                        __nv_bfloat16* __restrict__ dst, int R, int C) {
  __shared__ __nv_bfloat16 tile[32][34];
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32, tx = threadIdx.x % 32, ty = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < 32; i += 8) {
    const int r = r0 + ty + i, c = c0 + tx;
    if (r < R && c < C) tile[ty + i][tx] = src[size_t(r) * C + c];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 32; i += 8) {
    const int c = c0 + ty + i, r = r0 + tx;
    if (r < R && c < C) dst[size_t(c) * R + r] = tile[tx][ty + i];
  }
}

// A heavy row's L1 on the dense tensor-core path (twell_dense.cu), its count read on the device: the
// hidden GEMM's per-tile sums, tiles in order.
__global__ void heavy_l1_kernel(const int* __restrict__ count, const int* __restrict__ rows,
                                const float* __restrict__ part, int tiles, float* __restrict__ row_l1) {
  const int n = *count;
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < n; q += gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int t = 0; t < tiles; ++t) s += part[size_t(q) * tiles + t];
    row_l1[rows[q]] = s;
  }
}

// The heavy rows' elementwise backward in one pass (it was ten PyTorch kernels over [rows, H], most of a
// near-dense layer's time beyond its GEMMs): from the recomputed gate g and up u and ds = dy W_down,
//   h = relu(g) * u,  ds' = ds + sign(h) * l1 (l1 rounded to bf16; absent: ds' = ds),
//   du = ds' * relu(g),  dg = g > 0 ? ds' * u : 0,
// each product rounded to bf16 as PyTorch's bf16 operations round them (fp32 math, one rounding per
// operation), so the values are those of that sequence bit for bit. relu as PyTorch's on CUDA: NaN kept, -0 to +0
// (measured: products with a -0 kept differ in the sign of zero).
__device__ __forceinline__ void heavy_grad(float g, float u, float ds, float l1, bool has_l1, float& h, float& du,
                                           float& dg) {
  const float gr = g <= 0.f ? 0.f : g;
  h = round_bf16(gr * u);
  if (has_l1) {
    const float sgn = h > 0.f ? 1.f : (h < 0.f ? -1.f : 0.f);
    ds = round_bf16(ds + round_bf16(sgn * l1));
  }
  du = round_bf16(ds * gr);
  dg = g > 0.f ? round_bf16(ds * u) : 0.f;
}

__global__ void heavy_grads_kernel(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u,
                                   const __nv_bfloat16* __restrict__ ds, const float* __restrict__ l1_grad,
                                   __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ du,
                                   __nv_bfloat16* __restrict__ dg, size_t n, bool vec) {
  const bool has_l1 = l1_grad != nullptr;
  const float l1 = has_l1 ? round_bf16(*l1_grad) : 0.f;
  const size_t step = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 8; i += step) {
      float gv[8], uv[8], dv[8], hv[8], duv[8], dgv[8];
      unpack8(reinterpret_cast<const uint4*>(g)[i], gv);
      unpack8(reinterpret_cast<const uint4*>(u)[i], uv);
      unpack8(reinterpret_cast<const uint4*>(ds)[i], dv);
#pragma unroll
      for (int k = 0; k < 8; ++k) heavy_grad(gv[k], uv[k], dv[k], l1, has_l1, hv[k], duv[k], dgv[k]);
      reinterpret_cast<uint4*>(h)[i] = pack8(hv);
      reinterpret_cast<uint4*>(du)[i] = pack8(duv);
      reinterpret_cast<uint4*>(dg)[i] = pack8(dgv);
    }
  } else {
    for (; i < n; i += step) {
      float hv, duv, dgv;
      heavy_grad(__bfloat162float(g[i]), __bfloat162float(u[i]), __bfloat162float(ds[i]), l1, has_l1, hv, duv, dgv);
      h[i] = __float2bfloat16_rn(hv);
      du[i] = __float2bfloat16_rn(duv);
      dg[i] = __float2bfloat16_rn(dgv);
    }
  }
}

// The dense hidden state of a gate variant in one pass: h = bf16(a * b), a = 0 where g <= t (bf16(t): PyTorch
// compares a bf16 tensor with a float in bf16) else g, b = u or, with up_relu, 0 where u <= 0 else u. PyTorch's
// where(g <= t, 0, g), relu(u) and bf16 mul give the same bits: NaN kept, zeros +0.
__global__ void gate_product_kernel(const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u,
                                    __nv_bfloat16* __restrict__ h, size_t n, float t, bool up_relu, bool vec) {
  const size_t step = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  auto prod = [&](float gv, float uv) {
    const float a = gv <= t ? 0.f : gv;
    return a * (up_relu && uv <= 0.f ? 0.f : uv);
  };
  if (vec) {
    for (; i < n / 8; i += step) {
      float gv[8], uv[8], hv[8];
      unpack8(reinterpret_cast<const uint4*>(g)[i], gv);
      unpack8(reinterpret_cast<const uint4*>(u)[i], uv);
#pragma unroll
      for (int k = 0; k < 8; ++k) hv[k] = prod(gv[k], uv[k]);
      reinterpret_cast<uint4*>(h)[i] = pack8(hv);
    }
  } else {
    for (; i < n; i += step) h[i] = __float2bfloat16_rn(prod(__bfloat162float(g[i]), __bfloat162float(u[i])));
  }
}

int row_blocks(int M) { return (M + kRowsPerBlock - 1) / kRowsPerBlock; }

size_t row_smem(int slots, int arrays, int V) {
  return size_t(kStages) * V * kRowThreads * 16 + size_t(arrays) * slots * 4;
}
int row_vectors(int D) { return (D + 8 * kRowThreads - 1) / (8 * kRowThreads); }

template <int V>
cudaError_t launch_rows_forward(const TrainRows& a, cudaStream_t stream) {
  const size_t smem = row_smem(a.slots, 2, V);
  cudaError_t err = cudaFuncSetAttribute(rows_forward_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  rows_forward_kernel<V><<<a.M, kRowThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.idx, static_cast<const __nv_bfloat16*>(a.val), a.nnz,
      static_cast<const __nv_bfloat16*>(a.w0), static_cast<const __nv_bfloat16*>(a.w1),
      static_cast<__nv_bfloat16*>(a.out), static_cast<__nv_bfloat16*>(a.s0), static_cast<__nv_bfloat16*>(a.s1),
      a.row_l1, a.D, a.slots);
  return cudaGetLastError();
}

template <int V>
cudaError_t launch_rows_backward(const TrainRows& a, cudaStream_t stream) {
  const size_t smem = row_smem(a.slots, 3, V);
  cudaError_t err = cudaFuncSetAttribute(rows_backward_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  rows_backward_kernel<V><<<a.M, kRowThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.idx, static_cast<const __nv_bfloat16*>(a.val),
      static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.h), a.nnz,
      static_cast<const __nv_bfloat16*>(a.w0), static_cast<const __nv_bfloat16*>(a.w1),
      static_cast<const __nv_bfloat16*>(a.w2), a.l1_grad, static_cast<__nv_bfloat16*>(a.out),
      static_cast<__nv_bfloat16*>(a.s0), static_cast<__nv_bfloat16*>(a.s1), a.D, a.slots);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_train_compact(const void* g, int M, int H, int slots, int* idx, void* val, int* nnz,
                                 uint8_t* neuron_active, cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  const bool vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(g) % 16 == 0;
  auto* gp = static_cast<const __nv_bfloat16*>(g);
  auto* vp = static_cast<__nv_bfloat16*>(val);
  if (vec)
    compact_kernel<true><<<row_blocks(M), kRowsPerBlock * 32, 0, stream>>>(gp, M, H, slots, idx, vp, nnz,
                                                                            neuron_active);
  else
    compact_kernel<false><<<row_blocks(M), kRowsPerBlock * 32, 0, stream>>>(gp, M, H, slots, idx, vp, nnz,
                                                                             neuron_active);
  return cudaGetLastError();
}

cudaError_t launch_train_rows_forward(const TrainRows& a, cudaStream_t stream) {
  if (a.M == 0) return cudaSuccess;
  switch (row_vectors(a.D)) {
    case 1: return launch_rows_forward<1>(a, stream);
    case 2: return launch_rows_forward<2>(a, stream);
    case 3: return launch_rows_forward<3>(a, stream);
    case 4: return launch_rows_forward<4>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_train_rows_backward(const TrainRows& a, cudaStream_t stream) {
  if (a.M == 0) return cudaSuccess;
  switch (row_vectors(a.D)) {
    case 1: return launch_rows_backward<1>(a, stream);
    case 2: return launch_rows_backward<2>(a, stream);
    case 3: return launch_rows_backward<3>(a, stream);
    case 4: return launch_rows_backward<4>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_train_entries(const int* idx, const int* nnz, int M, int H, int slots, int* counts, int* cursor,
                                 int* ent, bool fill, cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  if (fill)
    entry_fill_kernel<<<row_blocks(M), kRowsPerBlock * 32, 0, stream>>>(idx, nnz, M, slots, cursor, ent);
  else
    entry_count_kernel<<<row_blocks(M), kRowsPerBlock * 32, 0, stream>>>(idx, nnz, M, slots, counts);
  return cudaGetLastError();
}

namespace {
constexpr size_t kBandSmem = 200 * 1024;  // shared memory a placing block may take
}

int train_band_rows(int H, int slots) {
  const size_t room = kBandSmem > size_t(H) * 4 ? kBandSmem - size_t(H) * 4 : 0;
  const size_t rows = room / (size_t(slots) * 4 + 4);
  return rows >= 8 ? int(std::min<size_t>(rows, 64)) : 0;
}

cudaError_t launch_train_bands(const int* idx, const int* nnz, int M, int H, int slots, int band, int* band_cnt,
                               const int* col_ptr, int* totals, int* ent, bool place, cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  if (band < 8 || band > 64 || band > train_band_rows(H, slots)) return cudaErrorInvalidValue;
  const int bands = (M + band - 1) / band;
  if (!place) {
    const size_t smem = size_t(H) * 4;
    cudaError_t err = cudaFuncSetAttribute(band_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    band_count_kernel<<<bands, 256, smem, stream>>>(idx, nnz, M, H, slots, band, band_cnt);
    band_scan_kernel<<<(H + 127) / 128, 128, 0, stream>>>(band_cnt, bands, H, totals);
  } else {
    const size_t smem = size_t(H) * 4 + size_t(band) * slots * 4 + size_t(band) * 4;
    cudaError_t err = cudaFuncSetAttribute(band_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    band_place_kernel<<<bands, 256, smem, stream>>>(idx, nnz, M, H, slots, band, band_cnt, col_ptr, ent);
  }
  return cudaGetLastError();
}

cudaError_t launch_transpose_bf16(const void* src, void* dst, int R, int C, cudaStream_t stream) {
  if (R == 0 || C == 0) return cudaSuccess;
  transpose_kernel<<<dim3((C + 31) / 32, (R + 31) / 32), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(src),
                                                                          static_cast<__nv_bfloat16*>(dst), R, C);
  return cudaGetLastError();
}

// Entries e = row * slots + k, one per (row, neuron): within a neuron's segment, ascending e is ascending
// row, so a power-of-two slots leaves its low bits out of the sort. A segmented radix sort, one block
// per segment: cub::DeviceSegmentedSort would read its segment groups back to the host (a stream sync).
cudaError_t launch_train_sort(void* temp, size_t* temp_bytes, const int* in, int* out, int n, int H, int slots,
                              const int* col_ptr, cudaStream_t stream) {
  int end_bit = 1, begin_bit = 0;
  while (end_bit < 31 && (int64_t(1) << end_bit) < int64_t(n)) ++end_bit;
  if (slots > 0 && (slots & (slots - 1)) == 0)
    while ((1 << (begin_bit + 1)) <= slots) ++begin_bit;
  begin_bit = std::min(begin_bit, end_bit - 1);
  return cub::DeviceSegmentedRadixSort::SortKeys(temp, *temp_bytes, reinterpret_cast<const unsigned*>(in),
                                                 reinterpret_cast<unsigned*>(out), n, H, col_ptr, col_ptr + 1,
                                                 begin_bit, end_bit, stream);
}

cudaError_t launch_train_heavy_l1(const int* count, const int* rows, const float* l1_part, int tiles, float* row_l1,
                                  int M, cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  heavy_l1_kernel<<<std::min((M + 255) / 256, 256), 256, 0, stream>>>(count, rows, l1_part, tiles, row_l1);
  return cudaGetLastError();
}

cudaError_t launch_train_heavy_grads(const void* g, const void* u, const void* ds, const float* l1_grad, void* h,
                                     void* du, void* dg, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bool vec = n % 8 == 0;
  for (const void* p : {g, u, ds, static_cast<const void*>(h), static_cast<const void*>(du), static_cast<const void*>(dg)})
    vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const size_t work = vec ? n / 8 : n;
  const int blocks = int(std::min<size_t>((work + 255) / 256, 4096));
  heavy_grads_kernel<<<blocks, 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(u), static_cast<const __nv_bfloat16*>(ds),
      l1_grad, static_cast<__nv_bfloat16*>(h), static_cast<__nv_bfloat16*>(du), static_cast<__nv_bfloat16*>(dg), n, vec);
  return cudaGetLastError();
}

cudaError_t launch_gate_product(const void* g, const void* u, void* h, size_t n, float threshold, bool up_relu,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bool vec = n % 8 == 0;
  for (const void* p : {g, u, static_cast<const void*>(h)}) vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  const size_t work = vec ? n / 8 : n;
  const int blocks = int(std::min<size_t>((work + 255) / 256, 4096));
  const float t = __bfloat162float(__float2bfloat16_rn(threshold));
  gate_product_kernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(g),
                                                  static_cast<const __nv_bfloat16*>(u), static_cast<__nv_bfloat16*>(h),
                                                  n, t, up_relu, vec);
  return cudaGetLastError();
}

cudaError_t launch_train_plan(const int* col_ptr, int H, int chunk, int* sizes, const int* incl, int* item_col,
                              int* item_lo, int* item_hi, int* item_part, int* long_col, int* long_lo, int* long_n,
                              bool fill, cudaStream_t stream) {
  const int blocks = (H + 255) / 256;
  if (fill)
    plan_fill_kernel<<<blocks, 256, 0, stream>>>(col_ptr, sizes, incl, H, chunk, item_col, item_lo, item_hi,
                                                 item_part, long_col, long_lo, long_n);
  else
    plan_count_kernel<<<blocks, 256, 0, stream>>>(col_ptr, H, chunk, sizes);
  return cudaGetLastError();
}

// Slices of D for the weight-gradient kernel: the fewest (a power of two, at least 256 columns each)
// whose gathered columns of x and dy, 2 * M * D / parts bf16 values, fit in half of the L2.
// forced > 0 sets the count (the benchmark's sweep, the tests). Never fewer than ceil(D / 2048): a
// block has one thread per 8 columns of its slice, at most 256.
int train_column_parts(int M, int D, int forced) {
  int parts = 1;
  if (forced > 0) {
    parts = forced;
  } else {
    int dev = 0, l2 = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
      l2 = 0;  // one slice; and clear the error, or the launch check after would report it
      (void)cudaGetLastError();
    }
    const int64_t bytes = int64_t(M) * D * 2 * 2;
    while (l2 > 0 && bytes / parts > l2 / 2 && D / (parts * 2) >= 256) parts *= 2;
  }
  return std::max((D + 2047) / 2048, std::min(parts, (D + 7) / 8));
}

cudaError_t launch_train_columns(const TrainColumns& a, cudaStream_t stream) {
  const int parts = a.parts > 0 ? a.parts : 1;
  const int part_cols = ((a.D / 8 + parts - 1) / parts) * 8;
  const int threads = ((part_cols / 8 + 31) / 32) * 32;
  if (a.n_items > 0) {
    columns_kernel<<<dim3(a.n_items, parts), threads, 0, stream>>>(
        a.ent, a.item_col, a.item_lo, a.item_hi, a.item_part, static_cast<const __nv_bfloat16*>(a.h),
        static_cast<const __nv_bfloat16*>(a.du), static_cast<const __nv_bfloat16*>(a.dg),
        static_cast<const __nv_bfloat16*>(a.x), static_cast<const __nv_bfloat16*>(a.dy),
        static_cast<const __nv_bfloat16*>(a.heavy_down), static_cast<const __nv_bfloat16*>(a.heavy_up),
        static_cast<const __nv_bfloat16*>(a.heavy_gate), static_cast<__nv_bfloat16*>(a.d_down_t),
        static_cast<__nv_bfloat16*>(a.d_up), static_cast<__nv_bfloat16*>(a.d_gate), a.partial, a.D, a.slots,
        part_cols);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (a.n_long > 0) {
    columns_reduce_kernel<<<dim3(a.n_long, parts), threads, 0, stream>>>(
        a.long_col, a.long_part_lo, a.long_part_n, a.partial, static_cast<const __nv_bfloat16*>(a.heavy_down),
        static_cast<const __nv_bfloat16*>(a.heavy_up), static_cast<const __nv_bfloat16*>(a.heavy_gate),
        static_cast<__nv_bfloat16*>(a.d_down_t), static_cast<__nv_bfloat16*>(a.d_up),
        static_cast<__nv_bfloat16*>(a.d_gate), a.D, part_cols);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace twell
