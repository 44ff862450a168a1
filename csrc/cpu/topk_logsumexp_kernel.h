// CPU kernel of topk_logsumexp on raw pointers (no torch headers); see topk_logsumexp_kernel.cpp.
#pragma once

#include <cstdint>

#include "cpu/isa.h"

namespace sbd_cpu {

// One fp32 row x [V] (unit stride): its k largest entries ordered by (value descending, index ascending; NaN above
// every number, as torch.topk orders it) into values / indices [k], and log(sum(exp(x))) into *lse (NaN where the row
// has a NaN, the row's max where that is infinite: torch.logsumexp's values). 0 <= k <= V.
SBD_CPU_DECLARE_KERNEL(void, topk_logsumexp_row, const float* x, int64_t V, int64_t k, float* values,
                       int64_t* indices, float* lse)

}  // namespace sbd_cpu
