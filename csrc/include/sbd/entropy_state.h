// Online softmax statistics of one row of logits, computed in a single pass (the entropy and max probability of
// softmax(x / T) that entropy_sample returns; the op contract is in README.md, "Ops").
//
// State over the elements seen so far, relative to their running maximum m:
//   r = sum_j e^(x_j - m) over every element but one occurrence of the maximum   (so s = sum_j e^(x_j - m) = 1 + r)
//   u = sum_j e^(x_j - m) (m - x_j)   (>= 0)
// Then p_max = 1 / (1 + r), logsumexp = m + log1p(r) and the entropy (nats)
//   H = -sum_j p_j ln p_j = log1p(r) + u / (1 + r),
// a sum of two non-negative terms, each computed to a few ulps, so H keeps its relative accuracy however close to
// zero it is. (The textbook one-pass form H = m + ln s - t / s, t = sum e^(x - m) x, subtracts numbers of size m;
// even t relative to m, H = ln s - t / s, rounds s = 1 + r to fp32 and loses r below 6e-8: an absolute error of
// ~1e-7 that decides the reveal order of near-certain positions at gamma = 0.) The max's own term, e^0 = 1, is
// never added to r, so a near-one-hot row has r and u made of its small terms only.
// When m grows to m' = m + delta (delta > 0) with the new element as the max, the old max joins r:
//   r' = (1 + r) e^-delta,   u' = e^-delta (u + delta (1 + r)).
// -inf logits are banned tokens and contribute nothing. A NaN or +inf logit makes the row invalid, as does a
// row whose logits are all -inf: its entropy and p_max are NaN and its chosen token is -1.
#pragma once

#include <cmath>

#include "sbd/common.h"

namespace sbd {

// e^x. __expf is device-only: choose by __CUDA_ARCH__ (the device pass), not __CUDACC__, which is also defined in
// nvcc's host pass. Host code, under any compiler, uses std::exp. __expf (ex2.approx of x log2 e) has a relative
// error of up to (2 + 1.17 |x|) ulp, mostly from rounding x log2 e to fp32; the CUDA emulator (tools/cuda_emu)
// defines SBD_EMULATE_DEVICE_EXPF to reproduce that rounding on the CPU, so the device's entropy error is tested
// without a GPU (python_tests/test_entropy_sample.py, test_entropy_accuracy_vs_float64).
SBD_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#elif defined(SBD_EMULATE_DEVICE_EXPF)
  return std::exp2(x * 1.44269504088896341f);
#else
  return std::exp(x);
#endif
}

struct EntropyState {
  float m;       // running max (-inf while empty)
  float r;       // sum of e^(x - m) over the elements but one occurrence of the max
  float u;       // sum of e^(x - m) (m - x)
  bool invalid;  // a NaN or +inf was seen

  SBD_HD static EntropyState empty() { return EntropyState{-INFINITY, 0.f, 0.f, false}; }

  SBD_HD void push(float x) {
    if (x != x || x == INFINITY) {
      invalid = true;
      return;
    }
    if (x == -INFINITY) return;
    if (m == -INFINITY) {
      m = x;
      return;
    }
    // d can overflow to +inf (m = 3e38, x = -3e38): e = 0 then, and the products below are skipped, not NaN.
    const float d = x > m ? x - m : m - x;
    const float e = fast_exp(-d);
    if (x > m) {
      if (e > 0.f) {
        u = e * (u + d * (1.f + r));
        r = e * (1.f + r);
      } else {
        u = 0.f;
        r = 0.f;
      }
      m = x;
    } else if (e > 0.f) {
      r += e;
      u += e * d;
    }
  }

  // Fold another state in. Associative and commutative up to rounding, so any split of a row works.
  SBD_HD void merge(const EntropyState& o) {
    invalid = invalid || o.invalid;
    if (o.m == -INFINITY) return;
    if (m == -INFINITY) {
      m = o.m;
      r = o.r;
      u = o.u;
      return;
    }
    // hi keeps its max; lo's max joins r (equal maxes: lo's max is a second occurrence, e = 1).
    const bool o_hi = o.m > m;
    const EntropyState& hi = o_hi ? o : *this;
    const EntropyState& lo = o_hi ? *this : o;
    const float d = hi.m - lo.m;
    const float e = fast_exp(-d);
    float r_new = hi.r, u_new = hi.u;
    if (e > 0.f) {
      r_new += e * (1.f + lo.r);
      u_new += e * (lo.u + d * (1.f + lo.r));
    }
    m = hi.m;
    r = r_new;
    u = u_new;
  }

  SBD_HD bool ok() const { return !invalid && m != -INFINITY; }
  SBD_HD float entropy() const { return ok() ? log1pf(r) + u / (1.f + r) : NAN; }
  SBD_HD float max_prob() const { return ok() ? 1.f / (1.f + r) : NAN; }
};

// Running argmax of a score; ties go to the lowest index, as torch.argmax does.
struct ArgmaxState {
  float best;
  int64_t index;  // -1 while empty

  SBD_HD static ArgmaxState empty() { return ArgmaxState{-INFINITY, -1}; }

  SBD_HD void push(float score, int64_t j) {
    if (score > best) {  // strict: the first of equal scores stays; -inf is never chosen
      best = score;
      index = j;
    }
  }
  SBD_HD void merge(const ArgmaxState& o) {
    if (o.index < 0) return;
    if (index < 0 || o.best > best || (o.best == best && o.index < index)) {
      best = o.best;
      index = o.index;
    }
  }
};

}  // namespace sbd
