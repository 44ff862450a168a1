// Argument checks at the torch boundary, shared by the CPU and CUDA bindings of every op.
// Every message names the op and the argument and says what was expected, so bad input is a clear Python
// RuntimeError rather than a crash or an out-of-bounds read.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#include <initializer_list>
#include <string>
#include <vector>

namespace sbd_ext {

inline std::string dtype_list(std::initializer_list<at::ScalarType> ok) {
  std::string s;
  for (auto t : ok) {
    if (!s.empty()) s += ", ";
    s += c10::toString(t);
  }
  return s;
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> ok) {
  for (auto d : ok)
    if (t.scalar_type() == d) return;
  TORCH_CHECK_TYPE(false, op, ": ", name, " must have dtype ", dtype_list(ok), ", got ", t.scalar_type());
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t ndim, const char* shape) {
  TORCH_CHECK_VALUE(t.dim() == ndim, op, ": ", name, " must be ", ndim, "-D ", shape, ", got shape ", t.sizes());
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim, int64_t expected,
                       const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, op, ": ", name, ".size(", dim, ") must equal ", what, " = ", expected,
                    ", got shape ", t.sizes());
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; all tensors must be on the same device");
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the same dtype as ", ref_name,
                   " (", ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_inner_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                    " must be contiguous in its last dimension (stride 1), got strides ", t.strides());
}

inline void check_lengths(const char* op, const char* name, const at::Tensor& t, int64_t B) {
  check_dtype(op, name, t, {at::kInt, at::kLong});
  check_dim(op, name, t, 1, "[B]");
  check_size(op, name, t, 0, B, "the batch size B");
}

// The values of a 1-D int32 / int64 host tensor (any stride), read without creating tensors: the lengths of an op
// that runs once per layer per decoding step, where a few tensor ops would be a visible share of the call.
inline std::vector<int64_t> host_lengths(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1, "host_lengths: expected a 1-D CPU tensor");
  std::vector<int64_t> out(static_cast<size_t>(t.size(0)));
  const int64_t st = t.stride(0);
  if (t.scalar_type() == at::kInt) {
    const int32_t* p = t.const_data_ptr<int32_t>();
    for (int64_t i = 0; i < t.size(0); ++i) out[i] = p[i * st];
  } else {
    TORCH_CHECK(t.scalar_type() == at::kLong, "host_lengths: expected int32 or int64, got ", t.scalar_type());
    const int64_t* p = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t.size(0); ++i) out[i] = p[i * st];
  }
  return out;
}

}  // namespace sbd_ext
