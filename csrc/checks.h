// Argument checks at the torch boundary, shared by the CPU and CUDA bindings of every op.
// Every message names the op and the argument and says what was expected, so bad input is a clear Python
// RuntimeError rather than a crash or an out-of-bounds read.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <numeric>
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

// An undefined tensor is what a None reaches the op as (through torch.ops, past the Python wrappers).
inline void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", name, " must be a tensor, got None");
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> ok) {
  check_defined(op, name, t);
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
  check_defined(op, name, t);
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

// ---- sizes computed from user values -------------------------------------------------------------------------
// A product of sizes, or an error naming `what` when it does not fit in int64 (a read-only input may be an
// expanded view whose sizes are far larger than its memory, so products of its sizes can overflow).
inline int64_t checked_mul(const char* op, const char* what, std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors) {
    TORCH_CHECK_VALUE(f >= 0, op, ": ", what, " has a negative factor ", f);
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(r, f, &r), op, ": ", what, " overflows int64");
  }
  return r;
}

// A size that a kernel indexes with 32-bit integers.
inline void check_fits_int32(const char* op, const char* what, int64_t value, const char* device_note = "") {
  TORCH_CHECK_VALUE(value >= 0 && value <= INT32_MAX, op, ": ", device_note, what, " must be at most 2^31 - 1, got ",
                    value);
}

// ---- memory overlap of mutated arguments --------------------------------------------------------------------
// An op that writes a tensor in place must not be given a tensor whose elements share memory (an expanded,
// stride-0 view: the writes of different rows land on one another) nor one that shares memory with another input
// (the writes change what the kernel is still reading). at::has_internal_overlap and at::get_overlap_status
// answer "too hard" for the usual non-dense views (a slice of a larger cache); for those these helpers use the
// stride structure, and refuse only what they cannot prove disjoint.

// Dimensions of size > 1 as (stride, size), by increasing stride.
inline std::vector<std::pair<int64_t, int64_t>> strided_dims(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> d;
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1) d.emplace_back(t.stride(i), t.size(i));
  std::sort(d.begin(), d.end());
  return d;
}

// Elements from the first to the last one of `t` (0 if empty).
inline int64_t element_span(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t span = 1;
  for (int64_t i = 0; i < t.dim(); ++i) span += (t.size(i) - 1) * t.stride(i);
  return span;
}

// True when every stride exceeds the reach of the smaller dimensions (sum of (size - 1) * stride): the elements
// are then distinct.
inline bool strides_nested(const std::vector<std::pair<int64_t, int64_t>>& d) {
  int64_t reach = 0;
  for (auto [stride, size] : d) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

// Whether delta = sum_i k_i stride_i for some |k_i| < size_i over dims [0, n) (sorted by increasing stride, with
// reach[i] the reach of dims below i): a depth-first search, largest stride first, over the few k_i that leave a
// remainder the smaller dims can still reach. Returns -1 ("don't know") when it exceeds its node budget.
inline int offset_reachable(const std::vector<std::pair<int64_t, int64_t>>& d, const std::vector<int64_t>& reach,
                            size_t n, int64_t delta, int& budget) {
  if (n == 0) return delta == 0;
  if (--budget < 0) return -1;
  const auto [stride, size] = d[n - 1];
  const int64_t r = reach[n - 1];
  // k with |delta - k * stride| <= r: k in [ceil((delta - r) / stride), floor((delta + r) / stride)].
  auto floor_div = [](int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); };
  const int64_t lo = std::max<int64_t>(-(size - 1), -floor_div(r - delta, stride));
  const int64_t hi = std::min<int64_t>(size - 1, floor_div(delta + r, stride));
  int result = 0;
  for (int64_t k = lo; k <= hi; ++k) {
    const int found = offset_reachable(d, reach, n - 1, delta - k * stride, budget);
    if (found == 1) return 1;
    if (found < 0) result = -1;
  }
  return result;
}

inline bool has_internal_overlap(const at::Tensor& t) {
  const at::MemOverlap o = at::has_internal_overlap(t);
  if (o != at::MemOverlap::TooHard) return o == at::MemOverlap::Yes;
  return !strides_nested(strided_dims(t));
}

inline void check_no_internal_overlap(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(!has_internal_overlap(t), op, ": ", name,
                    " is written in place but some of its elements share memory (an expanded or overlapping view, "
                    "strides ",
                    t.strides(), "); pass a tensor with distinct elements, e.g. ", name, ".clone()");
}

// Whether a and b may share memory. Two views of one shape and one set of strides (k_cache and v_cache
// interleaved in one buffer) are tested exactly; other intersecting address ranges count as shared.
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const at::MemOverlapStatus s = at::get_overlap_status(a, b);
  if (s == at::MemOverlapStatus::Full || s == at::MemOverlapStatus::Partial) return true;
  if (s == at::MemOverlapStatus::No) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto a0 = reinterpret_cast<intptr_t>(a.const_data_ptr()), b0 = reinterpret_cast<intptr_t>(b.const_data_ptr());
  const intptr_t a1 = a0 + element_span(a) * a.element_size(), b1 = b0 + element_span(b) * b.element_size();
  if (a1 <= b0 || b1 <= a0) return false;
  if (a.element_size() != b.element_size() || a.sizes() != b.sizes() || a.strides() != b.strides()) return true;
  if ((b0 - a0) % a.element_size() != 0) return true;
  const auto d = strided_dims(a);
  if (!d.empty() && d[0].first <= 0) return true;  // an expanded dimension: not worth solving
  std::vector<int64_t> reach;
  int64_t r = 0;
  for (auto [stride, size] : d) {
    reach.push_back(r);
    r += (size - 1) * stride;
  }
  int budget = 4096;
  return offset_reachable(d, reach, d.size(), (b0 - a0) / a.element_size(), budget) != 0;
}

inline void check_no_overlap(const char* op, const char* name, const at::Tensor& t, const char* other_name,
                             const at::Tensor& other) {
  TORCH_CHECK_VALUE(!may_overlap(t, other), op, ": ", name, " is written in place and shares memory with ",
                    other_name, "; pass tensors that do not overlap (e.g. ", other_name, ".clone())");
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
