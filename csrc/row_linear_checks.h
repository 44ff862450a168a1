// Argument checks of row_linear, shared by its CPU and CUDA bindings.
#pragma once

#include <optional>
#include <utility>

#include "checks.h"

namespace sbd_ext {

// An fp32 or bf16 weight [N / 16, K, 16]: packed in panels of 16 rows (any other rank-3 weight is refused as not
// 2-D).
inline bool row_linear_is_packed(const at::Tensor& weight) {
  return weight.dim() == 3 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
         weight.size(2) == 16;
}

// An int8 weight packed in panels for int8 x (sbd_ext.packing.pack_row_linear_int8): uint8 [N / 16, K / 4, 16, 4]
// (q + 128, K padded to a multiple of 32).
inline bool row_linear_is_q8_packed(const at::Tensor& weight) {
  return weight.dim() == 4 && weight.scalar_type() == at::kByte;
}

// A bf16 weight in tiles (sbd_ext.packing.pack_row_linear_weight(..., tiles=True)): bf16 [N / 16, ceil(K / 32), 16, 32]
// (K padded with zeros to whole blocks of 32), multiplied with x rounded to bf16.
inline bool row_linear_is_bf16_tiles(const at::Tensor& weight) {
  return weight.dim() == 4 && weight.scalar_type() == at::kBFloat16;
}

// A bf16 tiles weight's shape against x's K (the binding's and gated_lora_linear's check).
inline void check_bf16_tiles(const char* op, const at::Tensor& weight, int64_t K) {
  const char* what = "(a bf16 weight in tiles is [N / 16, ceil(K / 32), 16, 32])";
  check_size(op, "weight", weight, 2, 16, what);
  check_size(op, "weight", weight, 3, 32, what);
  check_size(op, "weight", weight, 1, (K + 31) / 32, "ceil(x.size(1) / 32) (K in blocks of 32)");
  TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": a bf16 weight in tiles must be contiguous, got strides ",
                    weight.strides());
  checked_mul(op, "the packed weight's rows N / 16 * 16", {weight.size(0), 16});
}

// Output rows N of a row_linear weight: [N, K], or a packed fp32 / bf16 weight [N / 16, K, 16] (16 N / 16).
inline int64_t row_linear_out_features(const at::Tensor& weight) {
  return row_linear_is_packed(weight) || row_linear_is_q8_packed(weight) || row_linear_is_bf16_tiles(weight)
             ? weight.size(0) * weight.size(2)
             : weight.size(0);
}

// x [M, K] fp32 and weight [N, K] on one device, each contiguous along K, and M * N (the output's size) within
// int64. weight is fp32 with no scale, or int8 (weight-only quantisation) with scale [N] fp32 (one per weight row),
// contiguous, on the same device, or fp32 / bf16 packed in panels of 16 rows (sbd_ext.packing): [N / 16, K, 16],
// contiguous, no scale. quantize_x (x quantised to int8 per block of 32 at run time) needs the int8 weight.
inline void check_row_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                             bool quantize_x) {
  constexpr const char* op = "row_linear";
  check_dtype(op, "x", x, {at::kFloat, at::kBFloat16});
  check_dtype(op, "weight", weight, {at::kFloat, at::kChar, at::kByte, at::kBFloat16});
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16, op,
                   ": bf16 x goes with a bf16 weight (a bf16 layer); weight has dtype ", weight.scalar_type(),
                   " (pass x in fp32)");
  check_dim(op, "x", x, 2, "[M, K]");
  const bool q8_packed = weight.scalar_type() == at::kByte;
  if (q8_packed) {  // sbd_ext.packing.pack_row_linear_int8
    check_dim(op, "weight", weight, 4, "(a packed int8 weight: uint8 [N / 16, ceil(K / 32) * 8, 16, 4])");
    check_size(op, "weight", weight, 2, 16, "16 (a packed int8 weight is [N / 16, ceil(K / 32) * 8, 16, 4])");
    check_size(op, "weight", weight, 3, 4, "4 (a packed int8 weight is [N / 16, ceil(K / 32) * 8, 16, 4])");
    check_size(op, "weight", weight, 1, (x.size(1) + 31) / 32 * 8, "ceil(x.size(1) / 32) * 8 (K in blocks of 32)");
    TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": a packed int8 weight must be contiguous, got strides ",
                      weight.strides());
    TORCH_CHECK_VALUE(quantize_x, op, ": a packed int8 weight (uint8 [N / 16, K / 4, 16, 4]) multiplies int8 x: ",
                      "pass quantize_x=True");
    checked_mul(op, "the packed weight's rows N / 16 * 16", {weight.size(0), weight.size(2)});
  } else if (row_linear_is_bf16_tiles(weight)) {
    check_bf16_tiles(op, weight, x.size(1));
  } else if (row_linear_is_packed(weight)) {  // sbd_ext.packing.pack_row_linear_weight
    check_size(op, "weight", weight, 1, x.size(1), "x.size(1) (K)");
    TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": a packed weight [N / 16, K, 16] must be contiguous, got strides ",
                      weight.strides());
    checked_mul(op, "the packed weight's rows N / 16 * 16", {weight.size(0), weight.size(2)});
  } else {
    check_dim(op, "weight", weight, 2, "[N, K] (or fp32 / bf16 packed: [N / 16, K, 16]; bf16 in tiles: 4-D)");
    check_size(op, "weight", weight, 1, x.size(1), "x.size(1) (K)");
  }
  check_same_device(op, "weight", weight, x, "x");
  check_inner_contiguous(op, "x", x);
  check_inner_contiguous(op, "weight", weight);
  const bool has_scale = scale.has_value() && scale->defined();
  if (weight.scalar_type() == at::kChar || q8_packed) {
    TORCH_CHECK_VALUE(has_scale, op, ": an int8 weight needs scale [N] fp32 (one scale per weight row), got None");
    const at::Tensor& s = *scale;
    check_dtype(op, "scale", s, {at::kFloat});
    check_dim(op, "scale", s, 1, "[N]");
    check_size(op, "scale", s, 0, row_linear_out_features(weight),
               q8_packed ? "16 * weight.size(0) (N)" : "weight.size(0) (N)");
    check_same_device(op, "scale", s, x, "x");
    check_inner_contiguous(op, "scale", s);
  } else {
    TORCH_CHECK_VALUE(!has_scale, op, ": scale is for an int8 weight; weight has dtype ", weight.scalar_type(),
                      " (pass scale=None)");
  }
  TORCH_CHECK_VALUE(!quantize_x || weight.scalar_type() == at::kChar || q8_packed, op,
                    ": quantize_x=True multiplies int8 x with an int8 weight; weight has dtype ", weight.scalar_type(),
                    " (quantise the weight, or pass quantize_x=False)");
  checked_mul(op, "the output size M * N", {x.size(0), row_linear_out_features(weight)});
}

// gated_lora_linear (the CPU binding; no other device has it): x [M, K] fp32; weight fp32 or bf16 packed [P, K, 16]
// holding the base's N = 16 * lora_b.size(0) rows, then the adapter's r = lora_b.size(1) A rows (P * 16 >= N + r);
// lora_b fp32 or bf16 packed [N / 16, r, 16] (bf16: its values widened, the fp32 panels' sums); gate fp32 [M]; every
// tensor on x's device, weight, lora_b and gate contiguous, x contiguous along K.
inline void check_gated_lora_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_b,
                                    const at::Tensor& gate, const std::optional<at::Tensor>& scale = std::nullopt,
                                    at::IntArrayRef segments = {}) {
  constexpr const char* op = "gated_lora_linear";
  check_dtype(op, "x", x, {at::kFloat});
  check_dtype(op, "weight", weight, {at::kFloat, at::kBFloat16, at::kByte});
  check_dtype(op, "lora_b", lora_b, {at::kFloat, at::kBFloat16});
  check_dtype(op, "gate", gate, {at::kFloat});
  const bool q8 = weight.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(q8 == scale.has_value(), op, q8 ? ": a packed int8 [W; A] (uint8) needs its scale [P * 16]"
                                                     : ": scale is for a packed int8 [W; A] (uint8); weight has dtype ",
                    weight.scalar_type());
  check_dim(op, "x", x, 2, "[M, K]");
  if (q8) {  // [W; A] int8 in row_linear's packed int8 layout, one scale per row; x is quantised per block of 32
    check_dim(op, "weight", weight, 4, "(packed int8 [W; A]: uint8 [P, ceil(K / 32) * 8, 16, 4])");
    check_size(op, "weight", weight, 1, (x.size(1) + 31) / 32 * 8, "ceil(x.size(1) / 32) * 8 (K in blocks of 32)");
    check_size(op, "weight", weight, 3, 4, "4 (a packed int8 weight is [P, ceil(K / 32) * 8, 16, 4])");
    check_dtype(op, "scale", *scale, {at::kFloat});
    check_dim(op, "scale", *scale, 1, "[P * 16]");
    check_size(op, "scale", *scale, 0, checked_mul(op, "the packed weight's rows P * 16", {weight.size(0), 16}),
               "16 * weight.size(0) (P * 16)");
    TORCH_CHECK_VALUE(scale->is_contiguous(), op, ": scale must be contiguous");
    check_same_device(op, "scale", *scale, x, "x");
  } else if (row_linear_is_bf16_tiles(weight)) {  // [W; A] bf16 in tiles: x rounded to bf16 once for W and A
    check_bf16_tiles(op, weight, x.size(1));
  } else {
    check_dim(op, "weight", weight, 3, "(packed [W; A]: [P, K, 16])");
    check_size(op, "weight", weight, 1, x.size(1), "x.size(1) (K)");
  }
  check_dim(op, "lora_b", lora_b, 3, "(packed scale * B: [N / 16, r, 16])");
  check_dim(op, "gate", gate, 1, "[M]");
  check_size(op, "weight", weight, 2, 16, "16 (a packed weight's panels hold 16 rows)");
  check_size(op, "lora_b", lora_b, 2, 16, "16 (a packed lora_b is [N / 16, r, 16])");
  check_size(op, "gate", gate, 0, x.size(0), "x.size(0) (M)");
  TORCH_CHECK_VALUE(lora_b.size(0) >= 1 && lora_b.size(1) >= 1, op,
                    ": lora_b must hold at least one panel and rank r >= 1, got shape ", lora_b.sizes());
  const int64_t n = checked_mul(op, "the output features 16 * lora_b.size(0)", {lora_b.size(0), 16});
  const int64_t a_panels = (lora_b.size(1) + 15) / 16;
  TORCH_CHECK_VALUE(weight.size(0) - lora_b.size(0) >= a_panels, op, ": weight must hold the base's ",
                    lora_b.size(0), " panels (N = ", n, ") and ", a_panels, " panel(s) of A's ", lora_b.size(1),
                    " rows, got shape ", weight.sizes());
  if (!segments.empty()) {  // S projections' [W_i; A_i] one after another, their B' likewise (same r)
    int64_t total = 0;
    for (const int64_t s : segments) {
      TORCH_CHECK_VALUE(s >= 16 && s % 16 == 0 && s <= n, op,
                        ": each of segments (a projection's outputs N_i) must be a positive multiple of 16 up to ", n,
                        ", got ", segments);
      total += s;  // each <= n: no overflow
      TORCH_CHECK_VALUE(total <= n, op, ": segments must sum to N = 16 * lora_b.size(0) = ", n, ", got ", segments);
    }
    const int64_t panels = lora_b.size(0) + checked_mul(op, "the A panels", {a_panels, int64_t(segments.size())});
    TORCH_CHECK_VALUE(total == n && weight.size(0) == panels, op, ": segments ", segments, " must sum to N = ", n,
                      " and weight hold their [W_i; A_i]: ", panels, " panels, got shape ", weight.sizes());
  }
  const std::pair<const char*, const at::Tensor*> dense[] = {{"weight", &weight}, {"lora_b", &lora_b}, {"gate", &gate}};
  for (const auto& [name, t] : dense)
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous, got shape ", t->sizes(), " and strides ",
                      t->strides(), " (call .contiguous())");
  check_same_device(op, "weight", weight, x, "x");
  check_same_device(op, "lora_b", lora_b, x, "x");
  check_same_device(op, "gate", gate, x, "x");
  check_inner_contiguous(op, "x", x);
  checked_mul(op, "the output size M * N", {x.size(0), n});
  checked_mul(op, "the packed weight's rows P * 16", {weight.size(0), 16});
}

}  // namespace sbd_ext
