// block_attention on the CPU: checks, the work decomposition, and the calls into the per-ISA kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "block_attention_checks.h"
#include "cpu/block_attention_kernel.h"
#include "cpu/op_clock.h"
#include "cpu/output_pool.h"

namespace sbd_ext {
namespace {

sbd_cpu::AttnDtype attn_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return sbd_cpu::AttnDtype::kBFloat16;
    case at::kHalf:
      return sbd_cpu::AttnDtype::kFloat16;
    default:
      return sbd_cpu::AttnDtype::kFloat32;
  }
}

// The GEMM path reads K and V rows in place as matrix operands: their row strides are the leading dimensions,
// which a GEMM needs to be at least D (the checks allow any row stride, e.g. a broadcast k with stride 0).
bool rows_are_matrices(const sbd_cpu::BlockAttentionParams& p) {
  for (int64_t st : {p.k_st, p.v_st, p.kc_st, p.vc_st})
    if (st < p.D) return false;
  return true;
}

// The committed rows' K/V into the cache at cache_lens[b], for every (b, kv head), before any unit runs: the units
// then read cache rows and committed rows alike from the cache, in place (the block that holds the cache's end is not
// gathered), and no unit reads a row while it is written (the binding refuses k / v that share memory with the
// caches). The same bytes as k / v, so no sum changes. Large appends (a long prompt) are split over the threads.
void append_committed(const sbd_cpu::BlockAttentionParams& p, int64_t elem) {
  int64_t rows = 0;
  for (int64_t b = 0; b < p.B; ++b) rows += p.commit(b);
  const int64_t bytes = p.D * elem;
  const auto copy = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / p.Hkv, h = i % p.Hkv, len = p.cache_len(b);
      for (int64_t t = 0; t < p.commit(b); ++t) {
        std::memcpy(static_cast<char*>(p.k_cache) + (b * p.kc_sb + h * p.kc_sh + (len + t) * p.kc_st) * elem,
                    static_cast<const char*>(p.k) + (b * p.k_sb + h * p.k_sh + t * p.k_st) * elem, bytes);
        std::memcpy(static_cast<char*>(p.v_cache) + (b * p.vc_sb + h * p.vc_sh + (len + t) * p.vc_st) * elem,
                    static_cast<const char*>(p.v) + (b * p.v_sb + h * p.v_sh + t * p.v_st) * elem, bytes);
      }
    }
  };
  if (2 * rows * p.Hkv * bytes < (int64_t{1} << 20))
    copy(0, p.B * p.Hkv);
  else
    at::parallel_for(0, p.B * p.Hkv, 1, copy);
}

}  // namespace

at::Tensor block_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& n_commit,
                               const at::Tensor& n_valid, double scale, double softcap, int64_t window_left) {
  const OpClock clock(Clocked::kBlockAttention);
  check_block_attention(q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, scale, softcap, window_left);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), S = k_cache.size(2);
  const std::vector<int64_t> lens = host_lengths(cache_lens), commit = host_lengths(n_commit),
                             valid = host_lengths(n_valid);
  check_block_attention_lengths(lens, commit, valid, T, S);
  at::Tensor out = pooled_empty({B, T, Hq, D}, q.options());
  if (B == 0 || T == 0) return out;

  sbd_cpu::BlockAttentionParams p;
  fill_block_attention_params(p, q, k, v, k_cache, v_cache, out, scale, softcap, window_left);
  p.cache_lens = lens.data();
  p.n_commit = commit.data();
  p.n_valid = valid.data();
  p.cache_lens_i64 = p.n_commit_i64 = p.n_valid_i64 = true;
  p.dtype = attn_dtype(q.scalar_type());
  // the tiles load 32 values of a row at a time and read K / V in place: D a multiple of 32, rows that are matrices
  p.tiles = rows_are_matrices(p) && p.D % 32 == 0 ? sbd_cpu::block_attention_tiles(p.dtype) : sbd_cpu::Amx::OFF;
  p.gemm = p.tiles == sbd_cpu::Amx::OFF && sbd_cpu::block_attention_use_gemm(p.dtype) && rows_are_matrices(p);
  sbd_cpu::count_block_attention_path(p.tiles != sbd_cpu::Amx::OFF ? 2 : p.gemm ? 1 : 0);
  append_committed(p, q.element_size());
  const int64_t threads = at::get_num_threads();
  sbd_cpu::block_attention_plan(p, threads);
  at::Tensor partials;
  if (p.n_splits > 1) {
    partials = at::empty({p.n_units() * p.partial_floats()}, q.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }

  // One worker per thread, each taking units from a shared counter until none is left: a thread that the OS
  // delays (a busy machine) or that drew the longer units does not hold the others up, as a static split would.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, p.n_units()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) SBD_CPU_DISPATCH(block_attention_units, p, next);
  });
  if (p.n_splits > 1)
    at::parallel_for(0, p.n_items(), 1, [&](int64_t i0, int64_t i1) { SBD_CPU_DISPATCH(block_attention_merge, p, i0, i1); });
  return out;
}

}  // namespace sbd_ext

namespace sbd_cpu {
namespace {

enum class Matmul : int { kAuto = 0, kVector = 1, kGemm = 2, kTiles = 3 };

std::atomic<int>& matmul_mode() {
  static std::atomic<int> mode{static_cast<int>(Matmul::kAuto)};
  return mode;
}

}  // namespace

// Matrix units as oneDNN sees them: AMX-BF16 / AMX-FP16 (at::native::cpublas::could_pack: oneDNN's ISA >=
// avx512_core_amx[_fp16]). The AVX-512 dot-product instructions alone (avx512_bf16 / avx512_fp16 without AMX) do not
// count: on an AMD EPYC Zen 4 (AVX512-BF16, no AMX), Llama-3.1-8B shapes (bench/ops/bench_block_attention.py, 1
// thread), the gemm path (oneDNN's vdpbf16ps matmul per key block) took 14.7 ms where the vector path takes 11.8 ms
// and SDPA 15.3 ms (bench/results/cpu_ops.csv): oneDNN's per-call set-up on these small blocks costs more than the
// dot products save.
bool cpu_has_bf16_matmul() {
  static const bool has = at::native::cpublas::could_pack(at::kBFloat16);
  return has;
}

bool cpu_has_fp16_matmul() {
  static const bool has = at::native::cpublas::could_pack(at::kHalf);
  return has;
}

bool block_attention_use_gemm(AttnDtype dtype) {
  switch (static_cast<Matmul>(matmul_mode().load(std::memory_order_relaxed))) {
    case Matmul::kVector:
      return false;
    case Matmul::kGemm:
      return true;
    default:
      // Only with the AVX-512 kernels (every CPU with AMX has AVX-512; the narrower builds run there only when
      // forced): on an AMX Xeon (2026-12-03) the GEMM path under the AVX2 and default builds let a row's bf16
      // output depend on the rows beside it (1 of 16-24 rows, last bit, at 760-1600 cached keys), which the
      // AVX-512 build's does not (python_tests/ops/test_ops_batch_invariance.py); the vector path never does.
      return active_isa() == Isa::AVX512 && ((dtype == AttnDtype::kBFloat16 && cpu_has_bf16_matmul()) ||
                                             (dtype == AttnDtype::kFloat16 && cpu_has_fp16_matmul()));
  }
}

// "auto" and "tiles": bf16 on the AMX-BF16 tiles wherever row_linear runs bf16 in tiles (cpu/isa.h
// bf16_tiles_mode: HW, or EMULATE when the AMX mode is "emulate"); "vector" / "gemm": never.
Amx block_attention_tiles(AttnDtype dtype) {
  const auto mode = static_cast<Matmul>(matmul_mode().load(std::memory_order_relaxed));
  if (dtype != AttnDtype::kBFloat16 || mode == Matmul::kVector || mode == Matmul::kGemm) return Amx::OFF;
  return bf16_tiles_mode();
}

std::array<std::atomic<int64_t>, 3>& path_counts() {
  static std::array<std::atomic<int64_t>, 3> counts{};
  return counts;
}

void count_block_attention_path(int path) { path_counts()[path].fetch_add(1, std::memory_order_relaxed); }

std::tuple<int64_t, int64_t, int64_t> block_attention_path_counts() {
  return {path_counts()[0].load(std::memory_order_relaxed), path_counts()[1].load(std::memory_order_relaxed),
          path_counts()[2].load(std::memory_order_relaxed)};
}

void set_block_attention_matmul(const std::string& name) {
  Matmul mode;
  if (name == "auto" || name.empty()) {
    mode = Matmul::kAuto;
  } else if (name == "vector") {
    mode = Matmul::kVector;
  } else if (name == "gemm") {
    mode = Matmul::kGemm;
  } else if (name == "tiles") {
    TORCH_CHECK_VALUE(bf16_tiles_mode() != Amx::OFF,
                      "sbd_ext: block_attention matmul \"tiles\" needs the AMX-BF16 tiles (or "
                      "set_cpu_amx(\"emulate\")) in the AVX-512 kernels; here: ",
                      amx_int8_status());
    mode = Matmul::kTiles;
  } else {
    TORCH_CHECK_VALUE(false, "sbd_ext: unknown block_attention matmul \"", name,
                      "\"; expected \"auto\", \"vector\", \"gemm\" or \"tiles\"");
  }
  matmul_mode().store(static_cast<int>(mode));
}

std::string block_attention_matmul() {
  switch (static_cast<Matmul>(matmul_mode().load(std::memory_order_relaxed))) {
    case Matmul::kVector:
      return "vector";
    case Matmul::kGemm:
      return "gemm";
    case Matmul::kTiles:
      return "tiles";
    default:
      return "auto";
  }
}

}  // namespace sbd_cpu

namespace sbd_ext {

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("block_attention", &block_attention_cpu); }

}  // namespace sbd_ext
