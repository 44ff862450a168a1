// C entry points for inductor's C++ wrapper (the compiled CPU decode step, sbd_ext/decoding/compiled.py).
//
// Why: the wrapper calls a custom op through the boxed dispatcher (aoti_torch_call_dispatcher: the op looked up by
// name, each argument a fresh tensor handle and an IValue, the Autograd key then the CPU kernel) unless the op is in
// inductor's aot_inductor.custom_ops_to_c_shims, in which case it calls a C function named
// aoti_torch_cpu_<op> with the graph's own handles. A SmolLM2-135M forward makes ~240 such calls (211 row_linear,
// 30 block_attention). These functions are those C functions: each calls the op's CPU implementation -- the same
// checks and the same kernel as the dispatcher's CPU entry, so the same bits -- and returns its result as a new
// handle. An error is returned as AOTI's shims return theirs (AOTI_TORCH_FAILURE: inductor's code then raises a
// RuntimeError that names the call, not the reason) and its message written to stderr, so the reason is seen.
// The declarations inductor writes into the wrapper are sbd_ext/decoding/c_shims.py's C_SHIMS; that module also
// re-opens this library with its symbols global so that the wrapper's shared object resolves them when it loads.
// No autograd: the compiled step is inference only.

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <cstdio>
#include <exception>
#include <optional>

namespace sbd_ext {
at::Tensor row_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                          bool quantize_x);
at::Tensor gated_lora_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_b,
                                 const at::Tensor& gate, const std::optional<at::Tensor>& scale,
                                 at::IntArrayRef segments);
at::Tensor block_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& n_commit,
                               const at::Tensor& n_valid, double scale, double softcap, int64_t window_left);
at::Tensor screened_head_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                             const at::Tensor& screen_norm, int64_t exclude);
}  // namespace sbd_ext

namespace {
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

const at::Tensor& t(AtenTensorHandle h) { return *tensor_handle_to_tensor_pointer(h); }

std::optional<at::Tensor> opt(AtenTensorHandle* h) {
  if (h == nullptr || *h == nullptr) return std::nullopt;
  return t(*h);
}

// Runs f, which sets *ret; an exception becomes AOTI_TORCH_FAILURE with its message on stderr.
template <typename F>
AOTITorchError guarded(const char* op, F&& f) {
  try {
    f();
    return AOTI_TORCH_SUCCESS;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "sbd_ext %s (compiled step): %s\n", op, e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sbd_ext %s (compiled step): %s\n", op, e.what());
  } catch (...) {
    std::fprintf(stderr, "sbd_ext %s (compiled step): unknown error\n", op);
  }
  return AOTI_TORCH_FAILURE;
}
}  // namespace

extern "C" {

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_row_linear(AtenTensorHandle x,
                                                                               AtenTensorHandle weight,
                                                                               AtenTensorHandle* scale,
                                                                               int32_t quantize_x,
                                                                               AtenTensorHandle* ret0) {
  return guarded("row_linear", [&] {
    *ret0 = new_tensor_handle(sbd_ext::row_linear_cpu(t(x), t(weight), opt(scale), quantize_x != 0));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_gated_lora_linear(
    AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle lora_b, AtenTensorHandle gate,
    AtenTensorHandle* scale, const int64_t* segments, int64_t segments_len_, AtenTensorHandle* ret0) {
  return guarded("gated_lora_linear", [&] {
    const at::IntArrayRef segs(segments, static_cast<size_t>(segments_len_));
    *ret0 = new_tensor_handle(sbd_ext::gated_lora_linear_cpu(t(x), t(weight), t(lora_b), t(gate), opt(scale), segs));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_block_attention(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle k_cache, AtenTensorHandle v_cache,
    AtenTensorHandle cache_lens, AtenTensorHandle n_commit, AtenTensorHandle n_valid, double scale, double softcap,
    int64_t window_left, AtenTensorHandle* ret0) {
  return guarded("block_attention", [&] {
    *ret0 = new_tensor_handle(sbd_ext::block_attention_cpu(t(q), t(k), t(v), t(k_cache), t(v_cache), t(cache_lens),
                                                           t(n_commit), t(n_valid), scale, softcap, window_left));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_screened_head(
    AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle screen, AtenTensorHandle screen_norm, int64_t exclude,
    AtenTensorHandle* ret0) {
  return guarded("screened_head", [&] {
    *ret0 = new_tensor_handle(sbd_ext::screened_head_cpu(t(x), t(weight), t(screen), t(screen_norm), exclude));
  });
}

}  // extern "C"
