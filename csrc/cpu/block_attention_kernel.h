// CPU kernel of block_attention on raw pointers (no torch headers); see block_attention_kernel.cpp.
#pragma once

#include <atomic>
#include <cstdint>

#include "cpu/isa.h"

namespace sbd_cpu {

enum class AttnDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct BlockAttentionParams {
  // q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D]; all of dtype `dtype`, unit stride
  // along D, other strides in elements.
  const void* q;
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  void* out;  // [B, T, Hq, D] contiguous, dtype `dtype`
  AttnDtype dtype;
  int64_t B, Hq, Hkv, T, D, S;
  int64_t q_sb, q_sh, q_st;
  int64_t k_sb, k_sh, k_st;
  int64_t v_sb, v_sh, v_st;
  int64_t kc_sb, kc_sh, kc_st;
  int64_t vc_sb, vc_sh, vc_st;
  // Host copies of the per-sequence lengths, already validated (n_commit <= n_valid <= T, len + n_commit <= S).
  const int64_t* cache_lens;
  const int64_t* n_commit;
  const int64_t* n_valid;
  float scale;

  // Work decomposition, chosen by the binding (block_attention_cpu.cpp).
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

// Run units taken one at a time from `next` (shared by the threads; units are taken while next < n_units()):
// attention of each unit's lanes over its share of the keys, the cache append of the committed rows (split 0 of
// panel 0 of each (b, kv head)), and the zero rows of padding. With n_splits == 1 the output rows are final;
// otherwise the unit writes its partial state. Units are independent, so the order does not change the result.
SBD_CPU_DECLARE_KERNEL(void, block_attention_units, const BlockAttentionParams& p, std::atomic<int64_t>& next)

// With n_splits > 1: merge the partial states of items [i0, i1) and write their output rows.
SBD_CPU_DECLARE_KERNEL(void, block_attention_merge, const BlockAttentionParams& p, int64_t i0, int64_t i1)

}  // namespace sbd_cpu
