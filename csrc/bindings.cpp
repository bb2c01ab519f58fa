// The extension's Python module: registers the functions of every kernel family, which live in
// bindings_<family>.cpp over the checks of bindings_common.h. The torch.library ops
// (src/twell/kernels/ops.py) call these functions.
//
// The settings of a launch (union_ratio / union_base, dense_cap, spill_cap, cluster) have no
// defaults here: they are keyword-only and required, so that their defaults live in one place, the
// Python constants the ops pass (twell.reference.ffn, twell.kernels.ops; docs/kernels.md §2), and a
// direct caller of the extension states them.
#include "bindings_common.h"

namespace py = pybind11;
using namespace twell::bind;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "TwELL sparse FFN kernels (Hopper sm_90a)";
  // -- gate
  m.def("gate_twell", &gate_twell, "TwELL(relu(x @ w^T)) written by the gate GEMM epilogue, and its spill area",
        py::arg("x"), py::arg("w"), py::arg("tile"), py::arg("compression"), py::arg("max_sms") = 0, py::kw_only(),
        py::arg("spill_cap"), py::arg("cluster"));
  m.def("sparse_ffn_spill_words", &sparse_ffn_spill_words,
        "words of sparse_ffn's internal spill block (spill area, its counter, the gate's ready counters)",
        py::arg("M"), py::arg("spill_cap"));
  // -- fused up/down, the one op, the dense path's capacity
  m.def("ffn_forward", &ffn_forward, "fused sparse up/down projection from TwELL", py::arg("x"), py::arg("tw"),
        py::arg("spill"), py::arg("w_act"), py::arg("w_up"), py::arg("w_down_t"), py::arg("tile"),
        py::arg("compression"), py::arg("max_sms") = 0, py::arg("out") = py::none(), py::kw_only(),
        py::arg("union_ratio"), py::arg("union_base"), py::arg("dense_cap"));
  m.def("sparse_ffn", &sparse_ffn, "gate kernel + fused up/down in one call (the fused kernel overlaps the gate's tail)",
        py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down_t"), py::arg("tile"),
        py::arg("compression"), py::kw_only(), py::arg("union_ratio"), py::arg("union_base"), py::arg("dense_cap"),
        py::arg("spill_cap"), py::arg("cluster"));
  m.def("dense_cap", &dense_cap,
        "rows per round of the dense path for M rows: the rule (requested None) or the requested rows, bounded",
        py::arg("M"), py::arg("requested") = py::none());
  // -- block-union path
  m.def("union_unsupported", &union_unsupported,
        "why the block-union path cannot serve a gated layer of this D and H, or '' when it can", py::arg("D"),
        py::arg("H"));
  m.def("ffn_plan", &ffn_plan, "block-union plan only (diagnostic)", py::arg("x"), py::arg("tw"), py::arg("spill"),
        py::arg("w_up"), py::arg("w_down_t"), py::arg("tile"), py::arg("compression"), py::arg("ratio"),
        py::arg("base"));
  // -- decoding
  m.def("decode_ffn", &decode_ffn, "gated FFN for a few rows: only the active neurons' up/down rows are read",
        py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down_t"), py::arg("threshold") = 0.0,
        py::arg("up_relu") = false);
  m.def("decode_max_rows", []() { return twell::kDecodeMaxRows; }, "the most rows decode_ffn takes");
  // -- training
  m.def("train_compact", &train_compact, "relu(g) compacted per row for the training kernels", py::arg("g"),
        py::arg("slots"));
  m.def("train_rows_forward", &train_rows_forward, "training forward of the light rows");
  m.def("train_rows_backward", &train_rows_backward, "training backward (dx, du, dg) of the light rows");
  m.def("train_forward", &train_forward, "the sparse training FFN's forward (no host sync where D % 64 == 0)",
        py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down"), py::arg("slots"), py::arg("chunk"),
        py::arg("sizes_host") = py::none());
  m.def("train_backward", &train_backward, "the sparse training FFN's backward (no host sync given sizes on the CPU)",
        py::arg("d_out"), py::arg("l1_grad"), py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down"),
        py::arg("w_down_t"), py::arg("idx"), py::arg("val"), py::arg("u"), py::arg("h"), py::arg("nnz"),
        py::arg("heavy"), py::arg("ent"), py::arg("items"), py::arg("longs"), py::arg("sizes"), py::arg("slots"),
        py::arg("column_parts") = 0, py::arg("rows_done") = py::none());
  m.def("transpose_bf16", &transpose_bf16, "bf16 matrix transpose");
  m.def("gate_product", &gate_product, "a gate variant's dense hidden state in one kernel", py::arg("g"), py::arg("u"),
        py::arg("threshold"), py::arg("up_relu"));
  m.def("train_heavy_grads", &train_heavy_grads, "the heavy rows' elementwise backward (h, du, dg)", py::arg("g"),
        py::arg("u"), py::arg("ds"), py::arg("l1_grad") = py::none());
  m.def("train_worklist", &train_worklist, "the weight-gradient kernel's work list (no host sync)");
  m.def("train_columns", &train_columns, "weight gradients from the column-sorted entries");
}
