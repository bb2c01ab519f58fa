// The consumer side of the wgmma pipelines (gate, dense and union kernels): one K loop over ring
// stages, each holding KS k16-steps of a 64-row A slice and a 256-column B tile.
#pragma once
#include <stdint.h>

#include "common.cuh"
#include "wgmma_m64n256.cuh"

namespace twell {

// Runs `steps` stages from (stage, phase) on: waits for each stage's `full` barrier, issues its MMAs,
// and releases the previous stage once its MMAs are done (one group in flight), then waits for all
// and releases the last. acc accumulates (the caller zeroes it).
//   a_addr(stage)     shared address of the stage's A slice (K-major, 128B swizzle)
//   b_desc(stage, k)  wgmma descriptor of k-step k of the stage's B tile
//   release(stage)    arrive on the stage's empty barrier(s); called by every thread
// FENCE: the producer fills stages through the generic proxy (cp.async, st.shared), so they must be
// fenced before the async-proxy wgmma reads them; TMA-filled stages need no fence.
// HOLD_LAST: the last stage is not released; the caller may reuse it and must release it.
// Returns the last stage used (-1 when steps is 0).
template <int TB, int KS, int NST, bool FENCE, bool HOLD_LAST = false, class AAddr, class BDesc, class Release>
__device__ __forceinline__ int wgmma_k_loop(float (&acc)[128], int steps, uint64_t* full, int& stage,
                                             uint32_t& phase, AAddr a_addr, BDesc b_desc, Release release) {
  int prev = -1;
  for (int kb = 0; kb < steps; ++kb) {
    mbar_wait(&full[stage], phase);
    if constexpr (FENCE) fence_async_smem();
    const uint32_t a = a_addr(stage);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < KS; ++k) wgmma_m64n256k16_bf16<TB>(acc, smem_desc(a + 32 * k), b_desc(stage, k), 1);
    wgmma_commit();
    wgmma_wait<1>();  // the previous stage's products are done: release it
    if (prev >= 0) release(prev);
    prev = stage;
    if (++stage == NST) { stage = 0; phase ^= 1; }
  }
  wgmma_wait<0>();
  if (!HOLD_LAST && prev >= 0) release(prev);
  return prev;
}

}  // namespace twell
