"""CPU smoke test of an sbd_ext built with its CUDA kernels against a CUDA torch, on a machine without a GPU
(tools/ci_cuda_torch_build.sh runs it in that build's venv): the extension imports, holds CUDA kernels for every op,
links the CUDA runtime, and the four ops (torch.ops.sbd_ext.*) on CPU tensors equal sbd_ext.reference.

Exits non-zero with the first difference."""

from __future__ import annotations

import subprocess
import sys

import torch

import sbd_ext
from sbd_ext import reference as R

OPS = ("block_attention", "entropy_sample", "mask_replace", "row_linear")


def check_build() -> None:
    assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
    info = sbd_ext.build_info()
    assert info["cuda"] is True, f"sbd_ext was built without its CUDA kernels: {info}"
    for op in OPS:
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sbd_ext::{op}", key), f"no {key} kernel for {op}"
    libs = subprocess.run(["ldd", sbd_ext._C.__file__], capture_output=True, text=True).stdout
    for lib in ("libcudart", "libc10_cuda"):
        assert lib in libs, f"{sbd_ext._C.__file__} does not link {lib}:\n{libs}"
    sbd_ext.ops.check_cuda_errors()  # the CUDA error channel answers without a GPU (nothing recorded)
    print(
        f"sbd_ext {sbd_ext.__file__}: torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"cuda.is_available()={torch.cuda.is_available()}, build_info {info}"
    )


def check_ops() -> None:
    g = torch.Generator().manual_seed(0)
    ops = torch.ops.sbd_ext

    # block_attention: 2 sequences, GQA 4/2, a causal commit part and a set block, padding rows.
    B, Hq, Hkv, T, S, D = 2, 4, 2, 6, 16, 64
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    kc, vc = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    lens, n_commit, n_valid = torch.tensor([3, 7]), torch.tensor([2, 3]), torch.tensor([5, 6])
    kc2, vc2 = kc.clone(), vc.clone()
    out = ops.block_attention(q, k, v, kc, vc, lens, n_commit, n_valid, D**-0.5, 0.0, -1)
    ref = R.block_attention(q, k, v, kc2, vc2, lens, n_commit, n_valid, D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "block_attention: the caches differ from the reference's"

    # entropy_sample: greedy and sampled rows, one invalid (NaN) row.
    logits = torch.randn(5, 1000, generator=g) * 3
    logits[2, 7] = float("nan")
    for temperature in (0.0, 0.7):
        got, want = ops.entropy_sample(logits, temperature, 123, 4), R.entropy_sample(logits, temperature, 123, 4)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6, equal_nan=True)
        assert torch.equal(got[2], want[2]), f"entropy_sample T={temperature}: tokens {got[2]} != {want[2]}"

    # mask_replace: every rule.
    mask = 99
    for rule, threshold in (("eb", 0.5), ("entropy", 0.3), ("confidence", 0.6)):
        tokens = torch.full((3, 8), mask, dtype=torch.int64)
        tokens[:, 0] = 5
        proposals = torch.randint(0, 50, (3, 8), generator=g)
        entropy, max_prob = torch.rand(3, 8, generator=g), torch.rand(3, 8, generator=g)
        t1, t2 = tokens.clone(), tokens.clone()
        got = ops.mask_replace(t1, proposals, entropy, max_prob, mask, rule, threshold)
        want = R.mask_replace(t2, proposals, entropy, max_prob, mask, rule, threshold)
        assert torch.equal(t1, t2) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), rule

    # row_linear: a decoding forward's rows over SmolLM2-like shapes.
    x, w = torch.randn(9, 576, generator=g), torch.randn(130, 576, generator=g)
    torch.testing.assert_close(ops.row_linear(x, w), R.row_linear(x, w), rtol=1e-4, atol=1e-4)
    print(f"CPU smoke test passed: torch.ops.sbd_ext.{{{', '.join(OPS)}}} equal sbd_ext.reference")


if __name__ == "__main__":
    check_build()
    check_ops()
    sys.exit(0)
