// topk_logsumexp on the CPU: the checks and one row per work item (cpu/topk_logsumexp_kernel.cpp). CPU only: the
// Python wrapper (sbd_ext.ops.topk_logsumexp) gives other devices torch.topk and torch.logsumexp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/op_clock.h"
#include "cpu/topk_logsumexp_kernel.h"

namespace sbd_ext {

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_logsumexp_cpu(const at::Tensor& x, int64_t k) {
  const OpClock clock(Clocked::kTopkLogsumexp);
  constexpr const char* op = "topk_logsumexp";
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [N, V], got ", x.dim(), " dimensions");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) == 0 || x.stride(1) == 1, op, ": x must be contiguous along V");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK_VALUE(k >= 0 && k <= V, op, ": k must be in [0, V = ", V, "], got ", k);
  at::Tensor values = at::empty({N, k}, x.options());
  at::Tensor indices = at::empty({N, k}, x.options().dtype(at::kLong));
  at::Tensor lse = at::empty({N}, x.options());
  if (N == 0) return {values, indices, lse};
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      SBD_CPU_DISPATCH(topk_logsumexp_row, xp + r * stride, V, k, vp + r * k, ip + r * k, lp + r);
  });
  return {values, indices, lse};
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("topk_logsumexp", &topk_logsumexp_cpu); }

}  // namespace sbd_ext
