// entropy_sample on the CPU: checks (entropy_sample_checks.h, shared with the CUDA binding), the work split over
// (row, vocabulary chunk), and the merge of chunk states.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/entropy_sample_kernel.h"
#include "cpu/op_clock.h"
#include "entropy_sample_checks.h"

namespace sbd_ext {

std::tuple<at::Tensor, at::Tensor, at::Tensor> entropy_sample_cpu(const at::Tensor& logits, double temperature,
                                                                  int64_t seed, int64_t offset) {
  const OpClock clock(Clocked::kEntropySample);
  check_entropy_sample(logits, temperature);
  const int64_t N = logits.size(0), V = logits.size(1);
  auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor entropy = at::empty({N}, f32), max_prob = at::empty({N}, f32);
  at::Tensor token = at::empty({N}, logits.options().dtype(at::kLong));
  if (N == 0) return {entropy, max_prob, token};

  sbd_cpu::EntropySampleParams p;
  p.logits = logits.data_ptr();
  p.row_stride = logits.stride(0);
  p.N = N;
  p.V = V;
  p.dtype = logits.scalar_type() == at::kFloat      ? sbd_cpu::LogitsDtype::kFloat32
            : logits.scalar_type() == at::kBFloat16 ? sbd_cpu::LogitsDtype::kBFloat16
                                                     : sbd_cpu::LogitsDtype::kFloat16;
  p.temperature = kernel_temperature(temperature);
  p.seed = static_cast<uint64_t>(seed);
  p.offset = static_cast<uint64_t>(offset);

  const int64_t chunks = (V + sbd_cpu::kVocabChunk - 1) / sbd_cpu::kVocabChunk;
  std::vector<sbd::EntropyState> states(static_cast<size_t>(N * chunks));
  std::vector<sbd::ArgmaxState> bests(static_cast<size_t>(N * chunks));
  at::parallel_for(0, N * chunks, 1, [&](int64_t i0, int64_t i1) {
    // When sampling, a chunk starts from the best candidate of the row's chunks this thread has done before it (a
    // floor): fewer draws where the row's best is high, the same token (the merge below takes the best of all).
    sbd::ArgmaxState floor = sbd::ArgmaxState::empty();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / chunks, c = i % chunks;
      const int64_t j0 = c * sbd_cpu::kVocabChunk, j1 = std::min(V, j0 + sbd_cpu::kVocabChunk);
      if (c == 0) floor = sbd::ArgmaxState::empty();
      SBD_CPU_DISPATCH(entropy_sample_chunk, p, row, j0, j1, floor, &states[i], &bests[i]);
      floor = bests[i];
    }
  });

  float* ent = entropy.data_ptr<float>();
  float* pmax = max_prob.data_ptr<float>();
  int64_t* tok = token.data_ptr<int64_t>();
  for (int64_t row = 0; row < N; ++row) {  // merge in chunk order: deterministic whatever the thread count
    sbd::EntropyState st = states[row * chunks];
    sbd::ArgmaxState am = bests[row * chunks];
    for (int64_t c = 1; c < chunks; ++c) {
      st.merge(states[row * chunks + c]);
      am.merge(bests[row * chunks + c]);
    }
    ent[row] = st.entropy();
    pmax[row] = st.max_prob();
    // A valid row whose scores are all -inf (finite logits so negative that x / T underflows) has no argmax by
    // strict comparison; torch.argmax returns the first index then, and so do this and the CUDA kernel.
    tok[row] = !st.ok() ? -1 : (am.index < 0 ? 0 : am.index);
  }
  return {entropy, max_prob, token};
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("entropy_sample", &entropy_sample_cpu); }

}  // namespace sbd_ext
