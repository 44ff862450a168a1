// Online-softmax state of one attention row, and the merge of partial states (flash-decoding splits).
//
// A partial result over a subset of the keys is (m, l, acc) with
//   m = max_j x_j,   l = sum_j e^(x_j - m),   acc = sum_j e^(x_j - m) v_j
// where x_j are the (scaled, masked) logits. Two partials over disjoint key sets combine exactly:
//   m' = max(m1, m2),   l' = l1 e^(m1 - m') + l2 e^(m2 - m'),   acc' = acc1 e^(m1 - m') + acc2 e^(m2 - m')
// and the attention output is acc / l. A row that saw no visible key has m = -inf, l = 0: it merges as the
// identity and its output is 0 (the padding-row convention of block_attention).
//
// These scalar helpers are the single definition of the rule: the CPU kernel (block_attention_kernel.cpp) uses
// them per row on its decode path and to merge kv splits, and applies the same update in vector form, 16 rows at
// a time, in its main loop (softmax_tile); the CUDA split-KV kernel is meant to use them too.
#pragma once

#include <cmath>

#include "sbd/common.h"

namespace sbd {

#if defined(__CUDACC__)
SBD_HD float softmax_exp(float x) { return __expf(x); }
#else
SBD_HD float softmax_exp(float x) { return std::exp(x); }
#endif

// The offset the exponentials of a row use once its running max is m: m itself, or 0 while the row has seen no
// visible key (m = -inf), so that e^(x - offset) is 0 for masked x = -inf instead of NaN.
SBD_HD float softmax_offset(float m) { return m == -INFINITY ? 0.f : m; }

struct SoftmaxState {
  float m;  // running max of the logits seen (-inf while none was visible)
  float l;  // sum e^(x - m)

  SBD_HD static SoftmaxState empty() { return SoftmaxState{-INFINITY, 0.f}; }

  // Fold in a block of logits whose max is block_max and whose exponentials were taken relative to
  // offset = softmax_offset(max(m, block_max)), summing to block_sum. Returns alpha, the factor by which the
  // accumulator of the earlier keys must be multiplied (0 for a row that had seen nothing).
  SBD_HD float push_block(float block_max, float block_sum) {
    const float m_new = m > block_max ? m : block_max;
    const float alpha = softmax_exp(m - softmax_offset(m_new));  // e^-inf = 0 when m = -inf
    l = l * alpha + block_sum;
    m = m_new;
    return alpha;
  }

  // Merge another partial state into this one. On return, acc_this * self_scale + acc_other * other_scale is the
  // accumulator of the union. Exact up to rounding, associative and commutative, so any split of the keys works.
  SBD_HD void merge(const SoftmaxState& o, float& self_scale, float& other_scale) {
    const float m_new = m > o.m ? m : o.m;
    const float off = softmax_offset(m_new);
    self_scale = l > 0.f ? softmax_exp(m - off) : 0.f;
    other_scale = o.l > 0.f ? softmax_exp(o.m - off) : 0.f;
    l = l * self_scale + o.l * other_scale;
    m = m_new;
  }

  // Factor that turns the accumulator into the output: 1 / l, or 0 for a row that saw no visible key.
  SBD_HD float inv_sum() const { return l > 0.f ? 1.f / l : 0.f; }
};

}  // namespace sbd
