// row_linear on the CPU: checks (row_linear_checks.h, shared with the CUDA binding) and the split of the weight
// rows into fixed chunks of kRowLinearChunk, one per task (the result does not depend on the thread count). With
// quantize_x, x is quantised once before the chunks run.
//
// Any row count: the kernel is for the few rows of a decoding forward (x stays in L2 while each weight tile passes
// over it). Past kRowLinearRows rows (a prefill) an fp32 weight goes to the framework's GEMM (at::mm, as F.linear:
// its blocking wins there, 1.2x at 128 rows on SmolLM2's shapes) and an int8 or packed weight runs the kernel on
// slices of kRowLinearRows rows (a packed weight has no [N, K] copy for at::mm). So a caller never branches on the row count -- under torch.compile such a branch on a dynamic
// row count is a guard, and each side of it a graph.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "cpu/aligned_buffer.h"
#include "cpu/op_clock.h"
#include "cpu/output_pool.h"
#include "cpu/row_linear_kernel.h"
#include "cpu/row_linear_write.h"
#include "row_linear_checks.h"

namespace sbd_ext {

namespace {

// Rows [0, M) of x (row stride x_stride, K values each) transposed into `t` as [K, M] (the packed kernel's x^T).
void transpose_rows(const float* x, int64_t x_stride, int64_t M, int64_t K, std::vector<float>& t) {
  const size_t need = static_cast<size_t>(K) * static_cast<size_t>(M);
  if (t.size() < need) t.resize(need);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) t[k * M + i] = x[i * x_stride + k];
}

// The quantised x's buffers of one call (and gated_lora_linear's [W; A] outputs, kLoraFull): this thread's scratch,
// 64-byte aligned (as at::empty's), kept between calls -- a decoding forward calls row_linear ~210 times, and an
// at::empty per buffer per call was ~630 of a SmolLM2 w8a8 forward's allocations. A buffer over kKeepBytes (a long
// prefill) is the call's own tensor instead, so a thread keeps no more than a few MB. The chunks get raw pointers
// (inside them the names are the worker's own).
class XScratch {
 public:
  enum Slot : int { kXq, kXd, kXq4, kXdt, kXct, kXqRows, kLoraFull, kSlots };
  template <typename T>
  T* get(Slot slot, int64_t n, at::ScalarType dtype) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
    if (bytes > kKeepBytes) {
      own_[slot] = at::empty({static_cast<int64_t>(bytes / sizeof(T))}, at::TensorOptions().dtype(dtype));
      return own_[slot].data_ptr<T>();
    }
    Kept& k = kept()[slot];
    if (k.bytes < bytes) {
      k.ptr = sbd_cpu::alloc_aligned<char>(static_cast<int64_t>(bytes));
      k.bytes = bytes;
    }
    return reinterpret_cast<T*>(k.ptr.get());
  }

 private:
  static constexpr size_t kKeepBytes = size_t{4} << 20;
  struct Kept {
    sbd_cpu::AlignedBuffer<char> ptr;
    size_t bytes = 0;
  };
  static std::array<Kept, kSlots>& kept() {
    static thread_local std::array<Kept, kSlots> k;
    return k;
  }
  std::array<at::Tensor, kSlots> own_;
};

// A packed weight's panels: fp32 (w) or bf16 (wb, its bits), the other nullptr.
sbd_cpu::RowLinearParams packed_params(const float* xt, int64_t M, int64_t K, const float* w, const uint16_t* wb,
                                       int64_t N, float* out, int64_t out_stride) {
  sbd_cpu::RowLinearParams p{xt, K, w, 0, nullptr, nullptr, out, out_stride, M, N, K};
  p.packed = true;
  p.xt = xt;
  p.wb = wb;
  return p;
}

// row_linear with a bf16 weight in tiles: per slice of kRowLinearRows rows, x rounded into the B layout once (as
// equal groups of <= 16 rows as the slice allows: the tiles' columns), then the weight chunks as for the other layouts.
void row_linear_bf16_tiles(const at::Tensor& x, const at::Tensor& weight, float* out, int64_t N, int64_t ld) {
  const int64_t M = x.size(0), K = x.size(1), nb = weight.size(1);
  sbd_cpu::RowLinearParams p{x.data_ptr<float>(), x.stride(0), nullptr, 0, nullptr, nullptr, out, ld, M, N, K};
  p.wt = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  p.x_blocks = nb;
  p.tiles_mode = sbd_cpu::bf16_tiles_mode();
  XScratch xs;
  const int64_t chunks = (N + sbd_cpu::kRowLinearChunk - 1) / sbd_cpu::kRowLinearChunk;
  for (int64_t m0 = 0; m0 < M; m0 += sbd_cpu::kRowLinearRows) {
    sbd_cpu::RowLinearParams s = p;
    s.M = std::min(sbd_cpu::kRowLinearRows, M - m0);
    s.x += m0 * p.x_stride;
    s.out += m0 * p.out_stride;
    s.xb_groups = (s.M + 15) / 16;
    s.xb_cols = (s.M + s.xb_groups - 1) / s.xb_groups;
    int16_t* xb = xs.get<int16_t>(XScratch::kXqRows, s.xb_groups * nb * 16 * s.xb_cols * 2, at::kShort);
    SBD_CPU_DISPATCH(row_linear_bf16_tiles_x, s.x, s.x_stride, s.M, K, nb, s.xb_cols, s.xb_groups,
                     reinterpret_cast<uint16_t*>(xb));
    s.xbt = reinterpret_cast<const uint16_t*>(xb);
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      const int64_t n1 = std::min(N, c1 * sbd_cpu::kRowLinearChunk);
      SBD_CPU_DISPATCH(row_linear_range, s, c0 * sbd_cpu::kRowLinearChunk, n1);
    });
  }
}

}  // namespace

at::Tensor row_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                          bool quantize_x) {
  const OpClock clock(Clocked::kRowLinear);
  check_row_linear(x_in, weight, scale, quantize_x);
  // A bf16 layer: x widened to fp32 (exact), the sums in fp32, the result rounded to bf16 once, all inside the op (a
  // compiled graph sees bf16 in and out, as with F.linear, and cannot move the roundings)
  if (x_in.scalar_type() == at::kBFloat16) return row_linear_cpu(x_in.to(at::kFloat), weight, scale, quantize_x).to(at::kBFloat16);
  const at::Tensor& x = x_in;
  const int64_t M = x.size(0), N = row_linear_out_features(weight), K = x.size(1);
  at::Tensor out = pooled_empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const bool plain = weight.scalar_type() == at::kFloat && !row_linear_is_packed(weight);
  if (plain && K > 0 && M > sbd_cpu::kRowLinearRows) return at::mm_out(out, x, weight.t());
  row_linear_write(x, weight, scale, quantize_x, out.data_ptr<float>(), N, N);
  return out;
}

void row_linear_write(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                      bool quantize_x, float* out, int64_t N, int64_t ld) {
  const int64_t M = x.size(0), K = x.size(1);
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(out + m * ld, out + m * ld + N, 0.f);
    return;
  }
  const bool q8 = weight.scalar_type() == at::kChar, packed = row_linear_is_packed(weight);
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const bool q8_packed = row_linear_is_q8_packed(weight);
  if (row_linear_is_bf16_tiles(weight)) return row_linear_bf16_tiles(x, weight, out, N, ld);
  sbd_cpu::RowLinearParams p{x.data_ptr<float>(),
                             x.stride(0),
                             q8 || q8_packed || bf16 ? nullptr : weight.data_ptr<float>(),
                             q8_packed ? 0 : weight.stride(0),
                             q8 ? weight.data_ptr<int8_t>() : nullptr,
                             q8 || q8_packed ? scale->data_ptr<float>() : nullptr,
                             out,
                             ld,
                             M,
                             N,
                             K};
  p.packed = packed;
  if (bf16) p.wb = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (q8_packed) p.wq_packed = weight.data_ptr<uint8_t>();
  // packed: x^T [K, M] (a tile broadcasts x[m, k] for its rows from one pointer per step), in a scratch buffer below
  // quantize_x: x as int8 blocks and their scales, made once for every weight chunk; with a packed int8 weight per
  // slice, transposed (row_linear_kernel.h)
  XScratch xs;
  if (quantize_x) {
    p.x_blocks = (K + sbd_cpu::kRowLinearXBlock - 1) / sbd_cpu::kRowLinearXBlock;
    p.xq_stride = p.x_blocks * sbd_cpu::kRowLinearXBlock;
    checked_mul("row_linear", "the quantised x M * 32 * ceil(K / 32)", {M, p.xq_stride});
    if (!q8_packed) {
      int8_t* xq = xs.get<int8_t>(XScratch::kXq, M * p.xq_stride, at::kChar);
      float* xd = xs.get<float>(XScratch::kXd, M * p.x_blocks, at::kFloat);
      SBD_CPU_DISPATCH(row_linear_quantize_x, p, xq, xd, 0, M);
      p.xq = xq;
      p.xd = xd;
    }
  }
  const int64_t chunks = (N + sbd_cpu::kRowLinearChunk - 1) / sbd_cpu::kRowLinearChunk;
  for (int64_t m0 = 0; m0 < M; m0 += sbd_cpu::kRowLinearRows) {  // one slice unless a prefill (int8, packed)
    sbd_cpu::RowLinearParams s = p;
    s.M = std::min(sbd_cpu::kRowLinearRows, M - m0);
    s.x += m0 * p.x_stride;
    s.out += m0 * p.out_stride;
    if (packed) {  // a plain loop: ~20 us of dispatch less per call than x.narrow().t().contiguous()
      // into this thread's scratch buffer (K * 32 floats at most; the chunks below only read it): an at::empty per
      // call was one of the ~960 allocations of a compiled SmolLM2 verify forward (420 row_linear calls)
      static thread_local std::vector<float> scratch;
      transpose_rows(s.x, p.x_stride, s.M, K, scratch);
      s.xt = scratch.data();
    }
    if (q8_packed) {
      float* xdt = xs.get<float>(XScratch::kXdt, p.x_blocks * s.M, at::kFloat);
      int32_t* xct = xs.get<int32_t>(XScratch::kXct, p.x_blocks * s.M, at::kInt);
      // the AMX path (cpu/isa.h) reads x row-major instead of transposed; its presence is what sends the chunks there
      const bool amx = sbd_cpu::amx_rows(s.M);
      int8_t* xq_rows = amx ? xs.get<int8_t>(XScratch::kXqRows, s.M * p.xq_stride, at::kChar) : nullptr;
      int32_t* xq4 = amx ? nullptr : xs.get<int32_t>(XScratch::kXq4, p.x_blocks * 8 * s.M, at::kInt);
      SBD_CPU_DISPATCH(row_linear_quantize_x_packed, s, xq4, xdt, xct, xq_rows);
      s.xq = xq_rows;
      s.xq4 = xq4;
      s.xdt = xdt;
      s.xct = xct;
    } else if (quantize_x) {
      s.xq += m0 * p.xq_stride;
      s.xd += m0 * p.x_blocks;
    }
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      const int64_t n1 = std::min(N, c1 * sbd_cpu::kRowLinearChunk);
      SBD_CPU_DISPATCH(row_linear_range, s, c0 * sbd_cpu::kRowLinearChunk, n1);
    });
  }
}

namespace {

// The B step of gated_lora_linear over one slice of Ms rows: rows i with gate g[i] != 0 get o[i] += g[i] * (h_i B'^T),
// h_i = h + i * h_stride (r values), B' packed [N / 16, r, 16] in fp32 (b) or bf16 (bb, its bits; the other
// nullptr); o's rows have stride o_stride (>= N).
void add_gated_delta(const float* h, int64_t h_stride, const float* g, float* o, int64_t o_stride, int64_t Ms,
                     int64_t N, int64_t r, const float* b, const uint16_t* bb) {
  constexpr int64_t C = sbd_cpu::kRowLinearChunk;
  static thread_local std::vector<float> ht, delta;  // this thread's scratch (the chunks get raw pointers)
  static thread_local std::vector<int64_t> rows;
  rows.clear();
  for (int64_t i = 0; i < Ms; ++i)
    if (g[i] != 0.f) rows.push_back(i);
  const int64_t G = static_cast<int64_t>(rows.size());
  if (G == 0) return;
  if (ht.size() < static_cast<size_t>(r * G)) ht.resize(r * G);
  for (int64_t j = 0; j < G; ++j)
    for (int64_t k = 0; k < r; ++k) ht[k * G + j] = h[rows[j] * h_stride + k];
  if (delta.size() < static_cast<size_t>(G * N)) delta.resize(G * N);
  // raw pointers: inside the chunks (other threads) the names ht, delta, rows are those threads' own
  const float* d = delta.data();
  const int64_t* rw = rows.data();
  const auto pb = packed_params(ht.data(), G, r, b, bb, N, delta.data(), N);
  at::parallel_for(0, (N + C - 1) / C, 1, [&](int64_t c0, int64_t c1) {
    const int64_t n0 = c0 * C, n1 = std::min(N, c1 * C);
    SBD_CPU_DISPATCH(row_linear_range, pb, n0, n1);
    for (int64_t j = 0; j < G; ++j) {
      const float gj = g[rw[j]];
      float* orow = o + rw[j] * o_stride;
      const float* drow = d + j * N;
      for (int64_t n = n0; n < n1; ++n) orow[n] += gj * drow[n];
    }
  });
}

}  // namespace

// gated_lora_linear: per slice of kRowLinearRows rows, one walk over the packed [W; A] panels (the base's chunks
// write out, A's write h = x A^T into a scratch buffer; each output sums in the order of row_linear over the same
// panels, so a row with gate 0 is row_linear(x, W) bit for bit), then the B product (scale B packed) of the rows
// with gate != 0 only, added times their gate. One allocation (the output) per call: in a compiled drafter step
// this one call replaces row_linear on [W; A], a copy of h, row_linear on B and the gated add (210 of each per
// SmolLM2 verify forward). A packed int8 [W; A] (w8a8: uint8 panels and one scale per row) is one row_linear call
// over all of its rows, x quantised once (a row with gate 0 is then row_linear(x, W, scale) bit for bit: integer
// sums, one scale per output), and the same B step.
at::Tensor gated_lora_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_b,
                                 const at::Tensor& gate, const std::optional<at::Tensor>& scale,
                                 at::IntArrayRef segments) {
  const OpClock clock(Clocked::kGatedLoraLinear);
  check_gated_lora_linear(x, weight, lora_b, gate, scale, segments);
  constexpr int64_t P = sbd_cpu::kRowLinearPanel, C = sbd_cpu::kRowLinearChunk;
  const int64_t M = x.size(0), K = x.size(1), N = lora_b.size(0) * P, r = lora_b.size(1);
  // scale * B in fp32 panels, or in bf16 panels where its values are bf16 values (GatedLoRALinear.packed_b: the
  // shipped drafters'): half the bytes, the same sums (the bf16 panel path widens each value, then sums as fp32 does)
  const bool b16 = lora_b.scalar_type() == at::kBFloat16;
  const float* b = b16 ? nullptr : lora_b.data_ptr<float>();
  const uint16_t* bb = b16 ? reinterpret_cast<const uint16_t*>(lora_b.data_ptr<at::BFloat16>()) : nullptr;
  const float* g = gate.data_ptr<float>();
  const int64_t r_pad = (r + P - 1) / P * P;
  if (segments.size() > 1 || scale.has_value() || row_linear_is_bf16_tiles(weight)) {
    if (M == 0) return pooled_empty({0, N}, x.options());
    // [M, P * 16]: W's outputs, then h = x A^T (x quantised to int8, or rounded to bf16, once for both)
    // into this thread's scratch, then W's outputs copied row by row: a full tensor and its
    // narrow(1, 0, N).contiguous() were two allocations and ~7 us of dispatched ops per call (210 calls per SmolLM2
    // verify forward: ~1.5 ms). With segments, S sibling projections (q/k/v, gate/up: sbd_ext.merged_linears) in
    // that one walk over [W_1; A_1; ...; W_S; A_S], x transposed (or quantised) once; then per projection its W
    // outputs into its columns of the output and its B step (B'_i: its panels of lora_b). Each output sums as in
    // the projection's own call (row_linear's sums do not depend on the other panels): S calls' outputs, bit for bit.
    check_row_linear(x, weight, scale, scale.has_value());
    const int64_t F = row_linear_out_features(weight);
    const int64_t n_full = checked_mul("gated_lora_linear", "the [W; A] outputs M * F", {M, F});
    XScratch xs;  // the call's own slot: row_linear_write's buffers are its own XScratch's other slots
    float* full = xs.get<float>(XScratch::kLoraFull, n_full, at::kFloat);
    row_linear_write(x, weight, scale, scale.has_value(), full, F, F);
    at::Tensor out = pooled_empty({M, N}, x.options());
    float* o = out.data_ptr<float>();
    const int64_t whole[] = {N};  // no segments: one projection
    int64_t col = 0, fcol = 0;    // a projection's first column of the output, of [W_i; A_i]'s outputs
    for (const int64_t n : segments.size() > 1 ? segments : at::IntArrayRef(whole)) {
      for (int64_t m = 0; m < M; ++m) std::memcpy(o + m * N + col, full + m * F + fcol, n * sizeof(float));
      for (int64_t m0 = 0; m0 < M; m0 += sbd_cpu::kRowLinearRows)
        add_gated_delta(full + m0 * F + fcol + n, F, g + m0, o + m0 * N + col, N,
                        std::min(sbd_cpu::kRowLinearRows, M - m0), n, r, b16 ? nullptr : b + col * r,
                        b16 ? bb + col * r : nullptr);
      col += n;
      fcol += n + r_pad;
    }
    return out;
  }
  at::Tensor out = pooled_empty({M, N}, x.options());
  if (M == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = x.data_ptr<float>();
  // [W; A] in fp32, or in bf16 (sbd_ext.quantize(model, "bf16"): the base's panels and A's rounded alike)
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const float* w = bf16 ? nullptr : weight.data_ptr<float>();
  const uint16_t* wb = bf16 ? reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t a_off = (N / P) * K * P;  // A's panels follow the base's
  const float* wa = bf16 ? nullptr : w + a_off;
  const uint16_t* wba = bf16 ? wb + a_off : nullptr;
  float* o = out.data_ptr<float>();
  static thread_local std::vector<float> xt, h;  // this thread's scratch (the chunks get raw pointers)
  const int64_t base_chunks = (N + C - 1) / C, a_chunks = (r_pad + C - 1) / C;
  for (int64_t m0 = 0; m0 < M; m0 += sbd_cpu::kRowLinearRows) {
    const int64_t Ms = std::min(sbd_cpu::kRowLinearRows, M - m0);
    transpose_rows(xp + m0 * x.stride(0), x.stride(0), Ms, K, xt);
    if (h.size() < static_cast<size_t>(Ms * r_pad)) h.resize(Ms * r_pad);
    const auto pw = packed_params(xt.data(), Ms, K, w, wb, N, o + m0 * N, N);
    const auto pa = packed_params(xt.data(), Ms, K, wa, wba, r_pad, h.data(), r_pad);
    at::parallel_for(0, base_chunks + a_chunks, 1, [&](int64_t c0, int64_t c1) {
      if (c0 < base_chunks) SBD_CPU_DISPATCH(row_linear_range, pw, c0 * C, std::min(N, std::min(c1, base_chunks) * C));
      if (c1 > base_chunks) {
        const int64_t a0 = std::max(c0, base_chunks) - base_chunks, a1 = c1 - base_chunks;
        SBD_CPU_DISPATCH(row_linear_range, pa, a0 * C, std::min(r_pad, a1 * C));
      }
    });
    add_gated_delta(h.data(), r_pad, g + m0, o + m0 * N, N, Ms, N, r, b, bb);
  }
  return out;
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) {
  m.impl("row_linear", &row_linear_cpu);
  m.impl("gated_lora_linear", &gated_lora_linear_cpu);
}

}  // namespace sbd_ext
