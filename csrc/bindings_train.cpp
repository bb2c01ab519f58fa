// Bindings of the sparse training kernels (csrc/twell_train.cu): the training FFN's forward and
// backward, and the pieces they are made of.
#include "bindings_common.h"

#include <algorithm>
#include <memory>

namespace twell::bind {
namespace {

void check_train_width(int64_t D, const char* op) {
  TORCH_CHECK(D > 0 && D % 8 == 0 && D <= 8192, op, ": D must be a multiple of 8 in [8, 8192], got ", D);
}

void check_int_matrix(const at::Tensor& t, int64_t rows, int64_t cols, const char* name, const char* op) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous() && t.numel() == rows * cols, op, ": ",
              name, " must be a contiguous int32 CUDA tensor of ", rows * cols, " elements");
}

void check_bf16_slots(const at::Tensor& t, int64_t M, int64_t slots, const char* name, const char* op) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == M * slots, op,
              ": ", name, " must be contiguous bf16 [M, slots]");
}

}  // namespace

// relu(g) of the gate GEMM's output g [M, H] compacted per row: (idx int32 [M, slots], val bf16 [M, slots],
// nnz int32 [M] true counts, neuron_active uint8 [H]).
std::vector<at::Tensor> train_compact(const at::Tensor& g, int64_t slots) {
  TORCH_CHECK(g.is_cuda() && g.scalar_type() == at::kBFloat16 && g.dim() == 2 && g.is_contiguous(),
              "twell.train_compact: g must be a contiguous bf16 CUDA matrix");
  TORCH_CHECK(slots >= 1 && slots <= 1024, "twell.train_compact: slots must be in [1, 1024], got ", slots);
  const int64_t M = g.size(0), H = g.size(1);
  TORCH_CHECK(M < (int64_t(1) << 31) / std::max<int64_t>(slots, 1) && H < (int64_t(1) << 24),
              "twell.train_compact: too many rows or columns");
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor idx = at::empty({M, slots}, g.options().dtype(at::kInt));
  at::Tensor val = at::empty({M, slots}, g.options());
  at::Tensor nnz = at::empty({M}, g.options().dtype(at::kInt));
  at::Tensor act = at::zeros({H}, g.options().dtype(at::kByte));
  check_launch(twell::launch_train_compact(g.data_ptr(), int(M), int(H), int(slots), idx.data_ptr<int>(),
                                           val.data_ptr(), nnz.data_ptr<int>(), act.data_ptr<uint8_t>(),
                                           c10::cuda::getCurrentCUDAStream()),
               "train_compact");
  return {idx, val, nnz, act};
}

// Light rows' forward: (out bf16 [M, D], heavy rows unwritten; u, h bf16 [M, slots]; row_l1 fp32 [M]).
std::vector<at::Tensor> train_rows_forward(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& val,
                                           const at::Tensor& nnz, const at::Tensor& w_up, const at::Tensor& w_down_t,
                                           int64_t slots) {
  const char* op = "twell.train_rows_forward";
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w_up, "w_up");
  check_bf16_matrix(w_down_t, "w_down_t");
  const int64_t M = x.size(0), D = x.size(1);
  check_train_width(D, op);
  TORCH_CHECK(w_up.size(1) == D && w_down_t.size(1) == D && w_up.size(0) == w_down_t.size(0), op,
              ": w_up and w_down_t must be [H, D]");
  check_int_matrix(idx, M, slots, "idx", op);
  check_int_matrix(nnz, M, 1, "nnz", op);
  check_bf16_slots(val, M, slots, "val", op);
  for (auto* t : {&idx, &val, &nnz, &w_up, &w_down_t}) check_on_device_of(x, *t, "an input", op);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, D}, x.options());  // heavy rows: the caller writes them
  at::Tensor u = at::empty({M, slots}, x.options()), h = at::empty({M, slots}, x.options());
  at::Tensor l1 = at::empty({M}, x.options().dtype(at::kFloat));
  twell::TrainRows a{x.data_ptr(), idx.data_ptr<int>(), val.data_ptr(), nnz.data_ptr<int>(), nullptr, nullptr,
                     w_up.data_ptr(), w_down_t.data_ptr(), nullptr, nullptr, out.data_ptr(), u.data_ptr(),
                     h.data_ptr(), l1.data_ptr<float>(), int(M), int(D), int(slots)};
  check_launch(twell::launch_train_rows_forward(a, c10::cuda::getCurrentCUDAStream()), "train_rows_forward");
  return {out, u, h, l1};
}

// Light rows' backward: (dx bf16 [M, D], heavy rows unwritten; du, dg bf16 [M, slots]).
std::vector<at::Tensor> train_rows_backward(const at::Tensor& dy, const at::Tensor& idx, const at::Tensor& val,
                                            const at::Tensor& u, const at::Tensor& h, const at::Tensor& nnz,
                                            const at::Tensor& w_down_t, const at::Tensor& w_up,
                                            const at::Tensor& w_gate, const c10::optional<at::Tensor>& l1_grad,
                                            int64_t slots) {
  const char* op = "twell.train_rows_backward";
  check_bf16_matrix(dy, "dy");
  for (auto* w : {&w_down_t, &w_up, &w_gate}) {
    check_bf16_matrix(*w, "a weight");
    TORCH_CHECK(w->size(1) == dy.size(1) && w->size(0) == w_up.size(0), op, ": weights must be [H, D]");
    check_on_device_of(dy, *w, "a weight", op);
  }
  const int64_t M = dy.size(0), D = dy.size(1);
  check_train_width(D, op);
  check_int_matrix(idx, M, slots, "idx", op);
  check_int_matrix(nnz, M, 1, "nnz", op);
  check_bf16_slots(val, M, slots, "val", op);
  check_bf16_slots(u, M, slots, "u", op);
  check_bf16_slots(h, M, slots, "h", op);
  const float* l1p = nullptr;
  if (l1_grad.has_value()) {
    TORCH_CHECK(l1_grad->is_cuda() && l1_grad->scalar_type() == at::kFloat && l1_grad->numel() == 1, op,
                ": l1_grad must be one fp32 CUDA value");
    check_on_device_of(dy, *l1_grad, "l1_grad", op);
    l1p = l1_grad->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dx = at::empty({M, D}, dy.options());  // heavy rows: the caller writes them
  at::Tensor du = at::empty({M, slots}, dy.options()), dg = at::empty({M, slots}, dy.options());
  twell::TrainRows a{dy.data_ptr(), idx.data_ptr<int>(), val.data_ptr(), nnz.data_ptr<int>(), u.data_ptr(),
                     h.data_ptr(), w_down_t.data_ptr(), w_up.data_ptr(), w_gate.data_ptr(), l1p, dx.data_ptr(),
                     du.data_ptr(), dg.data_ptr(), nullptr, int(M), int(D), int(slots)};
  check_launch(twell::launch_train_rows_backward(a, c10::cuda::getCurrentCUDAStream()), "train_rows_backward");
  return {dx, du, dg};
}

// Weight gradients [H, D] (d_w_down_t, d_w_up, d_w_gate) from the column-sorted entries: items are
// (neuron, entries lo..hi, partial slot or -1); long neurons sum n_part partials; heavy_*: the dense
// rows' part (all three or none).
std::vector<at::Tensor> train_columns(const at::Tensor& ent, const at::Tensor& item_col, const at::Tensor& item_lo,
                                      const at::Tensor& item_hi, const at::Tensor& item_part,
                                      const at::Tensor& long_col, const at::Tensor& long_part_lo,
                                      const at::Tensor& long_part_n, int64_t n_part, const at::Tensor& h,
                                      const at::Tensor& du, const at::Tensor& dg, const at::Tensor& x,
                                      const at::Tensor& dy, const c10::optional<at::Tensor>& heavy_down,
                                      const c10::optional<at::Tensor>& heavy_up,
                                      const c10::optional<at::Tensor>& heavy_gate, int64_t H, int64_t slots,
                                      int64_t column_parts) {
  const char* op = "twell.train_columns";
  check_bf16_matrix(x, "x");
  check_bf16_matrix(dy, "dy");
  TORCH_CHECK(x.sizes() == dy.sizes(), op, ": x and dy must have the same shape");
  const int64_t M = x.size(0), D = x.size(1), n_items = item_col.numel(), n_long = long_col.numel();
  check_train_width(D, op);
  for (auto* t : {&ent, &item_col, &item_lo, &item_hi, &item_part, &long_col, &long_part_lo, &long_part_n})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous(), op,
                ": index tensors must be contiguous int32 CUDA tensors");
  TORCH_CHECK(item_lo.numel() == n_items && item_hi.numel() == n_items && item_part.numel() == n_items &&
                  long_part_lo.numel() == n_long && long_part_n.numel() == n_long,
              op, ": item and long-neuron lists disagree in length");
  check_bf16_slots(h, M, slots, "h", op);
  check_bf16_slots(du, M, slots, "du", op);
  check_bf16_slots(dg, M, slots, "dg", op);
  const bool heavy = heavy_down.has_value();
  TORCH_CHECK(heavy == heavy_up.has_value() && heavy == heavy_gate.has_value(), op,
              ": pass all three dense parts or none");
  if (heavy)
    for (auto* t : {&*heavy_down, &*heavy_up, &*heavy_gate}) {
      check_bf16_matrix(*t, "a dense part");
      TORCH_CHECK(t->size(0) == H && t->size(1) == D, op, ": dense parts must be [H, D]");
    }
  const c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options();
  at::Tensor d_down = at::empty({H, D}, opts), d_up = at::empty({H, D}, opts), d_gate = at::empty({H, D}, opts);
  at::Tensor partial = at::empty({std::max<int64_t>(n_part, 1), 3, D}, opts.dtype(at::kFloat));
  auto ptr = [](const c10::optional<at::Tensor>& t) -> const void* { return t.has_value() ? t->data_ptr() : nullptr; };
  twell::TrainColumns a{ent.data_ptr<int>(), item_col.data_ptr<int>(), item_lo.data_ptr<int>(),
                        item_hi.data_ptr<int>(), item_part.data_ptr<int>(), int(n_items), long_col.data_ptr<int>(),
                        long_part_lo.data_ptr<int>(), long_part_n.data_ptr<int>(), int(n_long), h.data_ptr(),
                        du.data_ptr(), dg.data_ptr(), x.data_ptr(), dy.data_ptr(), ptr(heavy_down), ptr(heavy_up),
                        ptr(heavy_gate), d_down.data_ptr(), d_up.data_ptr(), d_gate.data_ptr(),
                        partial.data_ptr<float>(), int(D), int(slots),
                        twell::train_column_parts(int(M), int(D), int(column_parts))};
  check_launch(twell::launch_train_columns(a, c10::cuda::getCurrentCUDAStream()), "train_columns");
  return {d_down, d_up, d_gate};
}

// The weight-gradient kernel's work list from the compacted rows, with no host sync: ent (entries
// sorted by neuron, then row), items int32 [4, max_items] (neuron, lo, hi, partial slot or -1),
// longs int32 [3, max_long] (neuron, first partial, partials), totals int32 [3] on the device
// (items, partials, long neurons used). max_items = H + ceil(M * slots / chunk) bounds the items.
std::vector<at::Tensor> train_worklist(const at::Tensor& idx, const at::Tensor& nnz, int64_t H, int64_t slots,
                                       int64_t chunk) {
  const char* op = "twell.train_worklist";
  const int64_t M = nnz.numel();
  check_int_matrix(idx, M, slots, "idx", op);
  check_int_matrix(nnz, M, 1, "nnz", op);
  TORCH_CHECK(H >= 1 && chunk >= 1, op, ": bad H or chunk");
  const c10::cuda::CUDAGuard guard(idx.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto iopt = idx.options();
  at::Tensor col_ptr = at::zeros({H + 1}, iopt);
  const int64_t n = M * slots;
  at::Tensor ent = at::empty({std::max<int64_t>(n, 1)}, iopt);
  auto prefix = [&] {  // col_ptr[1..H] holds the counts: make it their inclusive prefix sum
    at::Tensor tail = col_ptr.narrow(0, 1, H);
    at::cumsum_out(tail, tail.clone(), 0);
  };
  // Bands where their per-band counts ([bands, H] int32) stay small: within 64 MB or a few times the
  // entries' capacity (M x slots). Very wide layers, or bands made narrow by many slots, sort instead.
  const int band = twell::train_band_rows(int(H), int(slots));
  const int64_t bands = band > 0 ? (M + band - 1) / band : 0;
  if (band > 0 && bands * H <= std::max<int64_t>(4 * n, int64_t(1) << 24)) {
    // rows in bands, each band's entries placed in row order: no sort (the default)
    at::Tensor band_cnt = at::empty({std::max<int64_t>(bands, 1), H}, iopt);
    check_launch(twell::launch_train_bands(idx.data_ptr<int>(), nnz.data_ptr<int>(), int(M), int(H), int(slots), band,
                                           band_cnt.data_ptr<int>(), nullptr, col_ptr.data_ptr<int>() + 1, nullptr,
                                           false, stream),
                 "train_worklist (band counts)");
    prefix();
    check_launch(twell::launch_train_bands(idx.data_ptr<int>(), nnz.data_ptr<int>(), int(M), int(H), int(slots), band,
                                           band_cnt.data_ptr<int>(), col_ptr.data_ptr<int>(), nullptr,
                                           ent.data_ptr<int>(), true, stream),
                 "train_worklist (band placement)");
  } else {
    // very wide layers: count, fill in any order, then sort each neuron's entries
    check_launch(twell::launch_train_entries(idx.data_ptr<int>(), nnz.data_ptr<int>(), int(M), int(H), int(slots),
                                             col_ptr.data_ptr<int>() + 1, nullptr, nullptr, false, stream),
                 "train_worklist (count)");
    prefix();
    at::Tensor cursor = col_ptr.narrow(0, 0, H).clone();
    at::Tensor raw = at::empty({std::max<int64_t>(n, 1)}, iopt);
    check_launch(twell::launch_train_entries(idx.data_ptr<int>(), nnz.data_ptr<int>(), int(M), int(H), int(slots),
                                             nullptr, cursor.data_ptr<int>(), raw.data_ptr<int>(), true, stream),
                 "train_worklist (fill)");
    size_t temp_bytes = 0;
    check_launch(twell::launch_train_sort(nullptr, &temp_bytes, raw.data_ptr<int>(), ent.data_ptr<int>(), int(n),
                                          int(H), int(slots), col_ptr.data_ptr<int>(), stream),
                 "train_worklist (sort size)");
    at::Tensor temp = at::empty({int64_t(temp_bytes) + 1}, iopt.dtype(at::kByte));
    check_launch(twell::launch_train_sort(temp.data_ptr(), &temp_bytes, raw.data_ptr<int>(), ent.data_ptr<int>(),
                                          int(n), int(H), int(slots), col_ptr.data_ptr<int>(), stream),
                 "train_worklist (sort)");
  }
  at::Tensor sizes = at::empty({3, H}, iopt);
  check_launch(twell::launch_train_plan(col_ptr.data_ptr<int>(), int(H), int(chunk), sizes.data_ptr<int>(), nullptr,
                                        nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, false, stream),
               "train_worklist (plan)");
  at::Tensor incl = at::cumsum(sizes, 1, at::kInt);
  const int64_t max_items = H + (n + chunk - 1) / chunk, max_long = std::min<int64_t>(H, (n + chunk - 1) / chunk);
  at::Tensor items = at::empty({4, max_items}, iopt), longs = at::empty({3, std::max<int64_t>(max_long, 1)}, iopt);
  int* it = items.data_ptr<int>();
  int* lg = longs.data_ptr<int>();
  const int64_t ls = longs.size(1);
  check_launch(twell::launch_train_plan(col_ptr.data_ptr<int>(), int(H), int(chunk), sizes.data_ptr<int>(),
                                        incl.data_ptr<int>(), it, it + max_items, it + 2 * max_items,
                                        it + 3 * max_items, lg, lg + ls, lg + 2 * ls, true, stream),
               "train_worklist (items)");
  return {ent, items, longs, incl.select(1, H - 1).contiguous()};
}

namespace {
void heavy_grads_into(const at::Tensor& g, const at::Tensor& u, const at::Tensor& ds,
                      const c10::optional<at::Tensor>& l1_grad, at::Tensor& h, at::Tensor& du, at::Tensor& dg) {
  const float* l1 = l1_grad.has_value() ? l1_grad->data_ptr<float>() : nullptr;
  check_launch(twell::launch_train_heavy_grads(g.data_ptr(), u.data_ptr(), ds.data_ptr(), l1, h.data_ptr(),
                                               du.data_ptr(), dg.data_ptr(), size_t(g.numel()),
                                               c10::cuda::getCurrentCUDAStream()),
               "train_backward (heavy rows' elementwise part)");
}
}  // namespace

at::Tensor transpose_bf16(const at::Tensor& w) {
  check_bf16_matrix(w, "w");
  const c10::cuda::CUDAGuard guard(w.device());
  at::Tensor t = at::empty({w.size(1), w.size(0)}, w.options());
  check_launch(twell::launch_transpose_bf16(w.data_ptr(), t.data_ptr(), int(w.size(0)), int(w.size(1)),
                                            c10::cuda::getCurrentCUDAStream()),
               "transpose");
  return t;
}

// A gate variant's dense hidden state (g, u contiguous bf16 CUDA tensors of one shape): PyTorch's
// where(g <= t, 0, g) * (relu(u) if up_relu else u), in one kernel (twell_train.cu).
at::Tensor gate_product(const at::Tensor& g, const at::Tensor& u, double threshold, bool up_relu) {
  for (const at::Tensor* t : {&g, &u})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->sizes() == g.sizes() &&
                    t->device() == g.device(),
                "twell.gate_product: g and u must be contiguous bf16 CUDA tensors of one shape and device");
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor h = at::empty_like(g);
  check_launch(twell::launch_gate_product(g.data_ptr(), u.data_ptr(), h.data_ptr(), size_t(g.numel()),
                                          float(threshold), up_relu, c10::cuda::getCurrentCUDAStream()),
               "gate_product");
  return h;
}

// The heavy rows' elementwise backward (g, u, ds bf16 of one shape, contiguous; l1_grad fp32 [1] or absent):
// (h, du, dg), the values of PyTorch's bf16 sequence relu, mul, sign * l1, add, mul, where (twell_train.cu).
std::vector<at::Tensor> train_heavy_grads(const at::Tensor& g, const at::Tensor& u, const at::Tensor& ds,
                                          const c10::optional<at::Tensor>& l1_grad) {
  for (const at::Tensor* t : {&g, &u, &ds})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->sizes() == g.sizes() &&
                    t->device() == g.device(),
                "twell.train_heavy_grads: g, u and ds must be contiguous bf16 CUDA tensors of one shape and device");
  if (l1_grad.has_value())
    TORCH_CHECK(l1_grad->is_cuda() && l1_grad->device() == g.device() && l1_grad->scalar_type() == at::kFloat &&
                    l1_grad->numel() == 1,
                "twell.train_heavy_grads: l1_grad must be a float32 CUDA tensor of one element on g's device");
  const c10::cuda::CUDAGuard guard(g.device());
  at::Tensor h = at::empty_like(g), du = at::empty_like(g), dg = at::empty_like(g);
  heavy_grads_into(g, u, ds, l1_grad, h, du, dg);
  return {h, du, dg};
}

namespace {
// Rows of one round of the training forward's dense path for heavy rows: M / 8 (the paper's dense
// backup), rounded up to 128, at most M rounded up to 128. More heavy rows take more rounds.
int64_t train_dense_cap(int64_t M) {
  auto up = [](int64_t v) { return std::max<int64_t>(128, (v + 127) / 128 * 128); };
  return std::min(up(M / 8), up(M));
}
}  // namespace

// The sparse training FFN's forward (twell.kernels.training): out, row_l1, nnz, neuron_active, then
// what the backward reads (idx, val, u, h, heavy rows int32 ascending padded with -1, the work list:
// ent, items, longs; sizes: int64 [4] on the device = heavy rows, items, partials, long neurons;
// w_down_t). With D a multiple of 64 no host sync: heavy rows take the dense tensor-core path
// (twell_dense.cu), which reads their count on the device, and sizes_host (pinned CPU int64 [4], may
// be absent) receives sizes by an asynchronous copy for the backward. Other D read the heavy-row
// count back (one sync) and run those rows through cuBLAS.
std::vector<at::Tensor> train_forward(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                                      const at::Tensor& w_down, int64_t slots, int64_t chunk,
                                      const c10::optional<at::Tensor>& sizes_host) {
  check_bf16_matrix(x, "x");
  check_bf16_matrix(w_gate, "w_gate");
  check_bf16_matrix(w_down, "w_down");
  const int64_t M = x.size(0), D = x.size(1), H = w_gate.size(0);
  TORCH_CHECK(w_down.size(0) == D && w_down.size(1) == H, "twell.train_forward: w_down must be [D, H]");
  if (sizes_host.has_value())
    TORCH_CHECK(!sizes_host->is_cuda() && sizes_host->is_pinned() && sizes_host->scalar_type() == at::kLong &&
                    sizes_host->numel() == 4 && sizes_host->is_contiguous(),
                "twell.train_forward: sizes_host must be a pinned CPU int64 tensor of 4 elements");
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor g = at::mm(x, w_gate.t());
  auto c = train_compact(g, slots);
  const at::Tensor &idx = c[0], &val = c[1], &nnz = c[2];
  const at::Tensor heavy_mask = nnz.gt(slots);
  const at::Tensor n_heavy_dev = heavy_mask.sum(at::kInt);
  auto wl = train_worklist(idx, nnz, H, slots, chunk);
  const at::Tensor heavy = at::nonzero_static(heavy_mask, M, -1).view({-1}).to(at::kInt);
  const at::Tensor sizes = at::cat({n_heavy_dev.view({1}), wl[3]}).to(at::kLong);
  if (sizes_host.has_value()) sizes_host->copy_(sizes, /*non_blocking=*/true);
  const bool dense_path = D % 64 == 0 && M > 0;
  if (dense_path) g.reset();  // the dense path recomputes its rows' gate: free [M, H] before the row kernel
  at::Tensor w_down_t = transpose_bf16(w_down);
  auto f = train_rows_forward(x, idx, val, nnz, w_up, w_down_t, slots);
  at::Tensor &out = f[0], &row_l1 = f[3];
  if (dense_path) {
    const int64_t cap = train_dense_cap(M), tiles = twell::dense_l1_tiles(int(H));
    at::Tensor xh = at::empty({cap, D}, x.options());
    at::Tensor hidden = at::empty({cap, twell::dense_hidden_width(int(H))}, x.options());
    at::Tensor part = at::empty({std::max<int64_t>(M, 1), tiles}, x.options().dtype(at::kFloat));
    int sms = 0;
    check_launch(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()), "SM count");
    const int* cnt = n_heavy_dev.data_ptr<int>();
    const int* rows = heavy.data_ptr<int>();
    check_launch(twell::launch_dense_rows(x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), w_down_t.data_ptr(),
                                          out.data_ptr(), reinterpret_cast<const uint32_t*>(cnt),
                                          reinterpret_cast<const uint32_t*>(rows), xh.data_ptr(), hidden.data_ptr(),
                                          int(cap), int(D), int(H), sms, stream, 1, part.data_ptr<float>(),
                                          /*copy_first=*/true),
                 "train_forward (heavy rows)");
    check_launch(twell::launch_train_heavy_l1(cnt, rows, part.data_ptr<float>(), int(tiles), row_l1.data_ptr<float>(),
                                              int(M), stream),
                 "train_forward (heavy rows' L1)");
  } else {
    const int64_t n_heavy = n_heavy_dev.item<int>();  // the one host sync of this path
    if (n_heavy > 0) {
      const at::Tensor rows = heavy.narrow(0, 0, n_heavy).to(at::kLong);
      const at::Tensor hh = at::relu(g.index_select(0, rows)) * at::mm(x.index_select(0, rows), w_up.t());
      out.index_copy_(0, rows, at::mm(hh, w_down.t()));
      row_l1.index_copy_(0, rows, hh.abs().sum({1}, false, at::kFloat));
    }
  }
  return {out, row_l1, nnz, c[3].to(at::kBool), idx, val, f[1], f[2], heavy, wl[0], wl[1], wl[2], sizes, w_down_t};
}

// Heavy rows per chunk of the backward's recomputed gate and up (its temporaries: g, u and ds, 3 x rows x H bf16).
constexpr int64_t kHeavyChunkRows = 2048;

// Its backward: dx, d_w_gate, d_w_up, d_w_down. The light rows' kernel needs none of sizes, so it is
// queued before the host reads them and the GPU works while the host waits. rows_done: that kernel's
// results (dx, du, dg) when the caller queued it itself before waiting for sizes (eager calls: sizes is
// the forward's asynchronous copy to pinned memory, ready at an event the caller waits for). sizes on
// the device (a compiled graph) come back by an asynchronous copy after that kernel is queued: the one
// host sync of this path, which does not leave the GPU idle.
std::vector<at::Tensor> train_backward(const at::Tensor& d_out, const c10::optional<at::Tensor>& l1_grad,
                                       const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                                       const at::Tensor& w_down, const at::Tensor& w_down_t, const at::Tensor& idx,
                                       const at::Tensor& val, const at::Tensor& u, const at::Tensor& h,
                                       const at::Tensor& nnz, const at::Tensor& heavy, const at::Tensor& ent,
                                       const at::Tensor& items, const at::Tensor& longs, const at::Tensor& sizes,
                                       int64_t slots, int64_t column_parts,
                                       const c10::optional<std::vector<at::Tensor>>& rows_done) {
  TORCH_CHECK(sizes.scalar_type() == at::kLong && sizes.numel() == 4,
              "twell.train_backward: sizes must be the forward's int64 [4]");
  TORCH_CHECK(!rows_done.has_value() || rows_done->size() == 3,
              "twell.train_backward: rows_done must be train_rows_backward's three results");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor sz_host = sizes.contiguous();
  // The event is destroyed on every path out of here (an argument check may throw in between).
  std::unique_ptr<CUevent_st, decltype(&cudaEventDestroy)> sizes_copied(nullptr, &cudaEventDestroy);
  if (sizes.is_cuda()) {
    TORCH_CHECK(sizes.device() == x.device(), "twell.train_backward: sizes must be on x's device");
    sz_host = at::empty({4}, sizes.options().device(at::kCPU).pinned_memory(true));
    sz_host.copy_(sizes, /*non_blocking=*/true);
    cudaEvent_t ev = nullptr;
    check_launch(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "train_backward (event)");
    sizes_copied.reset(ev);
    check_launch(cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream()), "train_backward (event)");
  }
  auto b = rows_done.has_value()
               ? *rows_done
               : train_rows_backward(d_out, idx, val, u, h, nnz, w_down_t, w_up, w_gate, l1_grad, slots);
  if (sizes_copied) check_launch(cudaEventSynchronize(sizes_copied.get()), "train_backward (reading sizes)");
  const int64_t* sz = sz_host.data_ptr<int64_t>();
  const int64_t n_heavy = sz[0], n_items = sz[1], n_part = sz[2], n_long = sz[3], H = w_gate.size(0);
  at::Tensor &dx = b[0];
  c10::optional<at::Tensor> pd, pu, pg;
  if (n_heavy > 0) {
    const at::Tensor rows = heavy.narrow(0, 0, n_heavy).to(at::kLong);
    // heavy rows are listed ascending: all of them heavy is every row in order, read in place
    const bool all_heavy = n_heavy == x.size(0);
    at::Tensor xh = all_heavy ? x : x.index_select(0, rows), dyh = all_heavy ? d_out : d_out.index_select(0, rows);
    // h, du and dg of the heavy rows, computed in chunks of rows: the gate and up values and the
    // products between them exist for one chunk at a time, so a layer of mostly heavy rows stays under
    // dense PyTorch's memory (every row's values are its own; the GEMMs' sizes follow the chunks, which can
    // change cuBLAS's choice of kernel and so last bits, deterministically for a given heavy-row count).
    at::Tensor hh = at::empty({n_heavy, H}, xh.options()), duh = at::empty_like(hh), dgh = at::empty_like(hh);
    for (int64_t r0 = 0; r0 < n_heavy; r0 += kHeavyChunkRows) {
      const int64_t n = std::min(kHeavyChunkRows, n_heavy - r0);
      const at::Tensor xc = xh.narrow(0, r0, n);
      const at::Tensor gc = at::mm(xc, w_gate.t()), uc = at::mm(xc, w_up.t());
      const at::Tensor ds = at::mm(dyh.narrow(0, r0, n), w_down);
      at::Tensor hc = hh.narrow(0, r0, n), duc = duh.narrow(0, r0, n), dgc = dgh.narrow(0, r0, n);
      heavy_grads_into(gc, uc, ds, l1_grad, hc, duc, dgc);  // row chunks of [n_heavy, H]: contiguous
    }
    // each product as soon as its operands are complete, each operand freed after its last use
    pd = at::mm(hh.t(), dyh);
    hh.reset();
    dyh.reset();
    at::Tensor dxh = all_heavy ? at::mm_out(dx, duh, w_up) : at::mm(duh, w_up);
    dxh.add_(at::mm(dgh, w_gate));
    if (!all_heavy) dx.index_copy_(0, rows, dxh);
    dxh.reset();
    pu = at::mm(duh.t(), xh);
    duh.reset();
    pg = at::mm(dgh.t(), xh);
  }
  auto row = [](const at::Tensor& t, int64_t i, int64_t n) { return t.select(0, i).narrow(0, 0, n); };
  auto w = train_columns(ent, row(items, 0, n_items), row(items, 1, n_items), row(items, 2, n_items),
                         row(items, 3, n_items), row(longs, 0, n_long), row(longs, 1, n_long), row(longs, 2, n_long),
                         n_part, h, b[1], b[2], x, d_out, pd, pu, pg, H, slots, column_parts);
  return {dx, w[2], w[1], transpose_bf16(w[0])};
}
}  // namespace twell::bind
