// Shared device helpers for the TwELL kernels (Hopper, sm_90a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace twell {

// TwELL word: (bf16 bits << 16) | global column (see src/twell/formats/twell.py).
__device__ __forceinline__ float entry_value(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t entry_col(uint32_t w) { return w & 0xFFFFu; }

// bf16x2 word -> two floats (a bf16 is the upper half of a float).
__device__ __forceinline__ float bf16lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Two bf16 -> one bf16x2 word (lo in the lower half), the inverse of bf16lo / bf16hi.
__device__ __forceinline__ uint32_t pack_bf16x2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}

// ReLU that keeps NaN (fmaxf would turn NaN into 0, hiding a bad input), rounded to bf16.
__device__ __forceinline__ __nv_bfloat16 relu_bf16(float v) {
  return __float2bfloat16_rn(v > 0.f || v != v ? v : 0.f);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Spin until the mbarrier's phase of the given parity has completed.
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

// 16-byte shared-memory load by address (a generic pointer compiled to generic 64-bit loads).
// Volatile keeps it in order with the mbarrier waits and arrives around it, which are volatile too.
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Arrive on bar and add `bytes` to the transaction count its phase waits for.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Order this thread's earlier generic-proxy accesses to shared memory before later async-proxy ones
// (a bulk copy must not overwrite a buffer that is still being read).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Bulk copy of `bytes` (a multiple of 16, 16-byte aligned) from global to shared memory; completes
// as transactions on bar (see mbar_expect_tx).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Shared-memory matrix descriptor for wgmma with 128-byte swizzle (1024-byte aligned atoms of
// 8 rows x 128 bytes). K-major tiles (rows of 64 bf16 along K): lbo unused, sbo = 1024 (8-row
// groups). MN-major tiles: lbo = bytes between 64-element atoms along M/N, sbo = bytes between
// 8-row groups along K.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo = 16, uint32_t sbo = 1024) {
  uint64_t d = 0;
  d |= uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t((lbo >> 4) & 0x3FFF) << 16;
  d |= uint64_t((sbo >> 4) & 0x3FFF) << 32;
  d |= uint64_t(1) << 62;  // swizzle mode: 128 bytes
  return d;
}
__device__ __forceinline__ uint64_t smem_desc(const void* p) { return smem_desc(smem_u32(p)); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Warp-wide inclusive prefix sum.
__device__ __forceinline__ uint32_t warp_incl_scan(uint32_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Count word of a tile row that overflowed into the gate kernel's spill area: SPILL_BIT | offset,
// with spill[offset] = count, then the entries.
constexpr uint32_t SPILL_BIT = 0x80000000u;

// A tile row's entries: true count, where they are, and whether they exist (false: the tile
// overflowed without a spill copy; only its count is known).
struct TileEntries {
  uint32_t count;
  const uint32_t* entries;
  bool stored;
};

// TwELL words and spill entries are read with ld.global.cg (L2 only), not the non-coherent path:
// in the one op the fused kernel may run while the gate kernel still writes rows it has not yet released
// (ready flags, twell_ffn.cu), and a line cached on the non-coherent path could be stale. Each word
// is read once, so no reuse is lost.
__device__ __forceinline__ uint32_t ld_cg(const uint32_t* p) { return __ldcg(p); }

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Resolve count word w of the tile row whose words start at seg (S words: count, then slots).
__device__ __forceinline__ TileEntries resolve_tile(uint32_t w, const uint32_t* seg, const uint32_t* spill, int S) {
  if ((w & SPILL_BIT) && spill != nullptr) {
    const uint32_t* sp = spill + (w & ~SPILL_BIT);
    return {ld_cg(sp), sp + 1, true};
  }
  return {w, seg + 1, w <= uint32_t(S - 1)};
}

// One row's entries, tile after tile, written to dst (shared or global memory) by the whole warp,
// straight from the row's n_tiles * S TwELL words in global memory, in two round trips: the tiles'
// count words (lane t resolves tiles t, t + 32, ...), then every entry word at once (one load per
// lane per 32 entries). Returns the number of entries, or -1 when there are more than CAP or a tile
// overflowed without a spill copy.
template <int CAP>
__device__ __forceinline__ int row_entries(uint32_t* dst, const uint32_t* words, const uint32_t* spill, int n_tiles,
                                           int S, int lane) {
  int n = 0;
  for (int tb = 0; tb < n_tiles; tb += 32) {
    const int t = tb + lane;
    TileEntries te{0u, nullptr, true};
    uint32_t first = 0;  // the first entry's word in the row, or SPILL_BIT | its index in the spill area
    if (t < n_tiles) {
      const uint32_t* seg = words + size_t(t) * S;
      te = resolve_tile(ld_cg(seg), seg, spill, S);
      first = te.entries == seg + 1 ? uint32_t(t * S + 1) : SPILL_BIT | uint32_t(te.entries - spill);
    }
    if (__any_sync(0xffffffffu, !te.stored)) return -1;
    const uint32_t count = te.count;
    const uint32_t incl = warp_incl_scan(count, lane);
    const int total = int(__shfl_sync(0xffffffffu, incl, 31));
    if (n + total > CAP) return -1;
    uint32_t* d = dst + n + (incl - count);
    for (uint32_t j = 0; j < count; ++j) d[j] = first + j;
    n += total;
  }
  __syncwarp();  // the word indices written by the other lanes are visible to the whole warp
  uint32_t v[(CAP + 31) / 32];
#pragma unroll
  for (int k = 0; k < (CAP + 31) / 32; ++k) {
    const int i = 32 * k + lane;
    if (i < n) {
      const uint32_t r = dst[i];
      v[k] = (r & SPILL_BIT) ? ld_cg(spill + (r & ~SPILL_BIT)) : ld_cg(words + r);
    }
  }
#pragma unroll
  for (int k = 0; k < (CAP + 31) / 32; ++k)
    if (32 * k + lane < n) dst[32 * k + lane] = v[k];
  __syncwarp();
  return n;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint4 ldg_nc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// rowcnt of a row that another kernel computes (the per-row kernels), in the union path's plan.
constexpr uint32_t NOT_HERE = 0xFFFFFFFFu;

// The dynamic shared memory, aligned to ALIGN bytes (1024 for 128-byte swizzled wgmma tiles).
// The padding is added to the array itself, not to an integer made from its address: the compiler
// then still knows that the pointer and everything derived from it are shared memory, and emits
// ld/st.shared. (Rounding a uintptr_t loses that: every access became a generic LD.E / ST.E, whose
// latency sat in the union down kernel's row builders; docs/kernels.md §7, "shared memory by address".)
template <int ALIGN>
__device__ __forceinline__ uint8_t* aligned_smem() {
  extern __shared__ uint8_t raw[];
  return raw + ((ALIGN - smem_u32(raw) % ALIGN) % ALIGN);
}

// 16-byte copy global -> shared (cp.async); zero-filled when !valid (src is not read then).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// x . w over 8 columns: x in fp32, w 8 packed bf16.
__device__ __forceinline__ float dot8(const float* x, const uint4& w) {
  float s = x[0] * bf16lo(w.x);
  s = fmaf(x[1], bf16hi(w.x), s);
  s = fmaf(x[2], bf16lo(w.y), s);
  s = fmaf(x[3], bf16hi(w.y), s);
  s = fmaf(x[4], bf16lo(w.z), s);
  s = fmaf(x[5], bf16hi(w.z), s);
  s = fmaf(x[6], bf16lo(w.w), s);
  s = fmaf(x[7], bf16hi(w.w), s);
  return s;
}

// acc += s * w over 8 columns (w 8 packed bf16).
__device__ __forceinline__ void axpy8(float* acc, float s, const uint4& w) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = fmaf(s, bf16lo(u[j]), acc[2 * j]);
    acc[2 * j + 1] = fmaf(s, bf16hi(u[j]), acc[2 * j + 1]);
  }
}

}  // namespace twell
