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
                       float scale, uint8_t* mark, bool* finite)

}  // namespace sbd_cpu
