// CPU kernel of screened_head's screen on raw pointers (no torch headers); see screened_head_kernel.cpp.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/row_linear_kernel.h"  // kRowLinearPanel: the packed head's rows per panel

namespace sbd_cpu {

// One row's screened logits a [V] (V real columns; the caller has set a[exclude] to -FLT_MAX, exclude -1 for none)
// and the head rows' norms wn [V]: t = max_j (a_j - e_j) with e_j = scale * wn_j, then mark[j / 16] = 1 for every j
// with a_j + e_j >= t (and exclude's panel). Each e_j is widened by 2^-22 (|a_j| + e_j) + 2^-100, more than the
// roundings of e_j, a_j - e_j and a_j + e_j (each within 2^-24 of its operands' magnitudes), so a column left out
// has a_j + e_j < t in real arithmetic. *finite: false (and the marks incomplete) where a value, t or scale is NaN or
// infinite: the caller then runs the fp32 head whole.
SBD_CPU_DECLARE_KERNEL(void, screened_head_mark, const float* a, const float* wn, int64_t V, int64_t exclude,
                       float scale, float absolute, uint8_t* mark, bool* finite)

// Whether this variant on this CPU computes the screen with bf16 products (AVX512-BF16's vdpbf16ps; the AVX-512
// variant on a CPU that has it): x rounded to bf16, products exact, fp32 sums -- a wider bound than the fp32 products
// of the widened screen (screened_head_cpu.cpp) and half the instructions, which several rows need.
SBD_CPU_DECLARE_KERNEL(bool, screened_head_pairs_usable)

// x rows [0, M) (row stride x_stride, K values) rounded to bf16 (to nearest even; NaN as 0x7FC0) in pairs along K:
// xp[j * M + m] holds row m's values 2j (low 16 bits) and 2j + 1 (high; zero past K), j < ceil(K / 2).
SBD_CPU_DECLARE_KERNEL(void, screened_head_x_pairs, const float* x, int64_t x_stride, int64_t M, int64_t K,
                       uint32_t* xp)

// The screen's values of every row of xp (screened_head_x_pairs) for its panels [p0, p1) (bf16 panels [P, K, 16],
// row_linear's layout) by vdpbf16ps: out[m * ld + 16 p + i] = sum over k of x~_mk w~_(16p+i)k in fp32 (an order
// of the hardware's; each product exact, denormal operands and results flushed to zero). Only where
// screened_head_pairs_usable().
SBD_CPU_DECLARE_KERNEL(void, screened_head_pairs_range, const uint32_t* xp, int64_t M, int64_t K,
                       const uint16_t* screen, int64_t p0, int64_t p1, float* out, int64_t ld)

}  // namespace sbd_cpu
