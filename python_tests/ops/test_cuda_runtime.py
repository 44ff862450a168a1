"""CUDA runtime checks across the ops (skipped without an NVIDIA GPU + CUDA build): the three ops captured in one
CUDA graph, and compute-sanitizer (memcheck / racecheck / synccheck) over a small case of each op, when the tool
exists. Each op's own CUDA tests are in its test file (ops/test_<op>.py), beside its CPU tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from utils import CUDA_OK  # noqa: E402

import sbd_ext

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_OK, reason="needs an NVIDIA GPU and sbd_ext built with its CUDA kernels"),
]


def test_ops_capture_in_a_cuda_graph():
    # No host synchronisation inside the ops: all three capture into one graph and replay.
    x = (torch.randn(16, 49152, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16).cuda()
    B, Hkv, g, T, D, S = 1, 2, 4, 16, 128, 300
    q = torch.randn(B, Hkv * g, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = torch.randn(2, B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    lens, nc, nv = (torch.tensor([x], device="cuda", dtype=torch.int32) for x in (100, 0, 16))
    tokens = torch.full((1, 16), 7, device="cuda", dtype=torch.int64)

    def step():
        out = sbd_ext.block_attention(q, k, v, kc, vc, lens, nc, nv)
        ent, pmax, tok = sbd_ext.entropy_sample(x, 0.0)
        counts = sbd_ext.mask_replace(tokens, tok.view(1, 16), ent.view(1, 16), pmax.view(1, 16), 7, "eb", 0.35)
        return out, tok, counts

    eager = step()
    tokens.fill_(7)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up on a side stream, as torch.cuda.graphs recommends
    torch.cuda.current_stream().wait_stream(s)
    tokens.fill_(7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    tokens.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    assert torch.equal(captured[2][0], eager[2][0])


# ---- compute-sanitizer ------------------------------------------------------------------------------------
SANITIZER_SCRIPT = r"""
import torch, sbd_ext
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(5, 4099, device="cuda", dtype=dtype)
    x[1, 7] = float("nan")
    sbd_ext.entropy_sample(x, 0.0)
    sbd_ext.entropy_sample(x[:, 1:], 0.9, 1, 2)
    for simt in ("0", "1"):
        import os; os.environ["SBD_EXT_ATTN_SIMT"] = simt
        B, Hkv, g, T, D, S = 2, 2, 3, 17, 64, 150
        q = torch.randn(B, Hkv * g, T, D, device="cuda", dtype=dtype)
        k, v = torch.randn(2, B, Hkv, T, D, device="cuda", dtype=dtype)
        kc, vc = torch.randn(2, B, Hkv, S, D, device="cuda", dtype=dtype)
        lens = torch.tensor([0, 140], device="cuda")  # second: 140 + 17 > 150, the kernel must clamp
        sbd_ext.block_attention(q, k, v, kc, vc, lens, torch.tensor([5, 17], device="cuda"),
                                torch.tensor([12, 17], device="cuda"))
tok = torch.full((3, 16), 2, device="cuda")
sbd_ext.mask_replace(tok, torch.arange(48, device="cuda").view(3, 16), torch.rand(3, 16, device="cuda"),
                     torch.rand(3, 16, device="cuda"), 2, "eb", 0.3)
torch.cuda.synchronize()
print("sanitizer-script-ok")
"""


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "compute-sanitizer")
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer(tool):
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found (set CUDA_HOME)")
    # Without the caching allocator every tensor is its own allocation, so memcheck sees exact bounds.
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [exe, "--tool", tool, "--error-exitcode", "99", sys.executable, "-c", SANITIZER_SCRIPT]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0 and "sanitizer-script-ok" in res.stdout, (
        f"{tool} failed (rc {res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    )
