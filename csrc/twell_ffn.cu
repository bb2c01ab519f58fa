// Fused sparse up/down projection from a TwELL activation (inference).
//
//   gated:      out[m] = sum over active n of h[m,n] * (x[m] . w_up[n]) * w_down_t[n]
//   non-gated:  out[m] = sum over active n of h[m,n] * w_down_t[n]
//
// The cost is moving two 4 KB weight rows (w_up[n], w_down_t[n]) from L2 per active neuron and
// token; a first version (one pair in flight per warp, registers only) was latency-bound at ~2.9 TB/s.
// Here each warp keeps K pairs in flight: lane 0 copies the rows of upcoming neurons into a
// K-stage shared-memory ring with cp.async.bulk (one instruction per row, completion on an
// mbarrier) while the warp computes on the current stage. x of the row sits in registers (fp32),
// the output accumulates in fp32 registers, the hidden state never reaches memory.
//
// Inner loop (docs/kernels.md §4). An earlier loop compiled to 596 instructions per active neuron:
// generic 64-bit loads from the ring, one branch per 256-column chunk (D is a runtime value) that
// serialised the 16 loads, and x converted from bf16 again for every neuron. Now: shared-memory
// loads by address, all chunk loads issued before the math, no per-chunk branch (FULL = D is a
// multiple of 256, else chunks past D are zeroed by select), x converted once per row: 375.
//
// Rows are split by work: a "light" row (at most LIST_CAP active neurons, no unresolved overflow)
// is done by one warp (light kernel); heavier rows are queued on the device and done by a whole
// CTA each (heavy kernel: the CTA's warps split the row's entries and reduce their partial
// outputs through shared memory), so a row with a thousand active neurons does not hold one warp
// for milliseconds; when enough rows are heavy, the dense path (twell_dense.cu) computes them
// all on the tensor cores instead. All launches are fixed-size (no host synchronisation: CUDA graphs
// work).
//
// Entries come from the TwELL slots, or from the gate kernel's spill area for overflowing tiles
// (count word 0x80000000 | offset -> spill[offset] = count, then entries). A tile whose count
// exceeds its slots without a spill copy is recomputed here from x and w_act (the weight whose
// ReLU made the TwELL), neuron by neuron: exact for any pattern. Without w_act such rows are left
// to the caller (who has their dense copy).
#include "common.cuh"
#include "twell_kernels.h"

namespace twell {
namespace ffn {

constexpr int WARPS = 8;          // warps per CTA (both kernels)
constexpr int K = 3;              // pairs in flight per warp
constexpr int STAGE = 8192;       // bytes per ring stage: up row + down row of D <= 2048 bf16
// Entries per warp list; rows with more are heavy. 128 because heavy rows mostly take the dense path
// (twell_dense.cu): with it, 256 -> 128 took the heavy tail from 3.83 to 3.58 ms and nnz 64 from
// 6.40 to 6.09 ms (docs/kernels.md §5).
constexpr int LIST_CAP = 128;
constexpr int FLAT = 4096;        // heavy kernel: one CTA-wide list of a tile group's entries (tile <= FLAT)

// The heavy-row queue: header words (zeroed before the light kernel), then the heavy rows.
enum : int { Q_HEAVY_COUNT = 0, Q_NEXT_LIGHT = 1, Q_NEXT_HEAVY = 2, Q_ROWS = 3 };
// Its words for M rows, 16-byte aligned.
inline size_t heavy_words(int M) { return (size_t(M) + Q_ROWS + 3) & ~size_t(3); }

struct Params {
  const __nv_bfloat16* x;
  const uint32_t* tw;
  const uint32_t* spill;          // may be null
  const __nv_bfloat16* w_act;     // may be null
  const __nv_bfloat16* w_up;      // null for non-gated
  const __nv_bfloat16* w_down_t;
  __nv_bfloat16* out;
  uint32_t* heavy;                // heavy-row queue (Q_* words above)
  const uint32_t* light_rows;     // rows for the light kernel (null: all rows)
  const uint32_t* n_light;        // their number (device)
  __nv_bfloat16* xh;              // dense path: x of heavy rows h < dense_cap (null: path off)
  int dense_cap;                  // the dense path's row capacity (0: off)
  int M, D, H, n_tiles, T, S;
  const uint32_t* ready;          // the gate kernel's ready counters (null: the TwELL is complete)
  uint32_t ready_target;          // a row's words are final once its counter reaches this
};

struct Smem {
  alignas(128) uint8_t ring[WARPS][K][STAGE];
  union {
    uint32_t list[WARPS][2][LIST_CAP];  // light kernel: current and next row's entries
    uint32_t flat[FLAT];                // heavy kernel: the group's entries, for the whole CTA
  };
  uint64_t bar[WARPS][K];
  uint32_t group_off[33];             // heavy: entry offsets of a group's tiles, then its total
  uint32_t next_heavy;
};
constexpr int SMEM_BYTES = sizeof(Smem) + 128;

// Per-warp pipeline state: a monotonic count of issued and consumed stages.
struct Ring {
  uint8_t* buf;
  uint64_t* bar;
  uint32_t issued, consumed;
};

__device__ __forceinline__ void ring_issue(Ring& r, const Params& p, uint32_t entry, bool gated) {
  const int s = r.issued % K;
  const uint32_t bytes = uint32_t(p.D) * 2;
  const uint32_t n = entry & 0xFFFFu;
  fence_async_smem();  // earlier generic reads of this stage
  mbar_expect_tx(&r.bar[s], gated ? 2 * bytes : bytes);
  if (gated) bulk_copy(r.buf + s * STAGE, p.w_up + size_t(n) * p.D, bytes, &r.bar[s]);
  bulk_copy(r.buf + s * STAGE + (gated ? bytes : 0), p.w_down_t + size_t(n) * p.D, bytes, &r.bar[s]);
  ++r.issued;
}

// Shared-memory address of the next stage once its copies have landed.
__device__ __forceinline__ uint32_t ring_wait(Ring& r) {
  const int s = r.consumed % K;
  mbar_wait(&r.bar[s], (r.consumed / K) & 1);
  ++r.consumed;
  return smem_u32(r.buf) + s * STAGE;
}

// Lane's share of a weight row read from global memory (recompute path): CH chunks of 8 bf16;
// chunk c covers columns 8*(32*c + lane) + [0, 8), zero past D.
template <int CH>
struct Row {
  uint4 v[CH];
};

template <int CH>
__device__ __forceinline__ void load_row_global(Row<CH>& r, const __nv_bfloat16* row, int lane, int D) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int col = 8 * (32 * c + lane);
    r.v[c] = col < D ? ldg_nc(row + col) : make_uint4(0, 0, 0, 0);
  }
}

// The row's x in fp32 registers, converted once per row rather than once per active neuron.
// Lane's share: CH chunks of 8 values; chunk c covers columns 8*(32*c + lane) + [0, 8); zero past D.
template <int CH>
struct RowF {
  float v[CH * 8];
};

template <int CH>
__device__ __forceinline__ void to_f32(RowF<CH>& x, const Row<CH>& r, int lane) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const uint32_t u[4] = {r.v[c].x, r.v[c].y, r.v[c].z, r.v[c].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // Identity shuffles: the compiler would otherwise keep x packed and redo the two-instruction
      // conversion for every active neuron (measured in SASS: 64 extra integer ops per neuron).
      x.v[8 * c + 2 * j] = __shfl_sync(0xffffffffu, bf16lo(u[j]), lane);
      x.v[8 * c + 2 * j + 1] = __shfl_sync(0xffffffffu, bf16hi(u[j]), lane);
    }
  }
}

template <int CH>
__device__ __forceinline__ void load_x(RowF<CH>& x, const __nv_bfloat16* row, int lane, int D) {
  Row<CH> r;
  load_row_global(r, row, lane, D);
  to_f32(x, r, lane);
}

// x . w for a weight row in shared memory at `w`. All CH loads are issued before any math and the
// CH partial sums are independent chains: no branch per chunk, so nothing serialises the loads.
// Chunks past D read stage bytes that belong to no row (always inside the 8 KB stage since
// D <= 2048); they are zeroed, and x is zero there too.
template <int CH, bool FULL>
__device__ __forceinline__ float dot_smem(const RowF<CH>& x, uint32_t w, int lane, int D) {
  uint4 v[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int col = 8 * (32 * c + lane);
    v[c] = lds128(w + 2 * col);
    if (!FULL && col >= D) v[c] = make_uint4(0, 0, 0, 0);
  }
  float part[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) part[c] = dot8(x.v + 8 * c, v[c]);
#pragma unroll
  for (int step = 1; step < CH; step *= 2)
#pragma unroll
    for (int c = 0; c + step < CH; c += 2 * step) part[c] += part[c + step];
  return warp_sum(part[0]);
}

// acc += s * w for a weight row in shared memory. Columns past D accumulate bytes of no row; they
// are never stored.
template <int CH>
__device__ __forceinline__ void axpy_smem(float (&acc)[CH * 8], float s, uint32_t w, int lane) {
  uint4 v[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) v[c] = lds128(w + 2 * 8 * (32 * c + lane));
#pragma unroll
  for (int c = 0; c < CH; ++c) axpy8(acc + 8 * c, s, v[c]);
}

// acc += the contribution of TwELL entry `entry`, whose weight rows are the ring's next stage.
template <int CH, bool GATED, bool FULL>
__device__ __forceinline__ void consume_pair(float (&acc)[CH * 8], const RowF<CH>& x, uint32_t entry, Ring& r,
                                             const Params& p, int lane) {
  const uint32_t stage = ring_wait(r);
  float s = entry_value(entry);
  if (GATED) s *= dot_smem<CH, FULL>(x, stage, lane, p.D);
  axpy_smem<CH>(acc, s, stage + (GATED ? 2 * p.D : 0), lane);
  __syncwarp();  // every lane is done with the stage before lane 0 refills it
}

// out += contributions of list[0..n) (TwELL entries) through the warp's ring.
// FULL: D == 256 * CH, so no chunk reaches past D (the D = 2048 of every paper scale).
template <int CH, bool GATED, bool FULL>
__device__ void run_list(float (&acc)[CH * 8], const RowF<CH>& x, const uint32_t* list, int n, Ring& r,
                         const Params& p, int lane) {
  if (lane == 0)
    for (int e = 0; e < n && e < K; ++e) ring_issue(r, p, list[e], GATED);
  for (int e = 0; e < n; ++e) {
    consume_pair<CH, GATED, FULL>(acc, x, list[e], r, p, lane);
    if (lane == 0 && e + K < n) ring_issue(r, p, list[e + K], GATED);
  }
}

// Exact recompute of one overflowing tile without a spill copy: every neuron of the tile.
template <int CH, bool GATED>
__device__ void recompute_tile(float (&acc)[CH * 8], const RowF<CH>& x, int t, const Params& p, int lane) {
  const int n_end = min(p.H, (t + 1) * p.T);
  for (int n = t * p.T; n < n_end; ++n) {
    Row<CH> wa;
    load_row_global(wa, p.w_act + size_t(n) * p.D, lane, p.D);
    float g = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) g += dot8(x.v + 8 * c, wa.v[c]);
    const __nv_bfloat16 hb = relu_bf16(warp_sum(g));
    if (__bfloat16_as_ushort(hb) == 0) continue;
    float s = __bfloat162float(hb);
    Row<CH> w;
    if (GATED) {
      load_row_global(w, p.w_up + size_t(n) * p.D, lane, p.D);
      float u = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c) u += dot8(x.v + 8 * c, w.v[c]);
      s *= warp_sum(u);
    }
    load_row_global(w, p.w_down_t + size_t(n) * p.D, lane, p.D);
#pragma unroll
    for (int c = 0; c < CH; ++c) axpy8(acc + 8 * c, s, w.v[c]);
  }
}

__device__ __forceinline__ TileEntries tile_info(const Params& p, int row, int t) {
  const uint32_t* seg = p.tw + (size_t(row) * p.n_tiles + t) * p.S;
  return resolve_tile(ld_cg(seg), seg, p.spill, p.S);
}

template <int CH>
__device__ __forceinline__ void store_row(const float (&acc)[CH * 8], __nv_bfloat16* o, int lane, int D) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int col = 8 * (32 * c + lane);
    if (col < D) {
      uint4 v;
      uint32_t* u = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        __nv_bfloat162 b = __floats2bfloat162_rn(acc[8 * c + 2 * j], acc[8 * c + 2 * j + 1]);
        u[j] = *reinterpret_cast<uint32_t*>(&b);
      }
      *reinterpret_cast<uint4*>(o + col) = v;
    }
  }
}

__device__ __forceinline__ Smem& smem_ref() {
  return *reinterpret_cast<Smem*>(aligned_smem<128>());
}

__device__ __forceinline__ Ring init_ring(Smem& sm, int warp, int lane) {
  if (lane == 0) {
    for (int s = 0; s < K; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&sm.bar[warp][s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  return Ring{sm.ring[warp][0], sm.bar[warp], 0, 0};
}

// The warp's next light row from the device queue, its entries decoded into dst (*n of them); heavy
// rows met on the way are queued for the heavy kernel. -1 when the queue is empty.
template <int CAP = LIST_CAP>
__device__ __forceinline__ int take_light_row(uint32_t* dst, int* n, uint32_t n_rows, const Params& p, int lane) {
  for (;;) {
    uint32_t idx = lane == 0 ? atomicAdd(p.heavy + Q_NEXT_LIGHT, 1u) : 0u;
    idx = __shfl_sync(0xffffffffu, idx, 0);
    if (idx >= n_rows) return -1;
    const int row = int(p.light_rows ? p.light_rows[idx] : idx);
    if (p.ready != nullptr) {  // the one op: the gate kernel may still be writing this row
      if (lane == 0)
        while (ld_acquire(p.ready + row / 32) < p.ready_target) __nanosleep(128);
      __syncwarp();  // orders the other lanes' reads of the row after lane 0's acquire
    }
    *n = row_entries<CAP>(dst, p.tw + size_t(row) * p.n_tiles * p.S, p.spill, p.n_tiles, p.S, lane);
    if (*n >= 0) return row;
    uint32_t h = lane == 0 ? atomicAdd(p.heavy + Q_HEAVY_COUNT, 1u) : 0u;
    h = __shfl_sync(0xffffffffu, h, 0);
    if (lane == 0) p.heavy[Q_ROWS + h] = uint32_t(row);
    if (h < uint32_t(p.dense_cap)) {  // the dense path's copy of x (twell_dense.cu)
      const uint4* src = reinterpret_cast<const uint4*>(p.x + size_t(row) * p.D);
      uint4* dst = reinterpret_cast<uint4*>(p.xh + size_t(h) * p.D);
      for (int c = lane; c < p.D / 8; c += 32) dst[c] = src[c];
    }
  }
}

// Light kernel: one warp per row, rows taken from a device counter (uneven row lengths do not leave
// a few warps finishing long after the others). The ring is not drained at row boundaries: each
// warp decodes its next row (from global memory) while the current row's weight copies are in
// flight, and issues the next row's first pairs as the current row's last ones are consumed.
template <int CH, bool GATED, bool FULL>
__global__ void __launch_bounds__(WARPS * 32, 1) light_kernel(const Params p) {
  Smem& sm = smem_ref();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  Ring ring = init_ring(sm, warp, lane);
  const uint32_t n_rows = p.light_rows ? *reinterpret_cast<const volatile uint32_t*>(p.n_light) : uint32_t(p.M);
  int cur = 0, n_cur = 0;
  int row = take_light_row(sm.list[warp][0], &n_cur, n_rows, p, lane);
  int issued_cur = 0;  // entries of the current row already in the ring (lane 0's count)
  while (row >= 0) {
    const uint32_t* list = sm.list[warp][cur];
    uint32_t* next_list = sm.list[warp][cur ^ 1];
    if (lane == 0)
      while (issued_cur < n_cur && ring.issued - ring.consumed < uint32_t(K)) ring_issue(ring, p, list[issued_cur++], GATED);
    // x in flight while the next row is decoded (raw loads first, converted after).
    Row<CH> xr{};
    if (GATED && n_cur > 0) load_row_global(xr, p.x + size_t(row) * p.D, lane, p.D);
    int n_next = 0;
    const int row_next = take_light_row(next_list, &n_next, n_rows, p, lane);
    int issued_next = 0;
    if (lane == 0)
      while (issued_cur == n_cur && issued_next < n_next && ring.issued - ring.consumed < uint32_t(K))
        ring_issue(ring, p, next_list[issued_next++], GATED);
    RowF<CH> x;
    to_f32(x, xr, lane);
    float acc[CH * 8];
#pragma unroll
    for (int i = 0; i < CH * 8; ++i) acc[i] = 0.f;
    for (int e = 0; e < n_cur; ++e) {
      consume_pair<CH, GATED, FULL>(acc, x, list[e], ring, p, lane);
      if (lane == 0) {
        if (issued_cur < n_cur) ring_issue(ring, p, list[issued_cur++], GATED);
        else if (issued_next < n_next) ring_issue(ring, p, next_list[issued_next++], GATED);
      }
    }
    store_row<CH>(acc, p.out + size_t(row) * p.D, lane, p.D);
    row = row_next;
    n_cur = n_next;
    issued_cur = issued_next;
    cur ^= 1;
  }
}

// Heavy kernel: one CTA per heavy row, rows taken from a device counter (a static share let a CTA
// that drew several long rows finish last). The row's tiles go in groups of G (at most
// FLAT entries, as a tile holds at most T): the group's entries are copied in tile
// order into one CTA-wide list and split evenly over the warps, so no warp waits on the one that
// drew the fullest tiles. Deterministic: the split depends on the counts only.
template <int CH, bool GATED, bool FULL>
__global__ void __launch_bounds__(WARPS * 32, 1) heavy_kernel(const Params p) {
  Smem& sm = smem_ref();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  Ring ring = init_ring(sm, warp, lane);
  uint32_t* flat = sm.flat;
  const int G = min(32, FLAT / p.T);
  const uint32_t n_heavy = *reinterpret_cast<volatile uint32_t*>(p.heavy + Q_HEAVY_COUNT);
  // The dense path (twell_dense.cu) takes the whole queue or none of it.
  const uint32_t first = dense_takes_queue(n_heavy, p.dense_cap) ? n_heavy : 0u;
  for (;;) {
    if (threadIdx.x == 0) sm.next_heavy = atomicAdd(p.heavy + Q_NEXT_HEAVY, 1u);
    __syncthreads();
    const uint32_t h = sm.next_heavy + first;
    if (h >= n_heavy) break;
    const int row = int(p.heavy[Q_ROWS + h]);
    RowF<CH> x;
    load_x(x, p.x + size_t(row) * p.D, lane, p.D);
    float acc[CH * 8];
#pragma unroll
    for (int i = 0; i < CH * 8; ++i) acc[i] = 0.f;
    bool complete = true;
    for (int g0 = 0; g0 < p.n_tiles; g0 += G) {
      const int gn = min(G, p.n_tiles - g0);
      if (warp == 0) {  // entry offsets of the group's tiles (tiles without entries count 0)
        uint32_t c = 0;
        if (lane < gn) {
          const TileEntries ti = tile_info(p, row, g0 + lane);
          c = ti.stored ? min(ti.count, uint32_t(p.T)) : 0u;  // a valid tile holds at most T: the list never overflows
        }
        const uint32_t incl = warp_incl_scan(c, lane);
        sm.group_off[lane] = incl - c;
        if (lane == 31) sm.group_off[32] = incl;
      }
      __syncthreads();
      for (int i = warp; i < gn; i += WARPS) {
        const TileEntries ti = tile_info(p, row, g0 + i);
        if (!ti.stored) {
          if (p.w_act != nullptr) recompute_tile<CH, GATED>(acc, x, g0 + i, p, lane);
          else complete = false;
          continue;
        }
        uint32_t* dst = flat + sm.group_off[i];
        const uint32_t cnt = sm.group_off[i + 1] - sm.group_off[i];
        for (uint32_t j = lane; j < cnt; j += 32) dst[j] = ld_cg(ti.entries + j);
      }
      __syncthreads();
      const int n = int(sm.group_off[32]);
      const int lo = n * warp / WARPS, hi = n * (warp + 1) / WARPS;
      run_list<CH, GATED, FULL>(acc, x, flat + lo, hi - lo, ring, p, lane);
      __syncthreads();  // the next group rewrites the list
    }
    // Reduce the warps' partial rows through the (now idle) rings: warp w writes its fp32 slice.
    __syncthreads();
    float* red = reinterpret_cast<float*>(&sm.ring[0][0][0]);  // WARPS * D floats <= 64 KB
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int col = 8 * (32 * c + lane);
      if (col < p.D)
#pragma unroll
        for (int j = 0; j < 8; ++j) red[warp * p.D + col + j] = acc[8 * c + j];
    }
    const int any_incomplete = __syncthreads_or(!complete);
    for (int col = threadIdx.x; col < p.D && !any_incomplete; col += blockDim.x) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w * p.D + col];
      p.out[size_t(row) * p.D + col] = __float2bfloat16_rn(s);
    }
    __syncthreads();
  }
}

// ---- Wide rows: D > 2048 (up to 8192) ----------------------------------------------------------
//
// A row of x and of its output no longer fit a warp's registers, so D goes in panels of PW columns.
// Light row (one warp): first every entry's up dot product, panel by panel (x's panel in registers,
// one copy per entry and panel, the partial sums kept per entry in shared memory), then the output,
// panel by panel (the panel's fp32 accumulator in registers, one down-row copy per entry and panel).
// The weight bytes moved are the same as at D <= 2048; the ring holds KW panel copies of 4 KB.
// Heavy row (one CTA): the warps split the group's entries for the up dots, then each warp owns
// D / WARPS output columns (at most 1024: D <= 8192) and streams that slice of every entry's down
// row, so no cross-warp reduction of outputs is needed.
namespace wide {
constexpr int PW = 2048;      // panel columns
constexpr int PSTAGE = 4096;  // bytes of one ring stage: a panel of one weight row
constexpr int KW = 6;         // stages per warp (the same 24 KB ring as the narrow kernels)
constexpr int SCH = 4;        // heavy kernel: a warp's output slice, in chunks of 256 columns
// Entries per light row. Twice the narrow kernels' 128: the wide shapes have more hidden units (11008 to
// 32768), so a row computed densely costs more and per-row gathers stay cheaper to more entries (at 0.5%
// active, a 70B layer's rows hold 143).
constexpr int WCAP = 256;

struct Smem {
  alignas(128) uint8_t ring[WARPS][KW][PSTAGE];
  union {
    struct {
      uint32_t list[WARPS][2][WCAP];  // current and next row's entries
      float u[WARPS][WCAP];           // their up dot products
    } light;
    struct {
      uint32_t flat[FLAT];  // the group's entries
      float u[FLAT];        // their up dot products
    } heavy;
  };
  uint64_t bar[WARPS][KW];
  uint32_t group_off[33];
  uint32_t unstored;  // heavy: bit i set when the group's tile i overflowed without a spill copy
  uint32_t next_heavy;
  float red[WARPS][2];
};
constexpr int SMEM_BYTES = sizeof(Smem) + 128;
static_assert(SMEM_BYTES <= 227 * 1024, "wide FFN shared memory");

__host__ __device__ inline int panels(int D) { return (D + PW - 1) / PW; }
__device__ __forceinline__ int panel_cols(int panel, int D) { return min(PW, D - panel * PW); }

struct WRing {
  uint8_t* buf;
  uint64_t* bar;
  uint32_t issued, consumed;
};

__device__ __forceinline__ void issue(WRing& r, const __nv_bfloat16* src, uint32_t bytes) {
  const int s = r.issued % KW;
  fence_async_smem();  // earlier generic reads of this stage
  mbar_expect_tx(&r.bar[s], bytes);
  bulk_copy(r.buf + s * PSTAGE, src, bytes, &r.bar[s]);
  ++r.issued;
}

__device__ __forceinline__ uint32_t wait(WRing& r) {
  const int s = r.consumed % KW;
  mbar_wait(&r.bar[s], (r.consumed / KW) & 1);
  ++r.consumed;
  return smem_u32(r.buf) + s * PSTAGE;
}

__device__ __forceinline__ Smem& smem_ref() { return *reinterpret_cast<Smem*>(aligned_smem<128>()); }

__device__ __forceinline__ WRing init_ring(Smem& sm, int warp, int lane) {
  if (lane == 0)
    for (int s = 0; s < KW; ++s) mbar_init(&sm.bar[warp][s], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  return WRing{sm.ring[warp][0], sm.bar[warp], 0, 0};
}

// Copy j of a light row with n entries: first P * n up panels (gated), then P * n down panels, each
// phase panel-major (the entries of panel 0, then of panel 1, ...).
__device__ __forceinline__ void issue_light(WRing& r, const Params& p, const uint32_t* list, int n, int j,
                                            bool gated) {
  const int half = gated ? panels(p.D) * n : 0;
  const bool up = j < half;
  const int k = up ? j : j - half;
  const int panel = k / n, e = k % n;
  const __nv_bfloat16* w = up ? p.w_up : p.w_down_t;
  issue(r, w + size_t(entry_col(list[e])) * p.D + panel * PW, uint32_t(panel_cols(panel, p.D)) * 2);
}

// Up dot products of list[0..n) for one row (x_row), through the ring: u[e] = x . w_up[entry e].
// The ring is empty after; before, it is empty or holds the first copies (prefill_up).
__device__ __forceinline__ void prefill_up(WRing& r, const Params& p, const uint32_t* list, int n, int lane) {
  if (lane == 0)
    for (int j = 0; j < panels(p.D) * n && j < KW; ++j) issue_light(r, p, list, n, j, true);
}

__device__ void up_dots(float* u, const __nv_bfloat16* x_row, const uint32_t* list, int n, WRing& r,
                        const Params& p, int lane, bool prefilled) {
  const int P = panels(p.D), J = P * n;
  if (!prefilled) prefill_up(r, p, list, n, lane);
  int j = 0;
  for (int panel = 0; panel < P; ++panel) {
    const int cols = panel_cols(panel, p.D);
    RowF<8> x;
    load_x<8>(x, x_row + panel * PW, lane, cols);
    for (int e = 0; e < n; ++e, ++j) {
      const float part = dot_smem<8, false>(x, wait(r), lane, cols);
      __syncwarp();  // every lane is done with the stage before lane 0 refills it
      if (lane == 0) {
        u[e] = panel == 0 ? part : u[e] + part;
        if (j + KW < J) issue_light(r, p, list, n, j + KW, true);
      }
    }
  }
  __syncwarp();  // lane 0's sums are visible to the warp
}

template <bool GATED>
__global__ void __launch_bounds__(WARPS * 32, 1) light_kernel(const Params p) {
  Smem& sm = smem_ref();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WRing ring = init_ring(sm, warp, lane);
  const uint32_t n_rows = p.light_rows ? *reinterpret_cast<const volatile uint32_t*>(p.n_light) : uint32_t(p.M);
  const int P = panels(p.D);
  float* u = sm.light.u[warp];
  int cur = 0, n_cur = 0;
  int row = take_light_row<WCAP>(sm.light.list[warp][0], &n_cur, n_rows, p, lane);
  while (row >= 0) {
    const uint32_t* list = sm.light.list[warp][cur];
    // The next row is decoded while the current row's first copies are in flight.
    const int J_down = P * n_cur;
    if (GATED) prefill_up(ring, p, list, n_cur, lane);
    else if (lane == 0)
      for (int j = 0; j < J_down && j < KW; ++j) issue_light(ring, p, list, n_cur, j, false);
    int n_next = 0;
    const int row_next = take_light_row<WCAP>(sm.light.list[warp][cur ^ 1], &n_next, n_rows, p, lane);
    if (GATED && n_cur > 0) {
      up_dots(u, p.x + size_t(row) * p.D, list, n_cur, ring, p, lane, true);
      if (lane == 0)
        for (int j = 0; j < J_down && j < KW; ++j) issue_light(ring, p, list, n_cur, j, false);
    }
    int j = 0;
    for (int panel = 0; panel < P; ++panel) {
      float acc[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      for (int e = 0; e < n_cur; ++e, ++j) {
        float s = entry_value(list[e]);
        if (GATED) s *= u[e];
        axpy_smem<8>(acc, s, wait(ring), lane);
        __syncwarp();
        if (lane == 0 && j + KW < J_down) issue_light(ring, p, list, n_cur, j + KW, false);
      }
      store_row<8>(acc, p.out + size_t(row) * p.D + panel * PW, lane, panel_cols(panel, p.D));
    }
    __syncwarp();  // the list and sums are rewritten by the row after next
    row = row_next;
    n_cur = n_next;
    cur ^= 1;
  }
}

// Exact recompute of one overflowing tile without a spill copy, by the whole CTA: each warp sums
// its column slice of the gate and up dot products, the slices are added in warp order.
template <bool GATED>
__device__ void recompute_tile_cta(float (&acc)[SCH * 8], const RowF<SCH>& xs, int t, int c0, int sw, Smem& sm,
                                   const Params& p, int warp, int lane) {
  const int n_end = min(p.H, (t + 1) * p.T);
  for (int n = t * p.T; n < n_end; ++n) {
    Row<SCH> w;
    load_row_global<SCH>(w, p.w_act + size_t(n) * p.D + c0, lane, sw);
    float g = 0.f, up = 0.f;
#pragma unroll
    for (int c = 0; c < SCH; ++c) g += dot8(xs.v + 8 * c, w.v[c]);
    if (GATED) {
      load_row_global<SCH>(w, p.w_up + size_t(n) * p.D + c0, lane, sw);
#pragma unroll
      for (int c = 0; c < SCH; ++c) up += dot8(xs.v + 8 * c, w.v[c]);
    }
    g = warp_sum(g);
    up = warp_sum(up);
    if (lane == 0) {
      sm.red[warp][0] = g;
      sm.red[warp][1] = up;
    }
    __syncthreads();
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int k = 0; k < WARPS; ++k) {
      gs += sm.red[k][0];
      us += sm.red[k][1];
    }
    __syncthreads();  // red is rewritten by the next neuron
    const __nv_bfloat16 hb = relu_bf16(gs);
    if (__bfloat16_as_ushort(hb) == 0) continue;
    const float s = GATED ? __bfloat162float(hb) * us : __bfloat162float(hb);
    load_row_global<SCH>(w, p.w_down_t + size_t(n) * p.D + c0, lane, sw);
#pragma unroll
    for (int c = 0; c < SCH; ++c) axpy8(acc + 8 * c, s, w.v[c]);
  }
}

template <bool GATED>
__global__ void __launch_bounds__(WARPS * 32, 1) heavy_kernel(const Params p) {
  Smem& sm = smem_ref();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WRing ring = init_ring(sm, warp, lane);
  uint32_t* flat = sm.heavy.flat;
  float* u = sm.heavy.u;
  const int G = min(32, FLAT / p.T);
  const int sw = p.D / WARPS, c0 = warp * sw;  // this warp's output columns
  const uint32_t n_heavy = *reinterpret_cast<volatile uint32_t*>(p.heavy + Q_HEAVY_COUNT);
  const uint32_t first = dense_takes_queue(n_heavy, p.dense_cap) ? n_heavy : 0u;
  for (;;) {
    if (threadIdx.x == 0) sm.next_heavy = atomicAdd(p.heavy + Q_NEXT_HEAVY, 1u);
    __syncthreads();
    const uint32_t h = sm.next_heavy + first;
    if (h >= n_heavy) break;
    const int row = int(p.heavy[Q_ROWS + h]);
    const __nv_bfloat16* x_row = p.x + size_t(row) * p.D;
    float acc[SCH * 8];
#pragma unroll
    for (int i = 0; i < SCH * 8; ++i) acc[i] = 0.f;
    bool complete = true;
    for (int g0 = 0; g0 < p.n_tiles; g0 += G) {
      const int gn = min(G, p.n_tiles - g0);
      if (warp == 0) {
        uint32_t c = 0;
        bool stored = true;
        if (lane < gn) {
          const TileEntries ti = tile_info(p, row, g0 + lane);
          stored = ti.stored;
          c = ti.stored ? min(ti.count, uint32_t(p.T)) : 0u;
        }
        const uint32_t incl = warp_incl_scan(c, lane);
        sm.group_off[lane] = incl - c;
        if (lane == 31) sm.group_off[32] = incl;
        const uint32_t bad = __ballot_sync(0xffffffffu, !stored);
        if (lane == 0) sm.unstored = bad;
      }
      __syncthreads();
      for (int i = warp; i < gn; i += WARPS) {
        const TileEntries ti = tile_info(p, row, g0 + i);
        if (!ti.stored) continue;
        uint32_t* dst = flat + sm.group_off[i];
        const uint32_t cnt = sm.group_off[i + 1] - sm.group_off[i];
        for (uint32_t j = lane; j < cnt; j += 32) dst[j] = ld_cg(ti.entries + j);
      }
      __syncthreads();
      const int n = int(sm.group_off[32]);
      if (GATED) {
        const int lo = n * warp / WARPS, hi = n * (warp + 1) / WARPS;
        if (hi > lo) up_dots(u + lo, x_row, flat + lo, hi - lo, ring, p, lane, false);
        __syncthreads();
      }
      // The warp's slice of every entry's down row.
      if (lane == 0)
        for (int j = 0; j < n && j < KW; ++j)
          issue(ring, p.w_down_t + size_t(entry_col(flat[j])) * p.D + c0, uint32_t(sw) * 2);
      for (int e = 0; e < n; ++e) {
        float s = entry_value(flat[e]);
        if (GATED) s *= u[e];
        axpy_smem<SCH>(acc, s, wait(ring), lane);
        __syncwarp();
        if (lane == 0 && e + KW < n)
          issue(ring, p.w_down_t + size_t(entry_col(flat[e + KW])) * p.D + c0, uint32_t(sw) * 2);
      }
      const uint32_t bad = sm.unstored;
      if (bad != 0) {
        if (p.w_act == nullptr) {
          complete = false;
        } else {
          RowF<SCH> xs;
          load_x<SCH>(xs, x_row + c0, lane, sw);
          for (int i = 0; i < gn; ++i)
            if (bad >> i & 1u) recompute_tile_cta<GATED>(acc, xs, g0 + i, c0, sw, sm, p, warp, lane);
        }
      }
      __syncthreads();  // the next group rewrites the list and the sums
    }
    if (complete) store_row<SCH>(acc, p.out + size_t(row) * p.D + c0, lane, sw);
  }
}
}  // namespace wide

// The one optional path a call may take: the block-union one.
enum class Optional { none, block_union };
inline Optional optional_path(int D, int H, bool gated, const FfnPaths& paths) {
  if (paths.union_ratio > 0.f && union_supported(D, H, gated)) return Optional::block_union;
  return Optional::none;
}

// Words before the dense path's buffers: the heavy queue and the optional path's scratch, rounded
// up to 128 bytes (TMA wants 16-byte aligned rows; the workspace itself is 256-byte aligned).
inline size_t dense_offset(int M, int D, int H, bool gated, const FfnPaths& paths) {
  size_t w = heavy_words(M);
  switch (optional_path(D, H, gated, paths)) {
    case Optional::block_union: w += union_workspace_words(M, H); break;
    case Optional::none: break;
  }
  return (w + 31) & ~size_t(31);
}

// The per-row kernels of one width (light, heavy, their shared memory), the optional block-union path (uw)
// and the dense path for heavy rows, in stream order.
cudaError_t launch_rows(void (*light)(Params), void (*heavy)(Params), int smem_bytes, const Params& p,
                        const Workspace* uw, const FfnPaths& paths, int device, cudaStream_t stream, int max_sms) {
  const bool after_gate = p.ready != nullptr;
  cudaError_t err = cudaFuncSetAttribute(light, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(heavy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  int sms = 0;
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (max_sms > 0) sms = std::min(sms, max_sms);
  if (err == cudaSuccess && !after_gate) err = cudaMemsetAsync(p.heavy, 0, Q_ROWS * sizeof(uint32_t), stream);
  if (err == cudaSuccess && uw != nullptr)
    err = launch_union_plan(p.x, p.tw, p.spill, p.w_up, p.w_down_t, p.out, *uw, p.M, p.D, p.H, p.n_tiles, p.S,
                            paths.union_ratio, paths.union_base, stream);
  if (err != cudaSuccess) return err;
  const int rows_per_wave = sms * WARPS;
  const int grid = p.M < rows_per_wave ? (p.M + WARPS - 1) / WARPS : sms;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = after_gate ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, light, p);
  if (err == cudaSuccess && uw != nullptr)
    err = launch_union_mma(p.x, p.tw, p.spill, p.w_up, p.w_down_t, p.out, *uw, p.M, p.D, p.H, p.n_tiles, p.S, stream);
  if (err == cudaSuccess && p.dense_cap > 0)
    err = launch_dense_rows(p.x, p.w_act, p.w_up, p.w_down_t, p.out, p.heavy + Q_HEAVY_COUNT, p.heavy + Q_ROWS, p.xh,
                            p.xh + size_t(p.dense_cap) * p.D, p.dense_cap, p.D, p.H, sms, stream);
  if (err != cudaSuccess) return err;
  heavy<<<sms, WARPS * 32, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// p.ready set (the one op, docs/kernels.md §6): the call follows the gate kernel that wrote p.tw with
// ready counters, and the caller zeroed the queue header before that kernel. The light kernel is
// then launched with programmatic stream serialization: its CTAs start as the gate kernel's CTAs
// leave (the gate's last partial wave leaves most SMs idle for a tile's time), and each warp waits
// for its row's counter.
template <int CH, bool FULL>
cudaError_t launch_ch(const Params& p, const Workspace* uw, const FfnPaths& paths, int device, cudaStream_t stream,
                      int max_sms) {
  const bool gated = p.w_up != nullptr;
  return launch_rows(gated ? light_kernel<CH, true, FULL> : light_kernel<CH, false, FULL>,
                     gated ? heavy_kernel<CH, true, FULL> : heavy_kernel<CH, false, FULL>, SMEM_BYTES, p, uw, paths,
                     device, stream, max_sms);
}

// D > 2048: the wide kernels (no optional path: the block-union one stops at D = 2048).
template <bool GATED>
cudaError_t launch_wide(const Params& p, const FfnPaths& paths, int device, cudaStream_t stream, int max_sms) {
  return launch_rows(wide::light_kernel<GATED>, wide::heavy_kernel<GATED>, wide::SMEM_BYTES, p, nullptr, paths, device,
                     stream, max_sms);
}

// ready: null, or the gate kernel's ready counters when the call directly follows that kernel
// (see launch_ch; no optional path then: its plan kernels read the TwELL first).
cudaError_t launch(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_act, const void* w_up,
                   const void* w_down_t, void* out, uint32_t* workspace, int M, int D, int H, int tile, int S,
                   FfnPaths paths, int device, cudaStream_t stream, int max_sms, const uint32_t* ready) {
  if (M == 0) return cudaSuccess;
  if (D % 64 != 0 || D > kFfnMaxD || S < 2 || tile % S != 0 || tile > 4096) return cudaErrorInvalidValue;
  const bool gated = w_up != nullptr;
  const ffn::Optional path = ffn::optional_path(D, H, gated, paths);
  if (ready != nullptr && path != ffn::Optional::none) return cudaErrorInvalidValue;
  const bool use_union = path == ffn::Optional::block_union;
  const Workspace uw = union_workspace(workspace + ffn::heavy_words(M), M, H);
  ffn::Params p{static_cast<const __nv_bfloat16*>(x),
                tw,
                spill,
                static_cast<const __nv_bfloat16*>(w_act),
                static_cast<const __nv_bfloat16*>(w_up),
                static_cast<const __nv_bfloat16*>(w_down_t),
                static_cast<__nv_bfloat16*>(out),
                workspace,
                use_union ? uw.light_rows : nullptr,
                use_union ? uw.ctr : nullptr,
                nullptr,
                0,
                M,
                D,
                H,
                (H + tile - 1) / tile,
                tile,
                S,
                ready,
                gate_ready_target(H)};
  const Workspace* u = use_union ? &uw : nullptr;
  // The dense path's buffers (xh, then hidden) follow the optional path's scratch, 128-byte aligned.
  p.dense_cap = w_act != nullptr ? paths.dense_cap : 0;
  p.xh = p.dense_cap > 0 ? reinterpret_cast<__nv_bfloat16*>(workspace + ffn::dense_offset(M, D, H, gated, paths)) : nullptr;
  if (D > 2048) return gated ? ffn::launch_wide<true>(p, paths, device, stream, max_sms)
                             : ffn::launch_wide<false>(p, paths, device, stream, max_sms);
  const int ch = (D + 255) / 256;
  const int CH = ch <= 1 ? 1 : ch <= 2 ? 2 : ch <= 4 ? 4 : 8;
  const bool full = D == 256 * CH;
  switch (CH * (full ? -1 : 1)) {
    case 1: return ffn::launch_ch<1, false>(p, u, paths, device, stream, max_sms);
    case 2: return ffn::launch_ch<2, false>(p, u, paths, device, stream, max_sms);
    case 4: return ffn::launch_ch<4, false>(p, u, paths, device, stream, max_sms);
    case 8: return ffn::launch_ch<8, false>(p, u, paths, device, stream, max_sms);
    case -1: return ffn::launch_ch<1, true>(p, u, paths, device, stream, max_sms);
    case -2: return ffn::launch_ch<2, true>(p, u, paths, device, stream, max_sms);
    case -4: return ffn::launch_ch<4, true>(p, u, paths, device, stream, max_sms);
    default: return ffn::launch_ch<8, true>(p, u, paths, device, stream, max_sms);
  }
}
}  // namespace ffn

cudaError_t launch_twell_ffn(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_act,
                             const void* w_up, const void* w_down_t, void* out, uint32_t* workspace, int M, int D,
                             int H, int tile, int S, FfnPaths paths, int device, cudaStream_t stream,
                             int max_sms) {
  return ffn::launch(x, tw, spill, w_act, w_up, w_down_t, out, workspace, M, D, H, tile, S, paths, device, stream,
                     max_sms, nullptr);
}

cudaError_t launch_sparse_gated_ffn(const void* x, const void* w_gate, const void* w_up, const void* w_down_t,
                                    void* out, uint32_t* tw, uint32_t* spill, uint32_t* spill_used, uint32_t spill_cap,
                                    uint32_t* workspace, int M, int D, int H, int tile, int S, FfnPaths paths,
                                    int device, cudaStream_t stream, int cluster) {
  if (M == 0) return cudaSuccess;
  const bool overlap = ffn::optional_path(D, H, true, paths) == ffn::Optional::none;
  cudaError_t err = cudaSuccess;
  // The queue header is zeroed before the gate kernel, so that nothing but the light kernel follows
  // it in the stream (a memset in between would end the overlap).
  if (overlap) err = cudaMemsetAsync(workspace, 0, ffn::Q_ROWS * sizeof(uint32_t), stream);
  if (err == cudaSuccess)
    err = launch_gate_twell(x, w_gate, tw, spill, spill_used, spill_cap, M, D, H, tile, S, device, stream, cluster, 0,
                            overlap);
  if (err != cudaSuccess) return err;
  return ffn::launch(x, tw, spill, w_gate, w_up, w_down_t, out, workspace, M, D, H, tile, S, paths, device, stream, 0,
                     overlap ? spill_used + 1 : nullptr);
}

size_t ffn_workspace_words(int M, int D, int H, bool gated, bool has_act, FfnPaths paths) {
  const size_t dense = has_act && paths.dense_cap > 0 ? dense_workspace_words(paths.dense_cap, D, H) : 0;
  return ffn::dense_offset(M, D, H, gated, paths) + dense;
}

}  // namespace twell
