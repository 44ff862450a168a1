// Argument checks of entropy_sample, shared by its CPU and CUDA bindings, and the temperature rule both apply.
#pragma once

#include <cfloat>
#include <cmath>

#include "checks.h"

namespace sbd_ext {

// Temperatures below this are greedy (the argmax), on every device and in sbd_ext.reference
// (GREEDY_TEMPERATURE). Below it, logits / T overflows fp32 for logits of a few 1e32 and beyond (at T = 1e-30
// already for logits above 3e8: every positive logit scored +inf and the first one won); and a sample at such a
// temperature differs from the argmax only between logits within ~20 T of the maximum.
constexpr double kGreedyTemperature = 1e-6;

// The Philox counter holds the row and the vocabulary quad (index / 4) in 32 bits each: beyond these sizes draws
// would repeat (and the CUDA kernel keeps quad 2^32 - 1 as its "no quad cached" mark).
constexpr int64_t kMaxRows = int64_t{1} << 32;
constexpr int64_t kMaxVocab = 4 * ((int64_t{1} << 32) - 1);

inline void check_entropy_sample(const at::Tensor& logits, double temperature) {
  constexpr const char* op = "entropy_sample";
  check_dtype(op, "logits", logits, {at::kFloat, at::kBFloat16, at::kHalf});
  check_dim(op, "logits", logits, 2, "[N, V]");
  TORCH_CHECK_VALUE(logits.size(1) > 0, op, ": logits must have a non-empty vocabulary dimension, got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(logits.size(0) <= kMaxRows && logits.size(1) <= kMaxVocab, op,
                    ": logits may have at most 2^32 rows and 4 (2^32 - 1) columns (the Philox counter), got shape ",
                    logits.sizes());
  check_inner_contiguous(op, "logits", logits);
  TORCH_CHECK_VALUE(temperature >= 0.0 && temperature <= FLT_MAX, op,
                    ": temperature must be a finite number >= 0 that fits in float32 (0 = greedy), got ", temperature);
}

// The fp32 temperature the kernels run with: 0 (greedy) below kGreedyTemperature.
inline float kernel_temperature(double temperature) {
  return temperature < kGreedyTemperature ? 0.f : static_cast<float>(temperature);
}

}  // namespace sbd_ext
