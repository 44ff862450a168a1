// The acceptance rules of mask_replace, as a per-position predicate shared by the CPU and CUDA kernels.
//
// For one sequence of a block (K positions), the candidates are the positions that still hold the mask id
// and whose proposal is a real token (>= 0, i.e. its logits row was valid, and not the mask id itself) with a
// non-NaN score. Candidates are ordered by key (entropy ascending, or confidence descending), ties by
// position. rank_i is the number of candidates before i in that order. Then:
//   EB (paper Eq. 8):      reveal i  iff  sum_{j : rank_j < rank_i} H_j <= gamma     (sum over the sorted prefix)
//   entropy threshold:     reveal i  iff  H_i < gamma      or rank_i == 0
//   confidence threshold:  reveal i  iff  p_i > tau        or rank_i == 0
// rank 0 is always revealed, so every call reveals at least one position while a candidate exists.
// The EB prefix sum is accumulated in double so that its value does not depend on summation order (the
// reference sums in sorted order, this code in position order); entropies below 0 count as 0.
// O(K^2) per sequence with no scratch memory: K is the block size (<= a few dozen).
#pragma once

#include "sbd/common.h"

namespace sbd {

struct AcceptView {
  const int64_t* tokens;     // [K], stride tok_stride
  const int64_t* proposals;  // [K], stride prop_stride
  const float* entropy;      // [K], stride ent_stride
  const float* confidence;   // [K], stride conf_stride
  int64_t tok_stride, prop_stride, ent_stride, conf_stride;
  int64_t K;
  int64_t mask_id;
};

SBD_HD bool accept_is_candidate(const AcceptView& v, AcceptRule rule, int64_t i) {
  const int64_t p = v.proposals[i * v.prop_stride];
  if (v.tokens[i * v.tok_stride] != v.mask_id || p < 0 || p == v.mask_id) return false;
  const float key = rule == AcceptRule::kConfidenceThreshold ? v.confidence[i * v.conf_stride]
                                                             : v.entropy[i * v.ent_stride];
  return key == key;  // not NaN
}

// Sort key, smaller first.
SBD_HD float accept_key(const AcceptView& v, AcceptRule rule, int64_t i) {
  return rule == AcceptRule::kConfidenceThreshold ? -v.confidence[i * v.conf_stride] : v.entropy[i * v.ent_stride];
}

// Whether position i is revealed. Must be evaluated for every position before any token is written.
SBD_HD bool accept_reveal(const AcceptView& v, AcceptRule rule, double threshold, int64_t i) {
  if (!accept_is_candidate(v, rule, i)) return false;
  const float ki = accept_key(v, rule, i);
  int64_t rank = 0;
  double prefix = 0.0;  // EB: sum of the entropies ranked before i
  for (int64_t j = 0; j < v.K; ++j) {
    if (j == i || !accept_is_candidate(v, rule, j)) continue;
    const float kj = accept_key(v, rule, j);
    if (kj < ki || (kj == ki && j < i)) {
      ++rank;
      const float h = v.entropy[j * v.ent_stride];
      prefix += h > 0.f ? static_cast<double>(h) : 0.0;
    }
  }
  if (rank == 0) return true;
  switch (rule) {
    case AcceptRule::kEntropyBound:
      return prefix <= threshold;
    case AcceptRule::kEntropyThreshold:
      return static_cast<double>(v.entropy[i * v.ent_stride]) < threshold;
    case AcceptRule::kConfidenceThreshold:
      return static_cast<double>(v.confidence[i * v.conf_stride]) > threshold;
  }
  return false;
}

}  // namespace sbd
