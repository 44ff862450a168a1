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
// Shortest cache split: each split adds a partial-state write (D + 2 floats per lane) and its merge, small next
// to attending 256 cache rows.
constexpr int64_t kMinSplitRows = 256;

}  // namespace

void block_attention_plan(BlockAttentionParams& p, int64_t threads) {
  int64_t max_valid = 0, max_len = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    max_valid = std::max(max_valid, p.valid(b));
    const int64_t len = p.cache_len(b);
    max_len = std::max(max_len, len - p.first_cache_row(len));  // the rows a sliding window leaves to read
  }
  // Panels: the lanes of the longest sequence cut into near-equal panels of at most kMaxPanelLanes, each a
  // multiple of 16 lanes (the widest vector, AVX-512 fp32).
  const int64_t max_lanes = p.Hq / p.Hkv * max_valid;
  p.n_panels = std::max<int64_t>(1, (max_lanes + kMaxPanelLanes - 1) / kMaxPanelLanes);
  p.panel_lanes = std::max<int64_t>(16, ((max_lanes + p.n_panels - 1) / p.n_panels + 15) / 16 * 16);
  // Cache splits (flash decoding) when the items alone would leave threads idle: fewer items than threads (batch 1
  // with few kv heads), or a few items that do not divide evenly (3 kv heads on 2 threads: 2 + 1 items is 67%
  // busy, 2 splits make 3 + 3 units). The split count depends on the thread count, so the rounding of the
  // result does too (within fp32 noise).
  threads = std::max<int64_t>(threads, 1);
  const int64_t items = p.n_items();
  const int64_t max_splits = std::clamp<int64_t>(max_len / kMinSplitRows, 1, kMaxSplits);
  p.n_splits = 1;
  while (p.n_splits < max_splits && (items * p.n_splits) % threads != 0 && items * p.n_splits < 4 * threads)
    ++p.n_splits;
  p.partials = nullptr;
}

}  // namespace sbd_cpu
