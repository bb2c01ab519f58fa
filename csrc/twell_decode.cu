// Gated FFN for a few rows (decoding: M <= 32), exact, reading only the active neurons' up and down
// weights (docs/decoding.md).
//
// At a few rows the FFN is a weight stream: dense reads W_gate, W_up and W_down once per call
// (3 x H x D bf16). The gate weights must be read in full; the up and down rows only where some row's
// gate is positive. Two kernels:
//   gate_up: one CTA per group of 16 neurons, its 8 warps splitting K (D). One thread stages the
//            group's 16 W_gate rows in shared memory with bulk copies (cp.async.bulk, one per row,
//            completing on one mbarrier), issued before the wait for the previous kernel: a few
//            instructions put the CTA's whole weight tile in flight, so the stream is not bounded by
//            what each thread can keep outstanding. K is staged in chunks of at most 2048 columns
//            (16 rows x 4160 bytes: 3 CTAs per SM), one barrier phase each. Rows land 64 bytes more
//            than their length apart, so each 8-lane phase of a fragment read (rows g and g + 1,
//            64 bytes of each) covers the 32 banks once. Tensor-core mma.sync m16n8k16 with the
//            weights as the A operand (16 neurons) and x as B (8 rows per n tile). The split sums
//            meet in shared memory (over the consumed staging area); the gate is rounded to bf16 and
//            ReLU'd as the dense path does. Then the same over W_up, copying only the active
//            neurons' rows (other rows' fragments are zeros, not read). h = bf16(gate * bf16(u))
//            goes to h_t [H, MP] (only active neurons' rows are written) and the group's 16-bit
//            activity mask to gmask.
//   down:    out = h @ w_down_t over the active neurons only. CTAs own 64 output columns and one of
//            SPLITS contiguous ranges of neuron groups; each lists its active neurons in neuron order,
//            its warps take them in turn. Split sums are added in split order by the last CTA of a
//            column slice to arrive, so the result does not depend on timing (deterministic).
//            Launched with programmatic stream serialization: it is resident before gate_up ends.
// Logical k order inside an mma does not matter for a dot product, so each lane loads 16 contiguous
// bytes (8 k) of a weight row and of an x row, and the two operands use the same k permutation.
// Rounding as in the dense bf16 FFN: gate, u and h rounded to bf16, sums in fp32.
#include "common.cuh"
#include "twell_kernels.h"

namespace twell {
namespace dec {

constexpr int WARPS = 8;         // gate_up: K split over the CTA's warps (k step s of 32 to warp s % WARPS)
constexpr int GROUP = 16;        // neurons per gate_up CTA (mma M)
constexpr int CHUNK = 2048;      // gate_up: most K columns staged at once (a multiple of WARPS * 32)
constexpr int PAD = 64;          // gate_up: bytes after each staged row (row stride = 64 mod 128)
constexpr int COLS = 64;         // down: output columns per CTA (2 per lane)
constexpr int DOWN_WARPS = 8;
constexpr int SPLITS = 16;       // down: neuron-group ranges per column slice
static_assert(CHUNK % (WARPS * 32) == 0, "chunks keep k step s with warp s % WARPS");

struct Params {
  const __nv_bfloat16* x;
  const __nv_bfloat16* w_gate;
  const __nv_bfloat16* w_up;
  const __nv_bfloat16* w_down_t;
  __nv_bfloat16* out;
  __nv_bfloat16* h_t;   // [n_groups * 16, MP]
  uint32_t* gmask;      // [n_groups]
  uint32_t* counters;   // [D / COLS], zero between calls (gate_up zeroes them, the last CTA resets)
  float* partial;       // [SPLITS, M, D]
  int M, D, H, n_groups;
  float threshold;      // FATReLU: a neuron is active where its bf16 gate is above bf16(threshold); 0: ReLU
  bool up_relu;         // dReLU: ReLU on the up product too; active where both are positive
};

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes of shared memory at addr when `live`, else zeros without a read (a predicated load).
__device__ __forceinline__ uint4 lds128_if(uint32_t addr, bool live) {
  uint4 v = make_uint4(0, 0, 0, 0);
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "r"(addr), "r"(uint32_t(live)));
  return v;
}

// K columns per staged chunk: D when it fits in one, else D split evenly, rounded up to a multiple of
// WARPS * 32 so that k step s stays with warp s % WARPS in every chunk (the per-warp summation order
// does not depend on the chunking). The last chunk may be narrower; every chunk is a multiple of 64.
__host__ __device__ inline int chunk_cols(int D) {
  const int n = (D + CHUNK - 1) / CHUNK;
  if (n <= 1) return D;
  constexpr int Q = WARPS * 32;
  return ((D + n - 1) / n + Q - 1) / Q * Q;
}

// Bytes between staged rows of chunks of kc columns: 2 kc + PAD, = 64 mod 128 (kc is a multiple of 64).
__host__ __device__ inline int row_stride(int kc) { return kc * 2 + PAD; }

// The staging area: 16 staged rows, or the warps' partial sums (reduce_warps) if larger.
template <int NT>
__host__ __device__ inline int stage_area(int kc) {
  const int rows = GROUP * row_stride(kc), sums = WARPS * NT * 4 * 32 * 4;
  return rows > sums ? rows : sums;
}

// Thread 0: one bulk copy per row i of the group whose bit is set in `rows`, of columns
// [k0, k0 + min(kc, D - k0)) of weight row n0 + i, to stage + i * row_stride(kc); the bytes complete the
// current phase of bar (its single arrival is this expect_tx). Sources are 16-byte aligned (w is,
// and row and chunk offsets are multiples of 128 bytes); so are the destinations (stride % 16 == 0).
__device__ __forceinline__ void issue_chunk(const __nv_bfloat16* w, int n0, uint32_t rows, int D, int k0, int kc,
                                            uint8_t* stage, uint64_t* bar) {
  const int stride = row_stride(kc);
  const uint32_t bytes = uint32_t(min(kc, D - k0)) * 2;
  mbar_expect_tx(bar, uint32_t(__popc(rows)) * bytes);
  for (uint32_t r = rows; r; r &= r - 1) {
    const int i = __ffs(r) - 1;
    bulk_copy(stage + i * stride, w + size_t(n0 + i) * D + k0, bytes, bar);
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
}

// acc = this warp's share of the 16 x MP product W[n0 .. n0 + 16) . x^T: k steps s of 32 columns with
// s % WARPS == warp, in increasing s. Lane (g, c) holds rows g and g + 8 and, per n tile, columns
// 2c and 2c + 1 (the mma's C layout); per k step it reads 16 bytes (8 consecutive k) of each of its
// two staged rows, at byte s_local * 64 + c * 16, and the same 8 k of x, which feed two mmas.
// Rows whose bit is clear in `rows` are not copied; their fragments are zeros. K is staged chunk by
// chunk in `stage`, each chunk a phase of bar (`phase`: the parity to wait for, flipped per chunk).
// The first chunk is already issued when `issued`; the other issues come after every thread's
// earlier accesses to `stage` (proxy fence, then the CTA barrier).
template <int NT>
__device__ __forceinline__ void group_product(const __nv_bfloat16* w, int n0, uint32_t rows, const __nv_bfloat16* x,
                                              int M, int D, int kc, int warp, int lane, uint8_t* stage,
                                              uint64_t* bar, uint32_t& phase, bool issued, float (&acc)[NT][4]) {
  zero(acc);
  const int g = lane >> 2, c = lane & 3;
  const bool live0 = (rows >> g) & 1, live1 = (rows >> (g + 8)) & 1;
  const int stride = row_stride(kc);
  const uint32_t r0 = smem_u32(stage) + g * stride + c * 16, r1 = r0 + 8 * stride;
  const __nv_bfloat16* xl = x + size_t(g) * D + c * 8;  // n tile t: 8 t rows further
  constexpr int UNROLL = 4 / NT;  // k steps whose loads the compiler may batch (registers)
  for (int k0 = 0; k0 < D; k0 += kc) {
    if (k0 > 0 || !issued) {
      fence_async_smem();
      __syncthreads();
      if (threadIdx.x == 0) issue_chunk(w, n0, rows, D, k0, kc, stage, bar);
    }
    mbar_wait(bar, phase);
    phase ^= 1;
    const int steps = min(kc, D - k0) / 32;
#pragma unroll UNROLL
    for (int sl = warp; sl < steps; sl += WARPS) {
      const uint4 a = lds128_if(r0 + sl * 64, live0), b = lds128_if(r1 + sl * 64, live1);
      const int k = k0 + sl * 32;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint4 xv = t * 8 + g < M ? __ldg(reinterpret_cast<const uint4*>(xl + size_t(t * 8) * D + k))
                                       : make_uint4(0, 0, 0, 0);
        mma_bf16(acc[t], a.x, b.x, a.y, b.y, xv.x, xv.y);
        mma_bf16(acc[t], a.z, b.z, a.w, b.w, xv.z, xv.w);
      }
    }
  }
}

// Sum the warps' accumulators (fixed order) into sum[16][MP] (neuron-major). `part` may alias the
// staging area: every warp has consumed the staged rows before the first barrier here.
template <int NT>
__device__ __forceinline__ void reduce_warps(const float (&acc)[NT][4], float* part, float* sum, int warp,
                                             int lane) {
  constexpr int VALS = NT * 4 * 32;
  __syncthreads();
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) part[(warp * NT * 4 + t * 4 + i) * 32 + lane] = acc[t][i];
  __syncthreads();
  for (int v = threadIdx.x; v < VALS; v += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < WARPS; ++k) s += part[k * VALS + v];
    const int l = v & 31, ti = v >> 5, t = ti >> 2, i = ti & 3;
    const int neuron = (l >> 2) + (i >= 2 ? 8 : 0);
    const int row = t * 8 + (l & 3) * 2 + (i & 1);
    sum[neuron * (NT * 8) + row] = s;
  }
  __syncthreads();
}

// Staging area, gate and up sums, mask word and mbarrier (16 bytes), alignment.
template <int NT>
size_t gate_up_smem(int D) {
  return size_t(stage_area<NT>(chunk_cols(D))) + 2 * GROUP * NT * 8 * 4 + 16 + 16;
}

template <int NT>
__global__ void __launch_bounds__(WARPS * 32, 3) gate_up_kernel(Params p) {
  constexpr int MP = NT * 8;
  uint8_t* smem = aligned_smem<16>();
  uint8_t* stage = smem;
  float* part = reinterpret_cast<float*>(smem);
  const int kc = chunk_cols(p.D);
  float* gate = reinterpret_cast<float*>(smem + stage_area<NT>(kc));
  float* up = gate + GROUP * MP;
  uint32_t* mask = reinterpret_cast<uint32_t*>(up + GROUP * MP);
  uint64_t* bar = reinterpret_cast<uint64_t*>(mask + 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = blockIdx.x * GROUP;
  const uint32_t rows = n0 + GROUP <= p.H ? 0xFFFFu : (1u << (p.H - n0)) - 1;  // neurons < H
  uint32_t phase = 0;
  // The gate weights do not depend on the kernels before this one: their copy starts now, and the
  // kernel launched before (programmatic stream serialization) may still be finishing.
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_async_smem();
    issue_chunk(p.w_gate, n0, rows, p.D, 0, kc, stage, bar);
  }
  __syncthreads();  // the barrier is initialised before any thread waits on it
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // The down kernel may be scheduled now; it waits for this grid's end before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < p.D / COLS; i += blockDim.x) p.counters[i] = 0;
  if (threadIdx.x == 0) mask[0] = mask[1] = 0;
  float acc[NT][4];
  group_product<NT>(p.w_gate, n0, rows, p.x, p.M, p.D, kc, warp, lane, stage, bar, phase, true, acc);
  reduce_warps<NT>(acc, part, gate, warp, lane);
  // The gate rounded to bf16 as dense rounds it, active where not <= bf16(threshold): a NaN stays (an
  // active entry, as in dense), and threshold 0 is ReLU.
  const float thr = __bfloat162float(__float2bfloat16_rn(p.threshold));
  for (int v = threadIdx.x; v < GROUP * MP; v += blockDim.x) {
    const int neuron = v / MP, row = v % MP;
    const float r = __bfloat162float(__float2bfloat16_rn(gate[v]));
    const bool on = n0 + neuron < p.H && row < p.M && !(r <= thr);
    gate[v] = on ? r : 0.f;
    if (on) atomicOr(mask, 1u << neuron);
  }
  __syncthreads();
  const uint32_t m = *mask;
  // dReLU lists for the down kernel only the neurons whose h is nonzero somewhere (set after h, below)
  if (threadIdx.x == 0 && (!p.up_relu || m == 0)) p.gmask[blockIdx.x] = m;
  if (m == 0) return;
  // The staging area (last written as the warps' partial sums) is reused: group_product fences and
  // synchronises the CTA before the copies.
  group_product<NT>(p.w_up, n0, m, p.x, p.M, p.D, kc, warp, lane, stage, bar, phase, false, acc);
  reduce_warps<NT>(acc, part, up, warp, lane);
  // h rows of the active neurons, MP bf16 each (16 bytes per 8 rows).
  for (int v = threadIdx.x; v < GROUP * NT; v += blockDim.x) {
    const int neuron = v / NT, t = v % NT;
    if (!((m >> neuron) & 1)) continue;
    uint32_t w[4];
    bool any = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i0 = neuron * MP + t * 8 + 2 * j;
      __nv_bfloat16 h2[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float gv = gate[i0 + e];
        float u = __bfloat162float(__float2bfloat16_rn(up[i0 + e]));
        bool on = gv != 0.f;  // the gate's activity (an inactive entry's gate is 0 here; an active one's is not)
        if (p.up_relu) {      // ReLU on u, NaN kept
          on = on && !(u <= 0.f);
          u = on ? u : 0.f;
        }
        any = any || on;
        h2[e] = __float2bfloat16_rn(on ? gv * u : 0.f);
      }
      w[j] = pack_bf16x2(h2[0], h2[1]);
    }
    *reinterpret_cast<uint4*>(p.h_t + size_t(n0 + neuron) * MP + t * 8) = make_uint4(w[0], w[1], w[2], w[3]);
    if (p.up_relu && any) atomicOr(mask + 1, 1u << neuron);
  }
  if (p.up_relu) {
    __syncthreads();
    if (threadIdx.x == 0) p.gmask[blockIdx.x] = mask[1];
  }
}

template <int NT>
size_t down_smem(int n_groups) {
  const int max_list = ((n_groups + SPLITS - 1) / SPLITS) * GROUP;
  return size_t(DOWN_WARPS) * NT * 8 * COLS * 4 + size_t(max_list) * 4 + 16;
}

template <int NT>
__global__ void __launch_bounds__(DOWN_WARPS * 32) down_kernel(Params p) {
  constexpr int MP = NT * 8;
  constexpr int BATCH = 8 / NT;  // neurons whose loads a warp issues together (registers: BATCH x MP h values)
  uint8_t* smem = aligned_smem<16>();
  float* red = reinterpret_cast<float*>(smem);                    // [DOWN_WARPS][MP][COLS]
  int* list = reinterpret_cast<int*>(red + DOWN_WARPS * MP * COLS);  // this CTA's active neurons, ascending
  __shared__ int n_list;
  __shared__ bool last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col = blockIdx.x * COLS + lane * 2;
  const int split = blockIdx.y;
  const int g_lo = int((int64_t(p.n_groups) * split) / SPLITS), g_hi = int((int64_t(p.n_groups) * (split + 1)) / SPLITS);
  // gate_up's writes (h_t, gmask, the zeroed counters) are visible after this.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (warp == 0) {
    int running = 0;
    for (int base = g_lo; base < g_hi; base += 32) {
      const int gi = base + lane;
      const uint32_t m = gi < g_hi ? __ldcg(p.gmask + gi) : 0u;
      const int cnt = __popc(m);
      const int incl = int(warp_incl_scan(uint32_t(cnt), lane));
      int at = running + incl - cnt;
      for (uint32_t r = m; r; r &= r - 1) list[at++] = gi * GROUP + (__ffs(r) - 1);
      running += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) n_list = running;
  }
  __syncthreads();
  const int n = n_list;
  float acc[MP][2];
#pragma unroll
  for (int r = 0; r < MP; ++r) acc[r][0] = acc[r][1] = 0.f;
  for (int j0 = warp; j0 < n; j0 += DOWN_WARPS * BATCH) {
    uint32_t w[BATCH];
    uint4 h[BATCH][NT];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = j0 + b * DOWN_WARPS;
      if (j < n) {
        const int neuron = list[j];
        w[b] = __ldg(reinterpret_cast<const uint32_t*>(p.w_down_t + size_t(neuron) * p.D + col));
#pragma unroll
        for (int t = 0; t < NT; ++t) h[b][t] = __ldcg(reinterpret_cast<const uint4*>(p.h_t + size_t(neuron) * MP) + t);
      } else {
        w[b] = 0;
#pragma unroll
        for (int t = 0; t < NT; ++t) h[b][t] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const float w0 = bf16lo(w[b]), w1 = bf16hi(w[b]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint32_t hw[4] = {h[b][t].x, h[b][t].y, h[b][t].z, h[b][t].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float h0 = bf16lo(hw[q]), h1 = bf16hi(hw[q]);
          acc[t * 8 + 2 * q][0] = fmaf(h0, w0, acc[t * 8 + 2 * q][0]);
          acc[t * 8 + 2 * q][1] = fmaf(h0, w1, acc[t * 8 + 2 * q][1]);
          acc[t * 8 + 2 * q + 1][0] = fmaf(h1, w0, acc[t * 8 + 2 * q + 1][0]);
          acc[t * 8 + 2 * q + 1][1] = fmaf(h1, w1, acc[t * 8 + 2 * q + 1][1]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < MP; ++r) {
    red[(warp * MP + r) * COLS + lane * 2] = acc[r][0];
    red[(warp * MP + r) * COLS + lane * 2 + 1] = acc[r][1];
  }
  __syncthreads();
  const int c0 = blockIdx.x * COLS;
  for (int v = threadIdx.x; v < p.M * COLS; v += blockDim.x) {
    const int r = v / COLS, cc = v % COLS;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < DOWN_WARPS; ++k) s += red[(k * MP + r) * COLS + cc];
    p.partial[(size_t(split) * p.M + r) * p.D + c0 + cc] = s;
  }
  // The last CTA of this column slice adds the splits in order.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.counters + blockIdx.x, 1u) == SPLITS - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int v = threadIdx.x; v < p.M * COLS; v += blockDim.x) {
    const int r = v / COLS, cc = v % COLS;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < SPLITS; ++k) s += __ldcg(p.partial + (size_t(k) * p.M + r) * p.D + c0 + cc);
    p.out[size_t(r) * p.D + c0 + cc] = __float2bfloat16_rn(s);
  }
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0;  // ready for the next call
}

int tiles_for(int M) { return M <= 8 ? 1 : M <= 16 ? 2 : 4; }

template <int NT>
cudaError_t launch_nt(const Params& p, cudaStream_t stream) {
  // Both kernels with programmatic stream serialization: gate_up copies its first weights while the
  // kernel before it finishes, down is resident before gate_up ends. Each waits (griddepcontrol.wait)
  // for the previous grid's end before it reads or writes anything another kernel touches.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.gridDim = dim3(p.n_groups);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = gate_up_smem<NT>(p.D);
  cudaError_t err = cudaFuncSetAttribute(gate_up_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(cfg.dynamicSmemBytes));
  if (err == cudaSuccess) err = cudaLaunchKernelEx(&cfg, gate_up_kernel<NT>, p);
  if (err != cudaSuccess) return err;
  cfg.gridDim = dim3(p.D / COLS, SPLITS);
  cfg.blockDim = dim3(DOWN_WARPS * 32);
  cfg.dynamicSmemBytes = down_smem<NT>(p.n_groups);
  err = cudaFuncSetAttribute(down_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(cfg.dynamicSmemBytes));
  if (err != cudaSuccess) return err;
  return cudaLaunchKernelEx(&cfg, down_kernel<NT>, p);
}

}  // namespace dec

size_t decode_workspace_bytes(int M, int D, int H) {
  const int n_groups = (H + dec::GROUP - 1) / dec::GROUP;
  const int MP = dec::tiles_for(M) * 8;
  size_t bytes = size_t(n_groups) * dec::GROUP * MP * 2;       // h_t
  bytes += size_t(n_groups) * 4 + size_t(D / dec::COLS) * 4;  // gmask, counters
  bytes = (bytes + 15) & ~size_t(15);
  return bytes + size_t(dec::SPLITS) * M * D * 4;             // partial
}

cudaError_t launch_decode_ffn(const void* x, const void* w_gate, const void* w_up, const void* w_down_t, void* out,
                              void* workspace, int M, int D, int H, cudaStream_t stream, float threshold,
                              bool up_relu) {
  if (M < 1 || M > kDecodeMaxRows || D % dec::COLS != 0 || D <= 0 || H < 1 || H > kDecodeMaxH ||
      !(threshold >= 0.f && threshold <= 3.0e38f)) {
    set_error("decode FFN: needs 1 <= M <= 32, D a positive multiple of 64, 1 <= H <= 2^18, a finite threshold >= 0");
    return cudaErrorInvalidValue;
  }
  dec::Params p;
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.w_gate = static_cast<const __nv_bfloat16*>(w_gate);
  p.w_up = static_cast<const __nv_bfloat16*>(w_up);
  p.w_down_t = static_cast<const __nv_bfloat16*>(w_down_t);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.M = M;
  p.D = D;
  p.H = H;
  p.n_groups = (H + dec::GROUP - 1) / dec::GROUP;
  p.threshold = threshold;
  p.up_relu = up_relu;
  const int NT = dec::tiles_for(M), MP = NT * 8;
  char* base = static_cast<char*>(workspace);
  p.h_t = reinterpret_cast<__nv_bfloat16*>(base);
  size_t off = size_t(p.n_groups) * dec::GROUP * MP * 2;
  p.gmask = reinterpret_cast<uint32_t*>(base + off);
  off += size_t(p.n_groups) * 4;
  p.counters = reinterpret_cast<uint32_t*>(base + off);
  off += size_t(D / dec::COLS) * 4;
  off = (off + 15) & ~size_t(15);
  p.partial = reinterpret_cast<float*>(base + off);
  switch (NT) {
    case 1: return dec::launch_nt<1>(p, stream);
    case 2: return dec::launch_nt<2>(p, stream);
    default: return dec::launch_nt<4>(p, stream);
  }
}

}  // namespace twell
