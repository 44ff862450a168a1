// Online-softmax state of one attention row, and the merge of partial states (flash-decoding splits).
//
// A partial result over a subset of the keys is (m, l, acc) with
//   m = max_j x_j,   l = sum_j b^(x_j - m),   acc = sum_j b^(x_j - m) v_j
// where x_j are the (scaled, masked) logits and b the base of the exponentials. Two partials over disjoint key sets
// combine exactly:
//   m' = max(m1, m2),   l' = l1 b^(m1 - m') + l2 b^(m2 - m'),   acc' = acc1 b^(m1 - m') + acc2 b^(m2 - m')
// and the attention output is acc / l. A row that saw no visible key has m = -inf, l = 0: it merges as the
// identity and its output is 0 (the padding-row convention of block_attention).
//
// The base is the one difference between the devices, and it does not change the result: the CPU kernel
// (block_attention_kernel.cpp) works in base e (ExpE: at::vec's exp in its vector loop, std::exp here); the CUDA
// kernels (block_attention.cuh) work in base 2 (Exp2: exp2f, one MUFU.EX2 instruction) on logits pre-multiplied by
// log2(e) (folded into the softmax scale), so 2^(x log2 e - m2) = e^(x - m) with m2 = m log2 e, and their partial
// states hold m in log2 units. Both run the update below (softmax_advance / SoftmaxStateT): the CPU per row on
// its decode path and to merge kv splits, and in vector form, 16 rows at a time, in its main loop (softmax_tile);
// the CUDA attention kernels per row through softmax_advance<Exp2>.
#pragma once

#include <cmath>

#include "sbd/common.h"

namespace sbd {

// e^x: __expf is device-only, so choose by __CUDA_ARCH__ (nvcc's device pass), not __CUDACC__, which nvcc's host
// pass defines too (the same rule as sbd/entropy_state.h). Host code, under any compiler, uses std::exp.
struct ExpE {
  SBD_HD static float f(float x) {
#if defined(__CUDA_ARCH__)
    return __expf(x);
#else
    return std::exp(x);
#endif
  }
};

// 2^x.
struct Exp2 {
  SBD_HD static float f(float x) {
#if defined(__CUDA_ARCH__)
    return exp2f(x);
#else
    return std::exp2(x);
#endif
  }
};

// The offset the exponentials of a row use once its running max is m: m itself, or 0 while the row has seen no
// visible key (m = -inf), so that b^(x - offset) is 0 for masked x = -inf instead of NaN.
SBD_HD float softmax_offset(float m) { return m == -INFINITY ? 0.f : m; }

// Advance a row's running max m over a block of logits whose max is block_max. Sets `offset`, the value this
// block's exponentials subtract (softmax_offset of the new max), and returns alpha = b^(m_old - offset), the factor
// for everything accumulated before (0 for a row that had seen nothing).
template <class Exp>
SBD_HD float softmax_advance(float& m, float block_max, float& offset) {
  const float m_new = m > block_max ? m : block_max;
  offset = softmax_offset(m_new);
  const float alpha = Exp::f(m - offset);  // b^-inf = 0 when m = -inf
  m = m_new;
  return alpha;
}

template <class Exp>
struct SoftmaxStateT {
  float m;  // running max of the logits seen (-inf while none was visible)
  float l;  // sum b^(x - m)

  SBD_HD static SoftmaxStateT empty() { return SoftmaxStateT{-INFINITY, 0.f}; }

  // Fold in a block of logits whose max is block_max and whose exponentials were taken relative to
  // offset = softmax_offset(max(m, block_max)), summing to block_sum. Returns alpha (softmax_advance).
  SBD_HD float push_block(float block_max, float block_sum) {
    float offset;
    const float alpha = softmax_advance<Exp>(m, block_max, offset);
    l = l * alpha + block_sum;
    return alpha;
  }

  // Merge another partial state into this one. On return, acc_this * self_scale + acc_other * other_scale is the
  // accumulator of the union. Exact up to rounding, associative and commutative, so any split of the keys works.
  SBD_HD void merge(const SoftmaxStateT& o, float& self_scale, float& other_scale) {
    const float m_new = m > o.m ? m : o.m;
    const float off = softmax_offset(m_new);
    self_scale = l > 0.f ? Exp::f(m - off) : 0.f;
    other_scale = o.l > 0.f ? Exp::f(o.m - off) : 0.f;
    l = l * self_scale + o.l * other_scale;
    m = m_new;
  }

  // Factor that turns the accumulator into the output: 1 / l, or 0 for a row that saw no visible key.
  SBD_HD float inv_sum() const { return l > 0.f ? 1.f / l : 0.f; }
};

using SoftmaxState = SoftmaxStateT<ExpE>;   // base e: the CPU kernel
using SoftmaxState2 = SoftmaxStateT<Exp2>;  // base 2: the CUDA kernels' partial states

}  // namespace sbd
