// Argument checks and rule parsing of mask_replace, shared by its CPU and CUDA bindings.
#pragma once

#include <string>
#include <utility>

#include "checks.h"
#include "sbd/common.h"

namespace sbd_ext {

inline sbd::AcceptRule parse_accept_rule(const std::string& rule) {
  if (rule == "eb") return sbd::AcceptRule::kEntropyBound;
  if (rule == "entropy") return sbd::AcceptRule::kEntropyThreshold;
  if (rule == "confidence") return sbd::AcceptRule::kConfidenceThreshold;
  TORCH_CHECK_VALUE(false, "mask_replace: rule must be one of \"eb\", \"entropy\", \"confidence\", got \"", rule,
                    "\"");
}

inline void check_mask_replace(const at::Tensor& tokens, const at::Tensor& proposals, const at::Tensor& entropy,
                               const at::Tensor& max_prob, sbd::AcceptRule rule, double threshold) {
  constexpr const char* op = "mask_replace";
  check_dtype(op, "tokens", tokens, {at::kLong});
  check_dim(op, "tokens", tokens, 2, "[B, K]");
  const int64_t B = tokens.size(0), K = tokens.size(1);
  check_dtype(op, "proposals", proposals, {at::kLong});
  check_dtype(op, "entropy", entropy, {at::kFloat});
  check_dtype(op, "max_prob", max_prob, {at::kFloat});
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"proposals", proposals},
                         {"entropy", entropy},
                         {"max_prob", max_prob}}) {
    check_dim(op, name, t, 2, "[B, K]");
    check_size(op, name, t, 0, B, "tokens.size(0)");
    check_size(op, name, t, 1, K, "tokens.size(1)");
    check_same_device(op, name, t, tokens, "tokens");
  }
  // tokens is written while proposals / entropy / max_prob (and the other positions of tokens) are still read.
  check_no_internal_overlap(op, "tokens", tokens);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"proposals", proposals},
                         {"entropy", entropy},
                         {"max_prob", max_prob}})
    check_no_overlap(op, "tokens", tokens, name, t);
  TORCH_CHECK_VALUE(threshold == threshold, op, ": threshold must be a number, got NaN");
  if (rule != sbd::AcceptRule::kConfidenceThreshold)
    TORCH_CHECK_VALUE(threshold >= 0.0, op, ": the entropy threshold gamma must be >= 0, got ", threshold);
}

}  // namespace sbd_ext
