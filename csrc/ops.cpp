// The op schemas (one TORCH_LIBRARY for the whole library) and the Python module that loads them.
//
// Device implementations register themselves with TORCH_LIBRARY_IMPL in their own files:
//   csrc/cpu/<op>_cpu.cpp    CPU kernels (always built)
//   csrc/cuda/<op>_cuda.cpp  CUDA bindings over the raw-pointer kernels in csrc/cuda/kernels (built with a CUDA torch)
// Fake (meta) implementations for torch.compile live in sbd_ext/ops.py.
#include <torch/extension.h>
#include <pybind11/stl.h>
#include <torch/library.h>
#include <torch/headeronly/version.h>

#include <iterator>
#include <string>
#include <vector>

#include "cpu/block_attention_kernel.h"
#include "cpu/isa.h"
#include "cpu/op_clock.h"
#include "cpu/row_linear_kernel.h"

TORCH_LIBRARY(sbd_ext, m) {
  // q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D] (mutated: committed rows appended at
  // cache_lens[b]); cache_lens, n_commit, n_valid [B] int32/int64. Returns [B, T, Hq, D] in q's dtype.
  // softcap > 0: logits soft-capped (0 = off); window_left >= 0: sliding window (-1 = off); see
  // sbd/block_attention_params.h.
  m.def(
      "block_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_lens, "
      "Tensor n_commit, Tensor n_valid, float scale, float softcap=0.0, int window_left=-1) -> Tensor");
  // logits [N, V] fp32/bf16/fp16 -> (entropy fp32 [N], max_prob fp32 [N], token int64 [N]).
  m.def("entropy_sample(Tensor logits, float temperature, int seed, int offset) -> (Tensor, Tensor, Tensor)");
  // tokens [B, K] int64 (mutated), proposals [B, K] int64, entropy / max_prob [B, K] fp32; rule "eb" | "entropy" |
  // "confidence". Returns (n_revealed [B], n_remaining [B]) int64.
  m.def(
      "mask_replace(Tensor(a!) tokens, Tensor proposals, Tensor entropy, Tensor max_prob, int mask_id, str rule, "
      "float threshold) -> (Tensor, Tensor)");
  // x [M, K] fp32, weight [N, K] (nn.Linear's layout), each contiguous along K -> x @ weight^T [M, N] fp32. weight
  // fp32 with scale None, or int8 with scale [N] fp32 (weight-only quantisation: (x @ weight^T) * scale). No
  // backward. The CPU kernel is for the few rows of a decoding forward (sbd_ext.linear / sbd_ext.quantize put it in
  // a model).
  m.def("row_linear(Tensor x, Tensor weight, Tensor? scale=None, bool quantize_x=False) -> Tensor");
  // A gated LoRA adapter over a packed fp32 projection in one call (the CPU kernel of a compiled drafter step):
  // x [M, K] fp32; weight [P, K, 16] packed: the base's N rows (N = 16 * lora_b.size(0)), then the adapter's A
  // rows [r, K] (zero rows to whole panels); lora_b [N / 16, r, 16] packed (scale * B); gate [M] fp32 ->
  // x W^T + gate[:, None] * ((x A^T) (scale B)^T) [M, N] fp32 (rows with gate 0: x W^T exactly). CPU only; no
  // backward.
  m.def(
      "gated_lora_linear(Tensor x, Tensor weight, Tensor lora_b, Tensor gate, Tensor? scale=None, int[] segments=[]) "
      "-> Tensor");
  // A greedy decoder's output head: x [M, K] fp32; weight [P, K, 16] fp32 packed (the head); screen [P, K, 16] bf16
  // packed (the same rows rounded to bf16); screen_norm [V] fp32 (each real row's L2 norm, rounded up); exclude -1 or
  // a row id -> logits [M, P * 16] fp32 whose largest entry (over all columns, and over all but `exclude`) is where
  // row_linear(x, weight)'s is: the columns that may hold it carry row_linear's values bit for bit, the rest the
  // screen's, each below the row's largest. For argmax only (not a distribution). No backward.
  m.def("screened_head(Tensor x, Tensor weight, Tensor screen, Tensor screen_norm, int exclude=-1) -> Tensor");
  // x [N, V] fp32 -> (values [N, k] fp32, indices [N, k] int64, lse [N] fp32): each row's k largest entries by
  // (value descending, index ascending; NaN first) and torch.logsumexp of the row. CPU only (a sampler head's
  // rescoring in the host's reveal); no backward.
  m.def("topk_logsumexp(Tensor x, int k) -> (Tensor, Tensor, Tensor)");
}

#ifdef SBD_EXT_WITH_CUDA
namespace sbd_ext {
std::string take_block_attention_cuda_error();  // csrc/cuda/block_attention_cuda.cpp
}
#endif

namespace sbd_ext {
std::vector<int64_t> screened_head_stats();  // csrc/cpu/screened_head_cpu.cpp
bool set_screen_pairs(bool enabled);          // csrc/cpu/screened_head_cpu.cpp
int64_t screened_head_pairs_rows();           // csrc/cpu/screened_head_cpu.cpp
}

namespace {

const char* bf16_tiles_name() {
  switch (sbd_cpu::bf16_tiles_mode()) {
    case sbd_cpu::Amx::HW:
      return "tiles";
    case sbd_cpu::Amx::EMULATE:
      return "emulate";
    default:
      return "model";
  }
}

// The first invalid lengths a CUDA block_attention kernel found since the last call, as the message the CPU
// binding raises for them, or "" (always "" without the CUDA kernels). Call after synchronising the device.
std::string take_cuda_error() {
#ifdef SBD_EXT_WITH_CUDA
  return sbd_ext::take_block_attention_cuda_error();
#else
  return "";
#endif
}

pybind11::dict build_info() {
  pybind11::dict d;
#ifdef SBD_EXT_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
#ifdef SBD_EXT_DEBUG
  d["debug"] = true;
#else
  d["debug"] = false;
#endif
  // the head dims the CUDA block_attention kernels are built for (in a CPU-only build too: what a CUDA build has)
  d["cuda_head_dims"] = std::vector<int64_t>(std::begin(sbd::kCudaBlockAttentionHeadDims),
                                             std::end(sbd::kCudaBlockAttentionHeadDims));
  d["cpu_isa"] = std::string(sbd_cpu::isa_name(sbd_cpu::active_isa()));
  d["cpu_isas"] = sbd_cpu::available_isas();
  // the core family that picks the few per-core tunings (cpu/isa.h: a prefetch distance; never a result)
  d["cpu_core"] = std::string(sbd_cpu::core_name(sbd_cpu::cpu_core()));
  // block_attention's matrix products for bf16 / fp16 under the current setting ("tiles": bf16 on the AMX-BF16
  // tiles; "gemm": cpublas GEMM on the CPU's matrix units; "vector": this extension's micro-kernel), and the setting.
  const auto path = [](sbd_cpu::AttnDtype t) {
    if (sbd_cpu::block_attention_tiles(t) != sbd_cpu::Amx::OFF) return std::string("tiles");
    return std::string(sbd_cpu::block_attention_use_gemm(t) ? "gemm" : "vector");
  };
  d["cpu_bf16_attention"] = path(sbd_cpu::AttnDtype::kBFloat16);
  d["cpu_fp16_attention"] = path(sbd_cpu::AttnDtype::kFloat16);
  d["cpu_attention_matmul"] = sbd_cpu::block_attention_matmul();
  // row_linear's rows per kernel pass: past it the CPU op runs at::mm (fp32) or slices of it (int8)
  d["cpu_row_linear_rows"] = sbd_cpu::kRowLinearRows;
  // row_linear's packed int8 weights (sbd_ext.packing.pack_row_linear_int8) run on AVX512-VNNI (vpdpbusd) in the
  // active ISA variant; elsewhere in scalar code (sbd_ext.quantize packs them only where this is true)
#if defined(__x86_64__) || defined(_M_X64)
  d["cpu_vnni"] = sbd_cpu::active_isa() == sbd_cpu::Isa::AVX512 && __builtin_cpu_supports("avx512vnni");
  // bf16 dot products in the vector unit (vdpbf16ps: AMD Zen 4, Intel Cooper Lake and later), which torch's own
  // bf16 matmuls (oneDNN) use: what makes bf16 autocast training pay on a CPU without AMX (the drafter's --precision
  // auto; on a Zen 4 1.56x fp32's answer tokens per second)
  d["cpu_avx512_bf16"] = static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
#else
  d["cpu_vnni"] = false;
  d["cpu_avx512_bf16"] = false;
#endif
  // rows from which screened_head screens with bf16 products in the active ISA variant (0: never; set_screen_pairs)
  d["cpu_screen_pairs_rows"] = sbd_ext::screened_head_pairs_rows();
  // row_linear's packed int8 weights at >= cpu_amx_min_rows x rows on AMX-INT8 tiles (cpu/isa.h): whether this CPU,
  // OS and process allow it (and if not, why), and the current mode ("on", "off", "emulate")
  d["cpu_amx_int8"] = sbd_cpu::amx_int8_usable();
  d["cpu_amx_int8_status"] = sbd_cpu::amx_int8_status();
  d["cpu_amx"] = std::string(sbd_cpu::amx_mode_name(sbd_cpu::amx_mode()));
  d["cpu_amx_min_rows"] = sbd_cpu::kAmxMinRows;
  // bf16 weights in tiles on AMX-BF16 (cpu/isa.h): whether usable here, and how row_linear runs them now ("tiles",
  // "emulate" or "model": the tiles' sums on the vector units); sbd_ext.quantize(model, "bf16") packs in tiles
  // unless "model"
  d["cpu_amx_bf16"] = sbd_cpu::amx_bf16_usable();
  d["cpu_bf16_tiles"] = std::string(bf16_tiles_name());
  d["cpu_bf16_matmul_units"] = sbd_cpu::cpu_has_bf16_matmul();
  d["cpu_fp16_matmul_units"] = sbd_cpu::cpu_has_fp16_matmul();
  d["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                       std::to_string(TORCH_VERSION_PATCH);
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sbd_ext compiled kernels; the ops are reached through torch.ops.sbd_ext";
  m.def("build_info", &build_info, "How this extension was built: CUDA kernels, CPU ISA variants, debug flags.");
  m.def("take_cuda_error", &take_cuda_error,
        "The first invalid-lengths error a CUDA block_attention kernel recorded since the last call (\"\" if none); "
        "see sbd_ext.ops.check_cuda_errors.");
  m.def("set_block_attention_matmul", &sbd_cpu::set_block_attention_matmul, pybind11::arg("name"),
        "CPU block_attention's matrix products: \"auto\" (bf16 on the AMX-BF16 tiles where row_linear runs bf16 "
        "in tiles, cpublas GEMM for fp16 where the CPU has AMX-FP16, the micro-kernel otherwise), \"vector\" or "
        "\"gemm\" for every type, \"tiles\" (bf16 on the tiles; raises where they are off).");
  m.def("block_attention_cpu_paths", &sbd_cpu::block_attention_path_counts,
        "(vector, gemm, tiles): CPU block_attention calls per matrix path since the process started.");
  m.def("set_cpu_amx", &sbd_cpu::set_amx, pybind11::arg("mode"),
        "row_linear's packed int8 weights on AMX-INT8 tiles: \"auto\" (where usable), \"off\", \"on\" (raises "
        "where unusable) or \"emulate\" (the same kernel over a C++ model of the tiles: for tests, slow).");
  m.def("cpu_bf16_tiles", [] { return std::string(bf16_tiles_name()); },
        "How row_linear runs a bf16 weight in tiles now: \"tiles\" (AMX-BF16), \"emulate\" or \"model\" (the same "
        "sums on the vector units, slow); sbd_ext.quantize(model, \"bf16\") packs in tiles unless \"model\".");
  m.def("row_linear_amx_calls", &sbd_cpu::amx_range_calls,
        "row_linear weight ranges that ran on AMX tiles (or their emulation) since the process started.");
  m.def("screened_head_stats", &sbd_ext::screened_head_stats,
        "screened_head on the CPU since the process started: [calls, rows, fp32 panels computed again, calls that "
        "ran the fp32 head whole, calls screened with bf16 products (x rounded to bf16: AVX512-BF16)].");
  m.def("set_screen_pairs", &sbd_ext::set_screen_pairs, pybind11::arg("enabled"),
        "Whether screened_head may screen with bf16 products where the CPU has them (the default: True; from "
        "build_info()['cpu_screen_pairs_rows'] rows); False keeps the widened fp32 products. Returns the previous "
        "setting. Never changes a row's choice.");
  m.def(
      "set_op_clock",
      [](bool enabled) { return sbd_ext::op_clock_state().on.exchange(enabled); },
      pybind11::arg("enabled"),
      "Switch the CPU ops' own clock on or off (cpu/op_clock.h; off by default); returns the previous setting.");
  m.def(
      "op_clock",
      [](bool reset) {
        auto& st = sbd_ext::op_clock_state();
        pybind11::dict d;
        for (int i = 0; i < static_cast<int>(sbd_ext::Clocked::kCount); ++i) {
          const int64_t calls = reset ? st.calls[i].exchange(0) : st.calls[i].load();
          const int64_t ns = reset ? st.ns[i].exchange(0) : st.ns[i].load();
          d[sbd_ext::kClockedNames[i]] = pybind11::make_tuple(calls, static_cast<double>(ns) * 1e-9);
        }
        return d;
      },
      pybind11::arg("reset") = false,
      "{op: (calls, seconds)} of the CPU ops' own clock since the last reset (calls made while it was on; "
      "reset=True zeroes it after reading).");
  m.def("set_cpu_isa", &sbd_cpu::set_isa, pybind11::arg("name"),
        "Narrow the CPU kernels to one ISA variant (\"default\", \"avx2\", \"avx512\"); \"\" restores the widest.");
}
