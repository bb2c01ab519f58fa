// Gated FFN for a few rows (decoding: M <= 32), exact, reading only the active neurons' up and down
// weights (docs/decoding.md).
//
// At a few rows the FFN is a weight stream: dense reads W_gate, W_up and W_down once per call
// (3 x H x D bf16). The gate weights must be read in full; the up and down rows only where some row's
// gate is positive. Two kernels:
//   gate_up: one CTA per group of 16 neurons, its 8 warps splitting K (D). Tensor-core mma.sync
//            m16n8k16 with the weights as the A operand (16 neurons) and x as B (8 rows per n tile),
//            so each weight word is loaded once, straight from global memory into the fragment.
//            The split sums meet in shared memory; the gate is rounded to bf16 and ReLU'd as the
//            dense path does. Then the same loop over W_up, loading only the active neurons' rows
//            (other rows' fragments are zeros). h = bf16(gate * bf16(u)) goes to h_t [H, MP]
//            (only active neurons' rows are written) and the group's 16-bit activity mask to gmask.
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

constexpr int WARPS = 8;         // gate_up: K split over the CTA's warps
constexpr int GROUP = 16;        // neurons per gate_up CTA (mma M)
constexpr int DEPTH = 8;         // k steps of 32 per warp whose weight words are in flight together
constexpr int STAGE_BYTES = WARPS * DEPTH * 2 * 32 * 16;  // 64 KB: each lane's 2 x DEPTH 16-byte words
constexpr int COLS = 64;         // down: output columns per CTA (2 per lane)
constexpr int DOWN_WARPS = 8;
constexpr int SPLITS = 16;       // down: neuron-group ranges per column slice

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
};

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Lane (g = lane / 4, c = lane % 4) of warp `warp` copies, for chunk `chunk` of its k steps
// (s = warp + (chunk * DEPTH + d) * WARPS), 16 bytes of weight rows n0 + g and n0 + g + 8 into its own
// slots of `stage` (cp.async, one group). Rows whose `live` flag is false are zero-filled, not read.
// Each lane later reads back only its own slots: no barrier between copy and use.
__device__ __forceinline__ void issue_rows(const __nv_bfloat16* w, int n0, bool live0, bool live1, int D, int warp,
                                           int lane, int chunk, uint4* stage) {
  const int g = lane >> 2, c = lane & 3, steps = D / 32;
  const __nv_bfloat16* w0 = w + size_t(live0 ? n0 + g : 0) * D + c * 8;
  const __nv_bfloat16* w1 = w + size_t(live1 ? n0 + g + 8 : 0) * D + c * 8;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    const int s = warp + (chunk * DEPTH + d) * WARPS;
    if (s < steps) {
      uint4* slot = stage + ((warp * DEPTH + d) * 2) * 32 + lane;
      cp_async16(smem_u32(slot), w0 + s * 32, live0);
      cp_async16(smem_u32(slot + 32), w1 + s * 32, live1);
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// acc += this warp's share of chunk `chunk` of the 16 x MP product W[n0 .. n0 + 16) . x^T, from the
// words issue_rows staged. Lane (g, c) holds rows g and g + 8 and, per n tile, columns 2c and 2c + 1
// (the mma's C layout). Logical k order inside an mma does not matter for a dot product: each lane's
// 16 staged bytes (8 consecutive k) feed two mmas, and x is loaded with the same permutation.
template <int NT>
__device__ __forceinline__ void consume_rows(const __nv_bfloat16* x, int M, int D, int warp, int lane, int chunk,
                                             const uint4* stage, float (&acc)[NT][4]) {
  const int g = lane >> 2, c = lane & 3, steps = D / 32;
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    const int s = warp + (chunk * DEPTH + d) * WARPS;
    if (s >= steps) break;
    const uint4* slot = stage + ((warp * DEPTH + d) * 2) * 32 + lane;
    const uint4 a = slot[0], b = slot[32];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int row = t * 8 + g;
      const uint4 xv = row < M ? __ldg(reinterpret_cast<const uint4*>(x + size_t(row) * D + s * 32 + c * 8))
                               : make_uint4(0, 0, 0, 0);
      mma_bf16(acc[t], a.x, b.x, a.y, b.y, xv.x, xv.y);
      mma_bf16(acc[t], a.z, b.z, a.w, b.w, xv.z, xv.w);
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
}

// The whole product for rows n0 .. n0 + 16 (the first chunk already issued unless `issued` is false).
template <int NT>
__device__ __forceinline__ void group_product(const __nv_bfloat16* w, int n0, bool live0, bool live1,
                                              const __nv_bfloat16* x, int M, int D, int warp, int lane,
                                              uint4* stage, bool issued, float (&acc)[NT][4]) {
  zero(acc);
  const int chunks = (D / 32 + WARPS * DEPTH - 1) / (WARPS * DEPTH);
  for (int ch = 0; ch < chunks; ++ch) {
    if (ch > 0 || !issued) issue_rows(w, n0, live0, live1, D, warp, lane, ch, stage);
    consume_rows<NT>(x, M, D, warp, lane, ch, stage, acc);
  }
}

// Sum the warps' accumulators (fixed order) into sum[16][MP] (neuron-major). `part` may alias the
// staging area: every warp has consumed its slots before the first barrier here.
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

template <int NT>
constexpr int gate_up_smem() {
  return STAGE_BYTES + 2 * GROUP * NT * 8 * 4 + 16 + 16;  // stage, gate and up sums, mask, alignment
}

template <int NT>
__global__ void __launch_bounds__(WARPS * 32, 3) gate_up_kernel(Params p) {
  constexpr int MP = NT * 8;
  static_assert(WARPS * NT * 4 * 32 * 4 <= STAGE_BYTES, "the warp sums must fit in the staging area");
  uint8_t* smem = aligned_smem<16>();
  uint4* stage = reinterpret_cast<uint4*>(smem);
  float* part = reinterpret_cast<float*>(smem);
  float* gate = reinterpret_cast<float*>(smem + STAGE_BYTES);
  float* up = gate + GROUP * MP;
  uint32_t* mask = reinterpret_cast<uint32_t*>(up + GROUP * MP);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = blockIdx.x * GROUP, g = lane >> 2;
  const bool live0 = n0 + g < p.H, live1 = n0 + g + 8 < p.H;
  // The gate weights do not depend on the kernels before this one: their copy starts now, and the
  // kernel launched before (programmatic stream serialization) may still be finishing.
  issue_rows(p.w_gate, n0, live0, live1, p.D, warp, lane, 0, stage);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // The down kernel may be scheduled now; it waits for this grid's end before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < p.D / COLS; i += blockDim.x) p.counters[i] = 0;
  if (threadIdx.x == 0) *mask = 0;
  float acc[NT][4];
  group_product<NT>(p.w_gate, n0, live0, live1, p.x, p.M, p.D, warp, lane, stage, true, acc);
  reduce_warps<NT>(acc, part, gate, warp, lane);
  for (int v = threadIdx.x; v < GROUP * MP; v += blockDim.x) {
    const int neuron = v / MP, row = v % MP;
    const float r = __bfloat162float(relu_bf16(gate[v]));  // NaN stays (an active entry, as in dense)
    const bool on = n0 + neuron < p.H && row < p.M && (r > 0.f || r != r);
    gate[v] = on ? r : 0.f;
    if (on) atomicOr(mask, 1u << neuron);
  }
  __syncthreads();
  const uint32_t m = *mask;
  if (threadIdx.x == 0) p.gmask[blockIdx.x] = m;
  if (m == 0) return;
  group_product<NT>(p.w_up, n0, (m >> g) & 1, (m >> (g + 8)) & 1, p.x, p.M, p.D, warp, lane, stage, false, acc);
  reduce_warps<NT>(acc, part, up, warp, lane);
  // h rows of the active neurons, MP bf16 each (16 bytes per 8 rows).
  for (int v = threadIdx.x; v < GROUP * NT; v += blockDim.x) {
    const int neuron = v / NT, t = v % NT;
    if (!((m >> neuron) & 1)) continue;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i0 = neuron * MP + t * 8 + 2 * j;
      __nv_bfloat16 h2[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float gv = gate[i0 + e];
        const float u = __bfloat162float(__float2bfloat16_rn(up[i0 + e]));
        h2[e] = __float2bfloat16_rn(gv == 0.f ? 0.f : gv * u);
      }
      w[j] = pack_bf16x2(h2[0], h2[1]);
    }
    *reinterpret_cast<uint4*>(p.h_t + size_t(n0 + neuron) * MP + t * 8) = make_uint4(w[0], w[1], w[2], w[3]);
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
  cfg.dynamicSmemBytes = gate_up_smem<NT>();
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
                              void* workspace, int M, int D, int H, cudaStream_t stream) {
  if (M < 1 || M > kDecodeMaxRows || D % dec::COLS != 0 || D <= 0 || H < 1) {
    set_error("decode FFN: needs 1 <= M <= 32, D a positive multiple of 64, H >= 1");
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
