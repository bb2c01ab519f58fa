// Probe (not part of the extension): a weight-stationary DOWN pass over all of H, on CUDA cores.
//
// Question (session 22): the per-row fused kernel gathers 8 KB of weights per (token, active neuron)
// from L2 and sits at that ceiling. If the up half stays a gather (4 KB per pair, writing h = gate *
// u per pair) and the down half reads its weights from shared memory instead, does the down half get
// cheap enough to pay for a second pass? session 21's estimate of two gather passes
// (reports/bench/two-pass-estimate-H100-20261125.csv) puts the break-even for nnz 8 at a down pass
// of ~0.25 ms, against ~0.4 ms for the gather.
//
// Layout: CTA c owns output columns [16 c, 16 c + 16) and holds w_down_t[:, those columns] for all
// of H in shared memory (H x 32 bytes: 176 KB at H = 5632), so no partial sums cross CTAs. Every CTA
// walks every row: a thread owns a row (16 fp32 accumulators), reads its entries (CSR, rows padded
// to 4 entries, value bf16 << 16 | neuron) with 16-byte loads, and for each entry reads the neuron's
// 32-byte weight row from shared memory. A 32-byte row spans two 16-byte bank groups; the halves of
// rows 4k..4k+3 are swapped on odd k, so the first load of a random row lands on any of the 8 groups.
// NOCONF: see neuron() (timing only). Rows are taken in storage order: a caller that wants rows of
// similar length in one warp stores the CSR that way (the first run of this probe also tried 512
// threads and an index list of rows; both were slower and were removed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

namespace {

__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte offset of 16-byte half `h` of weight row n.
__device__ __forceinline__ uint32_t half_off(uint32_t n, uint32_t h) { return n * 32u + ((h ^ ((n >> 2) & 1u)) << 4); }

__device__ __forceinline__ void fma8(float* acc, float h, uint4 w) {
  acc[0] = fmaf(h, lo(w.x), acc[0]); acc[1] = fmaf(h, hi(w.x), acc[1]);
  acc[2] = fmaf(h, lo(w.y), acc[2]); acc[3] = fmaf(h, hi(w.y), acc[3]);
  acc[4] = fmaf(h, lo(w.z), acc[4]); acc[5] = fmaf(h, hi(w.z), acc[5]);
  acc[6] = fmaf(h, lo(w.w), acc[6]); acc[7] = fmaf(h, hi(w.w), acc[7]);
}

// H2: the tile holds the weights as fp16 and each group of 4 entries is summed with packed fp16
// FMAs (HFMA2: 2 MACs per instruction, no bf16 unpacking), then added to the fp32 accumulators.
// 4 products in fp16 err ~2^-11 relative, under the bf16 rounding of the output (2^-9). A real
// path would need per-row and per-tile power-of-2 scales against fp16's range; the probe has none.
// The entry's neuron. NOCONF (timing only, wrong values): its low 3 bits replaced by the lane's, so the
// 8 lanes of each quarter-warp read 8 different bank groups: what conflict-free reads would give.
template <bool NOCONF>
__device__ __forceinline__ uint32_t neuron(uint32_t e) {
  return NOCONF ? ((e & 0xFFF8u) | (threadIdx.x & 7u)) : (e & 0xFFFFu);
}

constexpr int THREADS = 1024;

template <bool NOCONF, bool H2>
__global__ void __launch_bounds__(THREADS, 1)
sdown_kernel(const uint32_t* __restrict__ rowptr, const uint32_t* __restrict__ ent, const __nv_bfloat16* __restrict__ w_down_t, __nv_bfloat16* __restrict__ out, int M, int D, int H) {
  extern __shared__ __align__(16) uint8_t sm[];
  const uint32_t ws = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  const int c0 = blockIdx.x * 16;
  for (int n = threadIdx.x; n < H; n += THREADS) {
    const uint4* src = reinterpret_cast<const uint4*>(w_down_t + size_t(n) * D + c0);
    uint4 a = __ldg(src), b = __ldg(src + 1);
    if (H2) {
      uint32_t* w[2] = {&a.x, &b.x};
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t v = w[hh][i];
          const __half2 f = __floats2half2_rn(lo(v), hi(v));
          w[hh][i] = *reinterpret_cast<const uint32_t*>(&f);
        }
    }
    *reinterpret_cast<uint4*>(sm + half_off(n, 0)) = a;
    *reinterpret_cast<uint4*>(sm + half_off(n, 1)) = b;
  }
  __syncthreads();
  for (int row = threadIdx.x; row < M; row += THREADS) {
    const uint32_t p0 = __ldg(rowptr + row), p1 = __ldg(rowptr + row + 1);
    float acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    const uint4* e4 = reinterpret_cast<const uint4*>(ent);
    uint4 nxt = p0 < p1 ? __ldg(e4 + p0 / 4) : make_uint4(0, 0, 0, 0);
    for (uint32_t k = p0; k < p1; k += 4) {
      const uint4 cur = nxt;
      if (k + 4 < p1) nxt = __ldg(e4 + k / 4 + 1);
      const uint32_t e[4] = {cur.x, cur.y, cur.z, cur.w};
      if (H2) {
        __half2 a2[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) a2[i] = __float2half2_rn(0.f);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t n = neuron<NOCONF>(e[j]);
          const __half2 h2 = __float2half2_rn(hi(e[j]));
          const uint4 w0 = lds128(ws + half_off(n, 0)), w1 = lds128(ws + half_off(n, 1));
          const uint32_t w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) a2[i] = __hfma2(h2, *reinterpret_cast<const __half2*>(&w[i]), a2[i]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float2 f = __half22float2(a2[i]);
          acc[2 * i] += f.x;
          acc[2 * i + 1] += f.y;
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t n = neuron<NOCONF>(e[j]);
        const float h = hi(e[j]);
        fma8(acc, h, lds128(ws + half_off(n, 0)));
        fma8(acc + 8, h, lds128(ws + half_off(n, 1)));
      }
    }
    uint4 o0, o1;
    o0.x = pack2(acc[0], acc[1]); o0.y = pack2(acc[2], acc[3]); o0.z = pack2(acc[4], acc[5]); o0.w = pack2(acc[6], acc[7]);
    o1.x = pack2(acc[8], acc[9]); o1.y = pack2(acc[10], acc[11]); o1.z = pack2(acc[12], acc[13]); o1.w = pack2(acc[14], acc[15]);
    uint4* dst = reinterpret_cast<uint4*>(out + size_t(row) * D + c0);
    dst[0] = o0;
    dst[1] = o1;
  }
}

}  // namespace

// out[M, D] = sum over each row's entries of value * w_down_t[neuron, :]. rowptr [M + 1] (multiples of
// 4), ent [rowptr[M]] (padding entries have value 0).
void sdown(torch::Tensor rowptr, torch::Tensor ent, torch::Tensor w_down_t, torch::Tensor out, bool noconf, bool h2) {
  const int M = int(out.size(0)), D = int(out.size(1)), H = int(w_down_t.size(0));
  TORCH_CHECK(D % 16 == 0 && w_down_t.size(1) == D, "shapes");
  const int smem = H * 32;
  auto go = [&](auto kern) {
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kern<<<D / 16, THREADS, smem>>>(reinterpret_cast<const uint32_t*>(rowptr.data_ptr<int32_t>()),
                                    reinterpret_cast<const uint32_t*>(ent.data_ptr<int32_t>()),
                                    reinterpret_cast<const __nv_bfloat16*>(w_down_t.data_ptr<at::BFloat16>()),
                                    reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()), M, D, H);
  };
  if (h2) noconf ? go(sdown_kernel<true, true>) : go(sdown_kernel<false, true>);
  else noconf ? go(sdown_kernel<true, false>) : go(sdown_kernel<false, false>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("sdown", &sdown); }
