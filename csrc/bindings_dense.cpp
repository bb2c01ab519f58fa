// Bindings of the dense path for heavy rows (csrc/twell_dense.cu): the rule for its row capacity.
#include "bindings_common.h"

#include <algorithm>

namespace twell::bind {

// Rows of one round of the dense path for M rows of the inference FFN. requested: None for the rule,
// M / 8 rounded up to 128 (the paper sizes its training dense backup the same way), at least
// kDenseRoundFloor; else that many rows, rounded up to 128 (0: the path off). Either way at most M
// rounded up to 128, and 0 (off) below kDenseMinRows, where the path could never run. More heavy
// rows than the capacity take several rounds. The floor keeps a round's down GEMM on every SM on
// near-dense inputs; the workspace this costs and the measurements behind both: docs/kernels.md §5.
constexpr int64_t kDenseRoundFloor = 4096;

int64_t dense_cap(int64_t M, const c10::optional<int64_t>& requested) {
  TORCH_CHECK(M >= 0, "twell.dense_cap: M must be >= 0, got ", M);
  TORCH_CHECK(!requested.has_value() || *requested >= 0, "twell: dense_cap must be None (the default rule) or "
              "a number of rows >= 0 (0: the dense path off), got ", requested.value_or(0));
  auto up = [](int64_t v) { return (v + 127) / 128 * 128; };
  // min before rounding: the same as rounding both, without overflow for a huge request
  const int64_t cap = requested.has_value() ? up(std::min(*requested, M))
                      : M < twell::kDenseMinRows ? 0
                                                 : std::min(std::max(up(M / 8), kDenseRoundFloor), up(M));
  return cap < twell::kDenseMinRows ? 0 : cap;
}

}  // namespace twell::bind
