// Argument checks of block_attention, shared by its CPU and CUDA bindings.
//
// check_block_attention validates everything that does not need the lengths' values (dtypes, shapes, devices,
// strides). check_block_attention_lengths validates the values (no negative length, n_commit <= n_valid <= T,
// no cache overflow) once they are on the host: the CUDA binding skips it for device lengths rather than
// synchronising with the GPU.
#pragma once

#include <cmath>
#include <utility>
#include <vector>

#include "checks.h"

namespace sbd_ext {

inline void check_block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_lens,
                                  const at::Tensor& n_commit, const at::Tensor& n_valid, double scale) {
  constexpr const char* op = "block_attention";
  check_dtype(op, "q", q, {at::kFloat, at::kBFloat16, at::kHalf});
  check_dim(op, "q", q, 4, "[B, Hq, T, D]");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(D > 0, op, ": q must have a non-empty head dimension D, got shape ", q.sizes());
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"k", k}, {"v", v}}) {
    check_same_dtype(op, name, t, q, "q");
    check_dim(op, name, t, 4, "[B, Hkv, T, D]");
    check_size(op, name, t, 0, B, "q.size(0) (B)");
    check_size(op, name, t, 2, T, "q.size(2) (T)");
    check_size(op, name, t, 3, D, "q.size(3) (D)");
  }
  const int64_t Hkv = k.size(1);
  check_size(op, "v", v, 1, Hkv, "k.size(1) (Hkv)");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, op, ": the number of query heads q.size(1) = ", Hq,
                    " must be a multiple of the number of kv heads k.size(1) = ", Hkv, " (GQA)");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"k_cache", k_cache}, {"v_cache", v_cache}}) {
    check_same_dtype(op, name, t, q, "q");
    check_dim(op, name, t, 4, "[B, Hkv, S, D]");
    check_size(op, name, t, 0, B, "q.size(0) (B)");
    check_size(op, name, t, 1, Hkv, "k.size(1) (Hkv)");
    check_size(op, name, t, 3, D, "q.size(3) (D)");
  }
  check_size(op, "v_cache", v_cache, 2, k_cache.size(2), "k_cache.size(2) (S)");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q},
                         {"k", k},
                         {"v", v},
                         {"k_cache", k_cache},
                         {"v_cache", v_cache}}) {
    check_inner_contiguous(op, name, t);
    check_same_device(op, name, t, q, "q");
  }
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"cache_lens", cache_lens},
                         {"n_commit", n_commit},
                         {"n_valid", n_valid}}) {
    check_lengths(op, name, t, B);
    check_same_device(op, name, t, q, "q");
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
}

// The lengths' values, read on the host (host_lengths in checks.h).
inline void check_block_attention_lengths(const std::vector<int64_t>& lens, const std::vector<int64_t>& commit,
                                          const std::vector<int64_t>& valid, int64_t T, int64_t S) {
  constexpr const char* op = "block_attention";
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t pl = lens[b], pc = commit[b], pv = valid[b];
    TORCH_CHECK_VALUE(pl >= 0, op, ": cache_lens[", b, "] = ", pl, " is negative");
    TORCH_CHECK_VALUE(pc >= 0, op, ": n_commit[", b, "] = ", pc, " is negative");
    TORCH_CHECK_VALUE(pv >= 0, op, ": n_valid[", b, "] = ", pv, " is negative");
    TORCH_CHECK_VALUE(pv <= T, op, ": n_valid[", b, "] = ", pv, " exceeds the number of new rows T = ", T);
    TORCH_CHECK_VALUE(pc <= pv, op, ": n_commit[", b, "] = ", pc, " exceeds n_valid[", b, "] = ", pv,
                      " (expected n_commit <= n_valid <= T)");
    TORCH_CHECK_VALUE(pl + pc <= S, op, ": cache overflow for sequence ", b, ": cache_lens[", b, "] + n_commit[", b,
                      "] = ", pl, " + ", pc, " exceeds the cache size k_cache.size(2) = ", S);
  }
}

}  // namespace sbd_ext
