// block_attention's CPU work plan (panels of query lanes, cache splits): the CPU counterpart of
// sbd_cuda::block_attention_plan, on the same layer (torch-free, called by the binding after the shared params
// are filled). Compiled once, not per ISA: it only counts.
#include <algorithm>

#include "cpu/block_attention_kernel.h"

namespace sbd_cpu {
namespace {

// Query lanes (g heads x valid new rows) per panel: 256 lanes x D = 128 keep QT and O^T at 128 KB each, inside
// a 1-2 MB L2 next to the streamed K/V blocks. Llama's g = 4 with a 2k = 32-row forward is 128 lanes: one panel.
constexpr int64_t kMaxPanelLanes = 256;
// Keys per split at the least (block_attention_kernel.h, split_keys): 768 is a multiple of every ISA's key block (64
// on AVX2 and the default build, 96 on AVX-512) and of the GEMM path's (twice that). Each split adds a partial-state
// write (D + 2 floats per lane) and its merge, small next to attending 768 keys; a 1-2k context on 2 threads still
// gets 2-3 splits to share out (3 kv heads on 2 threads: 2 + 1 items alone is 67% busy).
constexpr int64_t kSplitKeys = 768;
}  // namespace

void block_attention_plan(BlockAttentionParams& p, int64_t /*threads: the plan does not depend on them*/) {
  int64_t max_valid = 0, max_end = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    max_valid = std::max(max_valid, p.valid(b));
    max_end = std::max(max_end, p.cache_len(b) + p.valid(b));
  }
  // Panels: the lanes of the longest sequence cut into near-equal panels of at most kMaxPanelLanes, each a
  // multiple of 16 lanes (the widest vector, AVX-512 fp32).
  const int64_t max_lanes = p.Hq / p.Hkv * max_valid;
  p.n_panels = std::max<int64_t>(1, (max_lanes + kMaxPanelLanes - 1) / kMaxPanelLanes);
  p.panel_lanes = std::max<int64_t>(16, ((max_lanes + p.n_panels - 1) / p.n_panels + 15) / 16 * 16);
  // Splits by absolute key position (flash decoding): split_keys depends on the cache's capacity S alone (at most
  // kMaxSplits of them cover it), never on the row count, the cache lengths or the thread count, so a row's splits
  // and its rounding are the same in any forward that holds it (batch invariance). The split count covers the
  // longest sequence's keys (cache + valid new rows); splits past a sequence's keys, or before its window, are
  // empty units that return at once.
  const int64_t per = (p.S + kMaxSplits - 1) / kMaxSplits;
  p.split_keys = std::max<int64_t>(kSplitKeys, (per + kSplitKeys - 1) / kSplitKeys * kSplitKeys);
  p.n_splits = std::clamp<int64_t>((max_end + p.split_keys - 1) / p.split_keys, 1, kMaxSplits);
  p.partials = nullptr;
}

}  // namespace sbd_cpu
