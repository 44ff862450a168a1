"""The CUDA kernels (csrc/cuda/kernels) run on the CPU emulator of tools/cuda_emu against the references.

For CI machines without a GPU: the kernel sources themselves execute (every thread, barrier, warp shuffle,
ldmatrix / mma.sync fragment, cp.async stage), with out-of-bounds checks. A small sweep; the larger one is
`python tools/cuda_emu/run.py --full`. Needs g++ and the CUDA headers (no GPU, no CUDA build of torch).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_INC = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("g++") is None or not (CUDA_INC / "cuda_bf16.h").exists(), reason="needs g++ and the CUDA headers"
    ),
]

sys.path.insert(0, str(ROOT / "tools" / "cuda_emu"))
import run as emu  # noqa: E402


@pytest.fixture(scope="module")
def so(tmp_path_factory):
    lib = emu.build(tmp_path_factory.mktemp("cuda_emu"))
    lib.emu_set_late_async(1)  # copies land only at cp.async.wait_group, destinations poisoned until then
    lib.emu_set_skew(0x5EED)  # warps run ahead of each other up to the next __syncthreads
    return lib


@pytest.mark.parametrize("rule", ["eb", "entropy", "confidence"])
@pytest.mark.parametrize("B,K", [(3, 16), (2, 33), (1, 1024)])
def test_mask_replace_emulated(so, B, K, rule):
    emu.check_mask_replace(so, B, K, rule, 0.3, seed=K, transposed=K % 2 == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("num_sms", [1, 132])  # one block per row / the row split across blocks + merge
def test_entropy_sample_emulated(so, dtype, temperature, num_sms):
    emu.check_entropy_sample(so, 6, 4099, dtype, temperature, num_sms, seed=1, pad=3, offset_elems=1)


ATTN = [  # (B, Hkv, g, T, D, S, lens, commit, valid)
    (2, 1, 3, 5, 64, 70, [0, 65], [2, 5], [5, 3]),
    (2, 2, 4, 16, 128, 300, [257, 1], [0, 16], [16, 9]),
    (1, 1, 4, 17, 64, 40, [23], [17], [17]),
    (1, 2, 1, 3, 128, 20, [19], [3], [3]),  # 19 + 3 > 20: invalid, so zero rows, no write, the error recorded
    # Lengths past int32 and int64 limits, negative, n_valid > T: each sequence invalid in its own way, none written.
    (3, 1, 2, 4, 64, 20, [2**63 - 1, 3, -1], [1, 2, 0], [4, 5, 2]),
    (2, 1, 4, 4, 128, 20, [2**31, 16], [4, 4], [2**31 + 4, 4]),  # the second sequence is valid and must be exact
]


@pytest.mark.parametrize("kernel", ["mma", "simt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ATTN, ids=lambda c: f"g{c[2]}-T{c[3]}-D{c[4]}-S{c[5]}")
def test_block_attention_emulated(so, case, dtype, kernel):
    if dtype == torch.float32 and kernel == "mma":
        pytest.skip("fp32 has only the CUDA-core kernel")
    B, Hkv, g, T, D, S, lens, commit, valid = case
    emu.check_block_attention(
        so,
        B,
        Hkv,
        g,
        T,
        D,
        S,
        lens,
        commit,
        valid,
        dtype,
        num_sms=132,
        simt=kernel == "simt",
        seed=T,
        len_dtype=torch.int64,
        strided_q=True,
    )


MERGE = [  # (B, Hkv, g, T, D, S, lens, commit, valid)
    # Many partials for the merge (the capacity S sets the split count, the length what is read): 64 cache splits +
    # the new rows at D = 64 (65 partials, three rounds of 32 lanes), of which the 1000 keys fill 16; 33 + 1 at
    # D = 128, 11 filled. The workspace starts as NaN: reading an empty partial's O rows would show.
    (1, 1, 2, 8, 64, 16448, [1000], [3], [8]),
    (1, 1, 4, 16, 128, 8448, [700], [0], [16]),
]


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "mma"), (torch.float32, "simt")])
@pytest.mark.parametrize("case", MERGE, ids=lambda c: f"D{c[4]}-S{c[5]}")
def test_block_attention_merge_many_splits_emulated(so, case, dtype, kernel):
    B, Hkv, g, T, D, S, lens, commit, valid = case
    splits = emu.check_block_attention(
        so, B, Hkv, g, T, D, S, lens, commit, valid, dtype, num_sms=132, simt=kernel == "simt", seed=D,
        len_dtype=torch.int32,
    )  # fmt: skip
    assert splits > 32, f"the case should give more partials than lanes, got {splits} splits"
