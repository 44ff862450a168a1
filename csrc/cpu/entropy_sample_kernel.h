// CPU kernel of entropy_sample on raw pointers (no torch headers); see entropy_sample_kernel.cpp.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "sbd/entropy_state.h"

namespace sbd_cpu {

enum class LogitsDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct EntropySampleParams {
  const void* logits;  // [N, V], unit stride along V
  int64_t row_stride;  // elements
  int64_t N, V;
  LogitsDtype dtype;
  float temperature;  // 0: argmax
  uint64_t seed, offset;
};

// Vocabulary chunk of one work item. Fixed (not derived from the thread count) so that results, including the
// rounding of the merged statistics, do not depend on how many threads run: 16k fp32 logits = 64 KB, about
// an L2 share per core, and 128256 / 16384 = 8 chunks per row keeps 2..64 cores busy even for one row.
constexpr int64_t kVocabChunk = 16384;

// Statistics and best candidate of row `row` over vocabulary entries [j0, j1). When sampling, `floor` is the exact
// score and index of an entry of the same row seen before (empty if none): the best candidate returned is the best
// of the chunk's entries and the floor's, and a higher floor only means less work (entries strictly below it are
// skipped), never a different token.
SBD_CPU_DECLARE_KERNEL(void, entropy_sample_chunk, const EntropySampleParams& p, int64_t row, int64_t j0, int64_t j1,
                       sbd::ArgmaxState floor, sbd::EntropyState* state, sbd::ArgmaxState* best)

}  // namespace sbd_cpu
