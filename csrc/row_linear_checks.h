// Argument checks of row_linear, shared by its CPU and CUDA bindings.
#pragma once

#include "checks.h"

namespace sbd_ext {

// x [M, K] and weight [N, K] fp32 on one device, each contiguous along K, and M * N (the output's size) within
// int64.
inline void check_row_linear(const at::Tensor& x, const at::Tensor& weight) {
  constexpr const char* op = "row_linear";
  check_dtype(op, "x", x, {at::kFloat});
  check_dtype(op, "weight", weight, {at::kFloat});
  check_dim(op, "x", x, 2, "[M, K]");
  check_dim(op, "weight", weight, 2, "[N, K]");
  check_size(op, "weight", weight, 1, x.size(1), "x.size(1) (K)");
  check_same_device(op, "weight", weight, x, "x");
  check_inner_contiguous(op, "x", x);
  check_inner_contiguous(op, "weight", weight);
  checked_mul(op, "the output size M * N", {x.size(0), weight.size(0)});
}

}  // namespace sbd_ext
