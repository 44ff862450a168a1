"""The compiled CPU step calls sbd_ext's ops through C functions, not the dispatcher.

inductor's C++ wrapper calls a custom op through the boxed dispatcher (the op looked up by name, every argument a new
tensor handle and an IValue, the Autograd key, then the CPU kernel) unless the op is listed in inductor's
``aot_inductor.custom_ops_to_c_shims``: then it calls a C function ``aoti_torch_cpu_<op>`` with the graph's own
handles. sbd_ext's extension defines those functions (csrc/cpu/aoti_shims.cpp: each calls the op's CPU
implementation, the same checks and kernel as the dispatcher's CPU entry). A SmolLM2-135M forward makes ~240 such
calls. :func:`cpu_options` adds the list to the CPU step's inductor options once the extension's symbols are visible
to the shared objects inductor loads (its library re-opened with ``RTLD_GLOBAL``); where that is not possible the
step keeps the dispatcher (same results)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from .. import _C

__all__ = ["C_SHIMS", "cpu_options", "shims_available"]

# The declarations inductor writes into the wrapper (its C shim convention: tensors as AtenTensorHandle, an optional
# tensor as a pointer to one (nullptr: None), bool as int32_t, float as double, int as int64_t, the result last).
C_SHIMS = {
    "row_linear": "AOTITorchError aoti_torch_cpu_row_linear(AtenTensorHandle x, AtenTensorHandle weight, "
    "AtenTensorHandle* scale, int32_t quantize_x, AtenTensorHandle* ret0)",
    "gated_lora_linear": "AOTITorchError aoti_torch_cpu_gated_lora_linear(AtenTensorHandle x, "
    "AtenTensorHandle weight, AtenTensorHandle lora_b, AtenTensorHandle gate, AtenTensorHandle* scale, "
    "const int64_t* segments, int64_t segments_len_, AtenTensorHandle* ret0)",
    "block_attention": "AOTITorchError aoti_torch_cpu_block_attention(AtenTensorHandle q, AtenTensorHandle k, "
    "AtenTensorHandle v, AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle cache_lens, "
    "AtenTensorHandle n_commit, AtenTensorHandle n_valid, double scale, double softcap, int64_t window_left, "
    "AtenTensorHandle* ret0)",
    "screened_head": "AOTITorchError aoti_torch_cpu_screened_head(AtenTensorHandle x, AtenTensorHandle weight, "
    "AtenTensorHandle screen, AtenTensorHandle screen_norm, int64_t exclude, AtenTensorHandle* ret0)",
}


@functools.cache
def shims_available() -> bool:
    """Whether the extension's C functions can be linked by inductor's code: the library re-opened with its symbols
    global (``RTLD_NOLOAD``: the copy already loaded), each function found. ``SBD_EXT_C_SHIMS=0``: never (the
    dispatcher, as before)."""
    if os.environ.get("SBD_EXT_C_SHIMS", "1") == "0":
        return False
    try:
        lib = ctypes.CDLL(_C.__file__, mode=os.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 0))
        return all(hasattr(lib, f"aoti_torch_cpu_{op}") for op in C_SHIMS)
    except OSError:
        return False


def cpu_options(options: dict) -> dict:
    """``options`` (inductor's, for a CPU graph with the C++ wrapper) with sbd_ext's ops called through their C
    functions where :func:`shims_available`."""
    if not shims_available():
        return dict(options)
    shims = {getattr(torch.ops.sbd_ext, op).default: [decl] for op, decl in C_SHIMS.items()}
    return {**options, "aot_inductor.custom_ops_to_c_shims": shims}
