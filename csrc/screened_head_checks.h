// Argument checks of screened_head, shared by its CPU and CUDA bindings.
#pragma once

#include "row_linear_checks.h"

namespace sbd_ext {

// x [M, K] fp32, contiguous along K; weight fp32 packed [P, K, 16] (the exact head); screen bf16 packed [P, K, 16]
// (the same rows rounded to bf16, contiguous); screen_norm fp32 [V], contiguous, P * 16 - 16 < V <= P * 16 (the
// head's real rows: the rest are the panels' zero padding); exclude -1 or a row in [0, V); all on x's device.
inline void check_screened_head(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                                const at::Tensor& screen_norm, int64_t exclude) {
  constexpr const char* op = "screened_head";
  check_dtype(op, "x", x, {at::kFloat});
  check_dtype(op, "weight", weight, {at::kFloat});
  check_dtype(op, "screen", screen, {at::kBFloat16});
  check_dtype(op, "screen_norm", screen_norm, {at::kFloat});
  check_dim(op, "x", x, 2, "[M, K]");
  check_dim(op, "weight", weight, 3, "(the fp32 head packed in panels: [P, K, 16])");
  check_dim(op, "screen", screen, 3, "(the bf16 screen packed in panels: [P, K, 16])");
  check_dim(op, "screen_norm", screen_norm, 1, "[V]");
  check_size(op, "weight", weight, 1, x.size(1), "x.size(1) (K)");
  check_size(op, "weight", weight, 2, 16, "16 (a packed weight's panels hold 16 rows)");
  for (int64_t d = 0; d < 3; ++d) check_size(op, "screen", screen, d, weight.size(d), "weight's (the same panels)");
  const int64_t n = checked_mul(op, "the packed weight's rows P * 16", {weight.size(0), 16});
  const int64_t v = screen_norm.size(0);
  TORCH_CHECK_VALUE(v <= n && v > n - 16 && v >= 1, op, ": screen_norm has one entry per real row of the head (",
                    n - 15, "..", n, " for ", weight.size(0), " panels), got ", v);
  TORCH_CHECK_VALUE(exclude >= -1 && exclude < v, op, ": exclude must be -1 (none) or a row in [0, ", v, "), got ",
                    exclude);
  const std::pair<const char*, const at::Tensor*> dense[] = {
      {"weight", &weight}, {"screen", &screen}, {"screen_norm", &screen_norm}};
  for (const auto& [name, t] : dense) {
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous, got shape ", t->sizes(),
                      " and strides ", t->strides());
    check_same_device(op, name, *t, x, "x");
  }
  check_inner_contiguous(op, "x", x);
  checked_mul(op, "the output size M * P * 16", {x.size(0), n});
}

}  // namespace sbd_ext
