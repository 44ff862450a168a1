// CPU kernel of block_attention on raw pointers (no torch headers); see block_attention_kernel.cpp.
#pragma once

#include <atomic>
#include <cstdint>

#include "cpu/isa.h"
#include "sbd/block_attention_params.h"

namespace sbd_cpu {

enum class AttnDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The shared problem description (sbd/block_attention_params.h: pointers, sizes, strides, scale, lengths; on
// the CPU the lengths are host copies the binding has validated) plus the CPU's work plan.
struct BlockAttentionParams : sbd::BlockAttentionParams {
  AttnDtype dtype;

  // Work decomposition, chosen by block_attention_plan below.
  // A work item is (b, kv head, panel): the g = Hq / Hkv query heads of that kv head times the valid new rows,
  // packed as g * n_valid[b] query rows ("lanes", head-major), cut into panels of panel_lanes lanes. Each item is
  // further cut into n_splits ranges of the cache (flash-decoding); split s of an item is unit
  // (item * n_splits + s). With n_splits > 1 every unit writes a partial state to `partials` and
  // block_attention_merge combines them.
  int64_t panel_lanes;
  int64_t n_panels;
  int64_t n_splits;
  float* partials;  // n_items * n_splits * partial_floats(), when n_splits > 1

  int64_t n_items() const { return B * Hkv * n_panels; }
  int64_t n_units() const { return n_items() * n_splits; }
  // One partial: acc^T [D][panel_lanes], then m [panel_lanes] and l [panel_lanes].
  int64_t partial_floats() const { return (D + 2) * panel_lanes; }
};

// Cache splits are capped so that the merge keeps one scale per split on the stack.
constexpr int64_t kMaxSplits = 64;

// Fills panel_lanes, n_panels and n_splits for `threads` worker threads (block_attention_plan.cpp). The lengths
// must be valid; `partials` is left for the caller to allocate (n_units() * partial_floats() floats when
// n_splits > 1).
void block_attention_plan(BlockAttentionParams& p, int64_t threads);

// Run units taken one at a time from `next` (shared by the threads; units are taken while next < n_units()):
// attention of each unit's lanes over its share of the keys, the cache append of the committed rows (split 0 of
// panel 0 of each (b, kv head)), and the zero rows of padding. With n_splits == 1 the output rows are final;
// otherwise the unit writes its partial state. Units are independent, so the order does not change the result.
SBD_CPU_DECLARE_KERNEL(void, block_attention_units, const BlockAttentionParams& p, std::atomic<int64_t>& next)

// With n_splits > 1: merge the partial states of items [i0, i1) and write their output rows.
SBD_CPU_DECLARE_KERNEL(void, block_attention_merge, const BlockAttentionParams& p, int64_t i0, int64_t i1)

}  // namespace sbd_cpu
