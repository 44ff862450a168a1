// Autograd kernels. The ops have no backward; an op over differentiable inputs must then refuse inputs that
// require grad while grad mode is on, or torch.ops.sbd_ext.<op> returns an output that requires grad and whose
// backward leaves the inputs' .grad None (the autograd fallback's silent answer). sbd_ext/ops.py's wrappers refuse
// them too, with the same message; this covers a direct torch.ops call.
//
// row_linear: x, weight and scale are differentiable (it is a linear layer); gated_lora_linear: all of its inputs. block_attention, entropy_sample and
// mask_replace are not covered here (sbd_ext/ops.py refuses their differentiable inputs).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace sbd_ext {
namespace {

// Refuses inputs that require grad while grad mode is on: "<op> has no backward, but x, weight require(s) grad ...".
void refuse_grads(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs,
                  const char* hint) {
  if (!c10::GradMode::is_enabled()) return;
  std::string grads;
  for (const auto& [name, t] : inputs)
    if (t->defined() && t->requires_grad()) grads += (grads.empty() ? "" : ", ") + std::string(name);
  TORCH_CHECK(grads.empty(), op, " has no backward, but ", grads,
              " require(s) grad: call it under torch.no_grad() / torch.inference_mode(), or detach the inputs", hint);
}

at::Tensor row_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                               bool quantize_x) {
  const at::Tensor none;
  refuse_grads("row_linear", {{"x", &x}, {"weight", &weight}, {"scale", scale.has_value() ? &*scale : &none}},
               " (for training use torch.nn.functional.linear)");
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("sbd_ext::row_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         bool)>();
  return op.call(x, weight, scale, quantize_x);
}

at::Tensor gated_lora_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_b,
                                     const at::Tensor& gate, const std::optional<at::Tensor>& scale,
                                     at::IntArrayRef segments) {
  const at::Tensor none;
  refuse_grads("gated_lora_linear",
               {{"x", &x}, {"weight", &weight}, {"lora_b", &lora_b}, {"gate", &gate},
                {"scale", scale.has_value() ? &*scale : &none}},
               "");
  at::AutoDispatchBelowADInplaceOrView guard;
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("sbd_ext::gated_lora_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, at::IntArrayRef)>();
  return op.call(x, weight, lora_b, gate, scale, segments);
}

}  // namespace

TORCH_LIBRARY_IMPL(sbd_ext, Autograd, m) {
  m.impl("row_linear", &row_linear_autograd);
  m.impl("gated_lora_linear", &gated_lora_linear_autograd);
}

}  // namespace sbd_ext
