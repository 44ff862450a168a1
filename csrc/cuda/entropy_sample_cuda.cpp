// entropy_sample, CUDA binding: argument checks (entropy_sample_checks.h, shared with the CPU binding), device guard
// and stream, the work split and its workspace, dtype dispatch to the raw-pointer launchers of
// csrc/cuda/kernels/entropy_sample.h. No host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/binding_utils.h"
#include "cuda/kernels/device_info.h"
#include "cuda/kernels/entropy_sample.h"
#include "entropy_sample_checks.h"

namespace sbd_ext {

std::tuple<at::Tensor, at::Tensor, at::Tensor> entropy_sample_cuda(const at::Tensor& logits, double temperature,
                                                                   int64_t seed, int64_t offset) {
  constexpr const char* op = "entropy_sample";
  check_entropy_sample(logits, temperature);  // everything the CPU binding checks
  TORCH_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor here, got device ", logits.device());
  const int64_t N = logits.size(0), V = logits.size(1);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  auto f32 = logits.options().dtype(at::kFloat);
  auto entropy = at::empty({N}, f32);
  auto max_prob = at::empty({N}, f32);
  auto token = at::empty({N}, logits.options().dtype(at::kLong));
  if (N == 0) return {entropy, max_prob, token};

  sbd_cuda::EntropySampleParams p{};
  p.logits = logits.data_ptr();
  p.entropy = entropy.data_ptr<float>();
  p.max_prob = max_prob.data_ptr<float>();
  p.token = token.data_ptr<int64_t>();
  p.N = N;
  p.V = V;
  p.row_stride = logits.stride(0);
  p.temperature = kernel_temperature(temperature);
  p.seed = static_cast<uint64_t>(seed);  // the same 64 bits the reference masks with 2^64 - 1
  p.offset = static_cast<uint64_t>(offset);
  sbd_cuda::entropy_sample_plan(p, sbd_cuda::sm_count());
  TORCH_CHECK_VALUE(N * p.splits <= 0x7fffffff, op, ": too many rows for one launch (N = ", N, ")");
  at::Tensor workspace;
  const size_t ws_bytes = sbd_cuda::entropy_sample_workspace_bytes(p);
  if (ws_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(op, logits.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    C10_CUDA_CHECK(sbd_cuda::launch_entropy_sample<scalar_t>(p, stream));
  });
  return {entropy, max_prob, token};
}

TORCH_LIBRARY_IMPL(sbd_ext, CUDA, m) { m.impl("entropy_sample", &entropy_sample_cuda); }

}  // namespace sbd_ext
