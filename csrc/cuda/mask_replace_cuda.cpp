// mask_replace, CUDA binding: argument checks, device guard and stream, then the raw-pointer launcher of
// csrc/cuda/kernels/mask_replace.h. No host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "cuda/kernels/mask_replace.h"
#include "mask_replace_checks.h"

namespace sbd_ext {

std::tuple<at::Tensor, at::Tensor> mask_replace_cuda(at::Tensor tokens, const at::Tensor& proposals,
                                                     const at::Tensor& entropy, const at::Tensor& max_prob,
                                                     int64_t mask_id, c10::string_view rule_name, double threshold) {
  const sbd::AcceptRule rule = parse_accept_rule(std::string(rule_name));
  check_mask_replace(tokens, proposals, entropy, max_prob, rule, threshold);
  TORCH_CHECK(tokens.is_cuda(), "mask_replace: tokens must be a CUDA tensor here, got device ", tokens.device());
  const int64_t B = tokens.size(0), K = tokens.size(1);
  TORCH_CHECK_VALUE(K <= sbd_cuda::kMaskReplaceMaxK, "mask_replace: on CUDA the block size K (tokens.size(1)) must be <= ",
                    sbd_cuda::kMaskReplaceMaxK, ", got ", K);
  TORCH_CHECK_VALUE(B <= 0x7fffffff, "mask_replace: on CUDA the batch size must be < 2^31, got ", B);
  const c10::cuda::CUDAGuard device_guard(tokens.device());
  auto n_rev = at::empty({B}, tokens.options());
  auto n_rem = at::empty({B}, tokens.options());
  sbd_cuda::MaskReplaceParams p{};
  p.tokens = tokens.data_ptr<int64_t>();
  p.proposals = proposals.data_ptr<int64_t>();
  p.entropy = entropy.data_ptr<float>();
  p.confidence = max_prob.data_ptr<float>();
  p.n_revealed = n_rev.data_ptr<int64_t>();
  p.n_remaining = n_rem.data_ptr<int64_t>();
  p.tok_sb = tokens.stride(0);
  p.tok_sk = tokens.stride(1);
  p.prop_sb = proposals.stride(0);
  p.prop_sk = proposals.stride(1);
  p.ent_sb = entropy.stride(0);
  p.ent_sk = entropy.stride(1);
  p.conf_sb = max_prob.stride(0);
  p.conf_sk = max_prob.stride(1);
  p.B = B;
  p.K = K;
  p.mask_id = mask_id;
  p.rule = rule;
  p.threshold = threshold;
  C10_CUDA_CHECK(sbd_cuda::launch_mask_replace(p, c10::cuda::getCurrentCUDAStream()));
  return {n_rev, n_rem};
}

TORCH_LIBRARY_IMPL(sbd_ext, CUDA, m) { m.impl("mask_replace", &mask_replace_cuda); }

}  // namespace sbd_ext
