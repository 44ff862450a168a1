// mask_replace on the CPU: one sequence per task, the shared acceptance predicate (sbd/accept.h) evaluated for
// every position before any token is written.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/op_clock.h"
#include "mask_replace_checks.h"
#include "sbd/accept.h"

namespace sbd_ext {

std::tuple<at::Tensor, at::Tensor> mask_replace_cpu(at::Tensor tokens, const at::Tensor& proposals,
                                                    const at::Tensor& entropy, const at::Tensor& max_prob,
                                                    int64_t mask_id, c10::string_view rule_name, double threshold) {
  const OpClock clock(Clocked::kMaskReplace);
  const sbd::AcceptRule rule = parse_accept_rule(std::string(rule_name));
  check_mask_replace(tokens, proposals, entropy, max_prob, rule, threshold);
  const int64_t B = tokens.size(0), K = tokens.size(1);
  auto n_rev = at::zeros({B}, tokens.options());
  auto n_rem = at::zeros({B}, tokens.options());
  int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* prop = proposals.data_ptr<int64_t>();
  const float* ent = entropy.data_ptr<float>();
  const float* conf = max_prob.data_ptr<float>();
  int64_t* rev_out = n_rev.data_ptr<int64_t>();
  int64_t* rem_out = n_rem.data_ptr<int64_t>();
  // A block is a few dozen positions: parallelise over sequences only once there are many of them.
  at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> reveal(static_cast<size_t>(K));
    for (int64_t b = b0; b < b1; ++b) {
      sbd::AcceptView v{tok + b * tokens.stride(0),
                        prop + b * proposals.stride(0),
                        ent + b * entropy.stride(0),
                        conf + b * max_prob.stride(0),
                        tokens.stride(1),
                        proposals.stride(1),
                        entropy.stride(1),
                        max_prob.stride(1),
                        K,
                        mask_id};
      int64_t masked = 0, revealed = 0;
      for (int64_t i = 0; i < K; ++i) {
        masked += v.tokens[i * v.tok_stride] == mask_id;
        reveal[i] = sbd::accept_reveal(v, rule, threshold, i);
      }
      int64_t* row = tok + b * tokens.stride(0);
      for (int64_t i = 0; i < K; ++i) {
        if (reveal[i]) {
          row[i * tokens.stride(1)] = v.proposals[i * v.prop_stride];
          ++revealed;
        }
      }
      rev_out[b] = revealed;
      rem_out[b] = masked - revealed;
    }
  });
  return {n_rev, n_rem};
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("mask_replace", &mask_replace_cpu); }

}  // namespace sbd_ext
