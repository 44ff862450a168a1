// CPU kernel of block_attention on raw pointers (no torch headers); see block_attention_kernel.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "cpu/isa.h"
#include "sbd/block_attention_params.h"

namespace sbd_cpu {

enum class AttnDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The shared problem description (sbd/block_attention_params.h: pointers, sizes, strides, scale, lengths; on
// the CPU the lengths are host copies the binding has validated) plus the CPU's work plan.
struct BlockAttentionParams : sbd::BlockAttentionParams {
  AttnDtype dtype;
  // The matrix products: false, the micro-kernel of this file's ISA variant (fp32 FMAs); true, ATen's cpublas
  // GEMM on the input type (bf16 / fp16: oneDNN on the CPU's matrix units where it has them). Chosen by the
  // binding (block_attention_use_gemm); both give the same work decomposition and the same partial states.
  bool gemm = false;
  // bf16 on the AMX-BF16 tiles (block_attention_tiles.h) where not OFF: HW the tiles, EMULATE their C++ model (the
  // tests' way on any AVX512-VNNI CPU). Set by the binding for bf16 in the AVX-512 variant only; gemm is then false.
  Amx tiles = Amx::OFF;

  // Work decomposition, chosen by block_attention_plan below.
  // A work item is (b, kv head, panel): the g = Hq / Hkv query heads of that kv head times the valid new rows,
  // packed as g * n_valid[b] query rows ("lanes", head-major), cut into panels of panel_lanes lanes. Each item is
  // further cut into n_splits ranges of key positions (flash-decoding); split s of an item is unit
  // (item * n_splits + s). With n_splits > 1 every unit writes a partial state to `partials` and
  // block_attention_merge combines them.
  int64_t panel_lanes;
  int64_t n_panels;
  int64_t n_splits;
  // Keys per split, by absolute position (split s: positions [s * split_keys, (s + 1) * split_keys); the last split
  // takes the rest): a multiple of every block size, and a function of the cache's capacity S alone, so a row's
  // splits -- and its result -- do not depend on the row count, the cache length or the thread count.
  int64_t split_keys;
  float* partials;  // n_items * n_splits * partial_floats(), when n_splits > 1

  int64_t n_items() const { return B * Hkv * n_panels; }
  int64_t n_units() const { return n_items() * n_splits; }
  // One partial: acc^T [D][panel_lanes], then m [panel_lanes] and l [panel_lanes].
  int64_t partial_floats() const { return (D + 2) * panel_lanes; }
};

// The binding's choice of BlockAttentionParams::gemm for an input type (block_attention_cpu.cpp):
// set_block_attention_matmul("auto") -- the default -- takes the GEMM path for bf16 on CPUs with AMX-BF16 and for
// fp16 on CPUs with AMX-FP16 (oneDNN's matrix tiles), the micro-kernel otherwise (AVX512-BF16 without AMX included:
// measured faster there, block_attention_cpu.cpp); bf16 takes the tiles path before both where it is on
// (block_attention_tiles below). "vector" / "gemm" force one path for every type (the tests run both everywhere: on a
// CPU without the units the GEMM path is ATen's reference loops, slow but the same calls).
bool block_attention_use_gemm(AttnDtype dtype);
void set_block_attention_matmul(const std::string& name);
std::string block_attention_matmul();
// How bf16 runs on the AMX-BF16 tiles under the current setting ("auto" and "tiles": bf16_tiles_mode(); OFF for
// other types and under "vector" / "gemm"); the binding also needs D % 32 == 0 and K / V rows that are matrices.
Amx block_attention_tiles(AttnDtype dtype);
// Calls of the CPU binding per path taken, (vector, gemm, tiles) = paths 0, 1, 2, since the process started (tests
// check the choice).
void count_block_attention_path(int path);
std::tuple<int64_t, int64_t, int64_t> block_attention_path_counts();
// Whether the automatic choice takes the GEMM path for bf16 / fp16 here.
bool cpu_has_bf16_matmul();
bool cpu_has_fp16_matmul();

// Cache splits are capped so that the merge keeps one scale per split on the stack.
constexpr int64_t kMaxSplits = 64;

// Fills panel_lanes, n_panels and n_splits for `threads` worker threads (block_attention_plan.cpp). The lengths
// must be valid; `partials` is left for the caller to allocate (n_units() * partial_floats() floats when
// n_splits > 1).
void block_attention_plan(BlockAttentionParams& p, int64_t threads);

// Run units taken one at a time from `next` (shared by the threads; units are taken while next < n_units()):
// attention of each unit's lanes over its share of the keys and the zero rows of padding (split 0 of panel 0 of each
// (b, kv head)). The committed rows' K/V must be in the cache already (the binding appends them first: the units
// read them from there). With n_splits == 1 the output rows are final;
// otherwise the unit writes its partial state. Units are independent, so the order does not change the result.
SBD_CPU_DECLARE_KERNEL(void, block_attention_units, const BlockAttentionParams& p, std::atomic<int64_t>& next)

// With n_splits > 1: merge the partial states of items [i0, i1) and write their output rows.
SBD_CPU_DECLARE_KERNEL(void, block_attention_merge, const BlockAttentionParams& p, int64_t i0, int64_t i1)

}  // namespace sbd_cpu
