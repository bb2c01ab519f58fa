// Host entry points of the TwELL CUDA kernels. Pure CUDA (no torch headers) so that every .cu
// compiles with nvcc alone; the torch glue (checks, allocation, current stream) is bindings.cpp.
// Each launcher returns cudaSuccess or the error of its launch; messages via twell_last_error().
// max_sms > 0 (gate and fused launchers) caps the SMs the persistent kernels occupy, leaving the rest
// to a kernel on another stream (scripts/probes/overlap.py); 0 uses every SM.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <string>

namespace twell {

// TwELL(relu(x @ w^T)): x bf16 [M, D], w bf16 [H, D] (row-major, contiguous, D % 64 == 0),
// out uint32 [M, ceil(H/tile) * S], S = tile / compression, tile in {64, 128, 256}.
// Overflowing tile rows go to spill[0 .. spill_cap) (count word = 0x80000000 | offset); *spill_used
// (zeroed here) ends as the words claimed. spill may be null (then counts keep the true count).
// ready: the gate_ready_words(M) words after *spill_used are counters (zeroed here with it) that
// release rows to a fused kernel launched right after (launch_sparse_gated_ffn): counter r / 32
// reaches gate_ready_target(H) once row r's words are stored.
// cluster: CTAs per cluster, 2 (the two share each W_gate tile by TMA multicast) or 1 (the single-CTA
// variant, kept for comparison; docs/kernels.md §3); anything else is cudaErrorInvalidValue.
cudaError_t launch_gate_twell(const void* x, const void* w, uint32_t* out, uint32_t* spill, uint32_t* spill_used,
                              uint32_t spill_cap, int M, int D, int H, int tile, int S, int device,
                              cudaStream_t stream, int cluster, int max_sms = 0, bool ready = false);
int gate_ready_words(int M);
uint32_t gate_ready_target(int H);

// out bf16 [M, D] from TwELL words tw [M, ceil(H/tile) * S] (+ spill area, may be null).
// gated: w_up != nullptr. w_act (optional): the weight whose ReLU made the TwELL; enables the exact
// in-kernel recompute of overflowing tiles without a spill copy (when null, such rows are left
// unwritten for the caller). workspace: ffn_workspace_words(...) uint32 words. 64 <= D <= kFfnMaxD; rows
// wider than 2048 take the wide kernels, in panels of 2048 columns (no block-union path there).
// Optional paths for the rows that allow them (the per-row kernels take the rest):
//   union_ratio > 0: the block-union tensor-core path (twell_union.cu): a block of 64 rows takes it
//   when its union U of active neurons satisfies |U| <= union_ratio x (entries - union_base).
//   dense_cap > 0: when w_act is given and at least kDenseMinRows rows are heavy, all of them go
//   through the dense tensor-core path (twell_dense.cu) instead of the per-row heavy kernel, in
//   rounds of dense_cap rows (a multiple of 128).
constexpr int kFfnMaxD = 8192;  // the wide heavy kernel gives each of 8 warps D / 8 <= 1024 output columns
struct FfnPaths {
  float union_ratio;  // 0 off
  float union_base;   // entries the union path's fixed cost per block is worth (0: the plain ratio rule)
  int dense_cap;      // 0 off
};
cudaError_t launch_twell_ffn(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_act,
                             const void* w_up, const void* w_down_t, void* out, uint32_t* workspace, int M, int D,
                             int H, int tile, int S, FfnPaths paths, int device, cudaStream_t stream,
                             int max_sms = 0);
size_t ffn_workspace_words(int M, int D, int H, bool gated, bool has_act, FfnPaths paths);
// The whole gated FFN: gate kernel (TwELL into tw, spill area as in launch_gate_twell, plus
// gate_ready_words(M) ready counters after *spill_used), then the fused kernels with w_act = w_gate.
// Without an optional path the light kernel overlaps the gate kernel's last wave (ready counters,
// programmatic stream serialization; docs/kernels.md §6); workspace as for launch_twell_ffn; cluster
// as for launch_gate_twell.
cudaError_t launch_sparse_gated_ffn(const void* x, const void* w_gate, const void* w_up, const void* w_down_t,
                                    void* out, uint32_t* tw, uint32_t* spill, uint32_t* spill_used, uint32_t spill_cap,
                                    uint32_t* workspace, int M, int D, int H, int tile, int S, FfnPaths paths,
                                    int device, cudaStream_t stream, int cluster);

// Dense path for heavy rows (twell_dense.cu): when dense_takes_queue(*count, cap), for every entry h,
// out[rows[h]] = (relu(x[rows[h]] @ w_act^T) [* (x[rows[h]] @ w_up^T) if w_up]) @ w_down_t, in rounds
// of cap rows, with the round's x rows in xh [cap, D] and its hidden state in hidden
// [cap, dense_hidden_width(H)] (bf16). The light kernel copies the first round's x rows into xh (or the
// path, with copy_first); the path copies the others. cap % 128 == 0, D % 64 == 0.
// The path runs only when at least this many rows are queued. Its two kernels take ~0.08 ms even
// for one row block (measured: the down kernel's K loop over H is the critical path), while the
// per-row heavy kernel gathers ~1.2 ns of weights per entry over the GPU: 384 rows of ~180 entries
// are ~0.08 ms (estimate from those two numbers).
constexpr int kDenseMinRows = 384;
// Whether the dense path takes the whole heavy queue (else the per-row heavy kernel takes all of it).
__host__ __device__ inline bool dense_takes_queue(uint32_t queued, int cap) {
  return cap > 0 && queued >= uint32_t(kDenseMinRows);
}
int dense_hidden_width(int H);
size_t dense_workspace_words(int cap, int D, int H);
// Column tiles of the gated hidden GEMM per row: the stride of l1_part below.
int dense_l1_tiles(int H);
// ctas: persistent CTAs per kernel (the SMs to use). min_rows: the path runs when at least this many
// rows are queued (the inference FFN: kDenseMinRows; training: 1, it has no per-row heavy kernel).
// l1_part (gated only, may be null): fp32 [queue length, dense_l1_tiles(H)], entry [q][t] = sum of
// |hidden| of queue entry q over column tile t (each summed in a fixed order). copy_first: the path
// copies the first round's x rows into xh too (a caller without a light kernel that does).
cudaError_t launch_dense_rows(const void* x, const void* w_act, const void* w_up, const void* w_down_t, void* out,
                              const uint32_t* count, const uint32_t* rows, void* xh, void* hidden, int cap, int D, int H,
                              int ctas, cudaStream_t stream, int min_rows = kDenseMinRows,
                              float* l1_part = nullptr, bool copy_first = false);

// Block-union path (twell_union.cu). Device scratch, carved from the caller's workspace.
struct Workspace {
  uint32_t* ctr;         // [0] rows queued for the per-row kernel, [1] blocks on the union path
  uint32_t* light_rows;  // [M] rows queued for the per-row kernel
  uint32_t* ublocks;     // union-path blocks, in claim order
  uint32_t* usize;       // per block: |U|
  uint32_t* rowcnt;      // per block row: entries, or 0xFFFFFFFF when another kernel computes the row
  uint16_t* ulist;       // per block: U (sorted neuron ids), H slots
  uint32_t* ent;         // per row: ROW_CAP entries (bf16 value << 16 | rank in U)
};
// Why the union path cannot serve a layer of this shape, or "" when it can.
std::string union_unsupported(int D, int H, bool gated);
bool union_supported(int D, int H, bool gated);
size_t union_workspace_words(int M, int H);
Workspace union_workspace(uint32_t* base, int M, int H);
cudaError_t launch_union_plan(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                              const void* w_down_t, void* out, const Workspace& w, int M, int D, int H, int n_tiles,
                              int S, float ratio, float base, cudaStream_t stream);
cudaError_t launch_union_mma(const void* x, const uint32_t* tw, const uint32_t* spill, const void* w_up,
                             const void* w_down_t, void* out, const Workspace& w, int M, int D, int H, int n_tiles,
                             int S, cudaStream_t stream);

// Decoding (twell_decode.cu): the gated FFN for 1 <= M <= kDecodeMaxRows rows, reading only the active
// neurons' up and down weight rows; ReLU, FATReLU (threshold > 0: active where bf16(g) > bf16(threshold)) or
// dReLU (up_relu: ReLU on the up product too; the down rows read only where both are positive). x bf16 [M, D], w_gate and w_up [H, D], w_down_t [H, D], out [M, D];
// D a positive multiple of 64; workspace: decode_workspace_bytes(M, D, H) bytes, 16-byte aligned, no
// initialisation needed. Two kernels, no host synchronisation; deterministic.
constexpr int kDecodeMaxRows = 32;
constexpr int kDecodeMaxH = 1 << 18;  // the down kernel lists a range of neuron groups in shared memory
size_t decode_workspace_bytes(int M, int D, int H);
cudaError_t launch_decode_ffn(const void* x, const void* w_gate, const void* w_up, const void* w_down_t, void* out,
                              void* workspace, int M, int D, int H, cudaStream_t stream, float threshold = 0.f,
                              bool up_relu = false);

// Detail of the last failure that is not a plain CUDA error (e.g. tensor-map encoding).
// Training kernels (csrc/twell_train.cu). Rows: forward (x, w0 = w_up, w1 = w_down_t; out, s0 = u,
// s1 = h, row_l1) or backward (x = dy, w0 = w_down_t, w1 = w_up, w2 = w_gate, u, h, l1_grad; out = dx,
// s0 = du, s1 = dg), light rows only (nnz <= slots), D a multiple of 8 and at most 2048.
struct TrainRows {
  const void* x;
  const int* idx;
  const void* val;
  const int* nnz;
  const void* u;
  const void* h;
  const void* w0;
  const void* w1;
  const void* w2;
  const float* l1_grad;  // device scalar or null (0)
  void* out;
  void* s0;
  void* s1;
  float* row_l1;
  int M, D, slots;
};
struct TrainColumns {
  const int* ent;  // column-sorted entries (row * slots + slot)
  const int *item_col, *item_lo, *item_hi, *item_part;
  int n_items;
  const int *long_col, *long_part_lo, *long_part_n;
  int n_long;
  const void *h, *du, *dg, *x, *dy;
  const void *heavy_down, *heavy_up, *heavy_gate;  // dense rows' part, bf16 [H, D], or all null
  void *d_down_t, *d_up, *d_gate;
  float* partial;
  int D, slots;
  int parts;  // slices of D, train_column_parts(M, D, forced)
};
cudaError_t launch_train_compact(const void* g, int M, int H, int slots, int* idx, void* val, int* nnz,
                                 uint8_t* neuron_active, cudaStream_t stream);
cudaError_t launch_train_rows_forward(const TrainRows& a, cudaStream_t stream);
cudaError_t launch_train_rows_backward(const TrainRows& a, cudaStream_t stream);
cudaError_t launch_train_columns(const TrainColumns& a, cudaStream_t stream);
int train_column_parts(int M, int D, int forced);
// The weight-gradient work list: entries per neuron (fill = false: counts; true: positions from
// cursor), sorted within each neuron (temp null: *temp_bytes gets the size), items and long neurons.
cudaError_t launch_train_entries(const int* idx, const int* nnz, int M, int H, int slots, int* counts, int* cursor,
                                 int* ent, bool fill, cudaStream_t stream);
cudaError_t launch_transpose_bf16(const void* src, void* dst, int R, int C, cudaStream_t stream);
// The same in row order without a sort (the default): rows in bands of train_band_rows(H, slots) rows (0:
// too little shared memory, use the sort). place = false: per-band counts into band_cnt [bands, H], then
// each band's offset within its neuron, and totals [H] (the neurons' counts); place = true (after col_ptr
// is their exclusive prefix sum): ent.
int train_band_rows(int H, int slots);
cudaError_t launch_train_bands(const int* idx, const int* nnz, int M, int H, int slots, int band, int* band_cnt,
                               const int* col_ptr, int* totals, int* ent, bool place, cudaStream_t stream);
cudaError_t launch_train_sort(void* temp, size_t* temp_bytes, const int* in, int* out, int n, int H, int slots,
                              const int* col_ptr, cudaStream_t stream);
// Heavy rows of the training forward on the dense path: row_l1[rows[q]] = sum over t of l1_part[q][t]
// for q < *count.
cudaError_t launch_train_heavy_l1(const int* count, const int* rows, const float* l1_part, int tiles, float* row_l1,
                                  int M, cudaStream_t stream);
// The heavy rows' elementwise backward (n values of g, u and ds = dy W_down, bf16): h = relu(g) * u,
// du, dg with ds + sign(h) * bf16(*l1_grad) (l1_grad null: no L1 term), rounded as PyTorch's bf16 ops.
cudaError_t launch_train_heavy_grads(const void* g, const void* u, const void* ds, const float* l1_grad, void* h,
                                     void* du, void* dg, size_t n, cudaStream_t stream);
// A gate variant's dense hidden state (n values of g and u, bf16): h = (g <= bf16(threshold) ? 0 : g) * u, with
// up_relu relu(u) for u; PyTorch's bf16 values.
cudaError_t launch_gate_product(const void* g, const void* u, void* h, size_t n, float threshold, bool up_relu,
                                cudaStream_t stream);
cudaError_t launch_train_plan(const int* col_ptr, int H, int chunk, int* sizes, const int* incl, int* item_col,
                              int* item_lo, int* item_hi, int* item_part, int* long_col, int* long_lo, int* long_n,
                              bool fill, cudaStream_t stream);

const char* last_error();
void set_error(const char* msg);

}  // namespace twell
