"""The CUDA kernels (csrc/cuda/kernels) run on the CPU emulator of tools/cuda_emu against the references.

For CI machines without a GPU: the kernel sources themselves execute (every thread, barrier, warp shuffle,
ldmatrix / mma.sync fragment, cp.async stage), with out-of-bounds checks. A small sweep; the larger one is
`python tools/cuda_emu/run.py --full`. Needs g++ and the CUDA headers (no GPU, no CUDA build of torch).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA_INC = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("g++") is None or not (CUDA_INC / "cuda_bf16.h").exists(), reason="needs g++ and the CUDA headers"
    ),
]

sys.path.insert(0, str(ROOT / "tools" / "cuda_emu"))
import run as emu  # noqa: E402
from utils import entropy_f64, expf_error_bound, near_one_hot_logits, sampling_cases  # noqa: E402

import sbd_ext  # noqa: E402


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


def test_gumbel_bounds_exhaustive(so):
    """Over all 2^23 draws: the noise stays below kGumbelNoiseMax, gumbel_noise_bound is above the noise with room for
    every rounding (sbd/gumbel.h), the noise is within 1e-5 of the fp64 noise, and log_f32 is within ~1 ulp."""
    out = (ctypes.c_double * 5)()
    so.emu_gumbel_bounds(out)
    max_noise, min_margin, max_err, log_rel, noise_max_constant = out
    assert 16.63 < max_noise < noise_max_constant - 1e-3, (max_noise, noise_max_constant)  # 24 ln 2 = 16.636
    assert min_margin > 5e-4, min_margin  # the bound's 1e-3 slack is barely touched by rounding
    assert max_err < 1e-5, max_err
    assert log_rel < 2.5e-7, log_rel


@pytest.mark.parametrize("case", ["randn", "peaked", "flat", "ties", "ramp"])
@pytest.mark.parametrize("num_sms", [1, 132])
def test_entropy_sample_emulated_tokens_equal_cpu(so, case, num_sms):
    """The CUDA kernel's sampled tokens equal the CPU kernel's bit for bit, and both equal the brute-force argmax of
    the exact scores (no fast path): the fast path is exact and the scores round alike on both devices."""
    x = sampling_cases()[case][:8]
    for seed, temperature in [(0, 0.3), (1, 1.0), (2, 2.5), (2**64 - 5, 0.8)]:
        cpu = sbd_ext.entropy_sample(x, temperature, seed, 77)[2]
        *_, tok, _ = emu.run_entropy_sample(so, x, temperature, seed, 77, num_sms)
        exact = emu.gumbel_argmax(so, x, temperature, seed, 77)
        assert torch.equal(tok, exact), (case, seed, tok.tolist(), exact.tolist())
        assert torch.equal(cpu, exact), (case, seed, cpu.tolist(), exact.tolist())


def test_entropy_near_one_hot_emulated(so):
    """With __expf's rounding emulated (SBD_EMULATE_DEVICE_EXPF), the CUDA kernel's near-zero entropies keep the
    relative accuracy, and test_entropy_sample.py's device-aware bound (expf_error_bound) covers its error."""
    x = near_one_hot_logits("cpu")[:, :5000].contiguous()
    truth = entropy_f64(x)
    ent, *_ = emu.run_entropy_sample(so, x, 0.0, 0, 0, num_sms=132)
    err = (ent.double() - truth).abs()
    assert (err <= 2e-5 * truth + expf_error_bound(x)).all(), (err / truth).tolist()
    wide = torch.randn(4, 20000, generator=torch.Generator().manual_seed(5)) * 8 + 100
    ent, *_ = emu.run_entropy_sample(so, wide, 0.0, 0, 0, num_sms=132)
    ref = sbd_ext.reference.entropy_sample(wide)[0].double()
    truth = entropy_f64(wide)
    allowed = 2 * (ref - truth).abs().max() + 1e-6 + expf_error_bound(wide)
    assert ((ent.double() - truth).abs() <= allowed).all()


ATTN = [  # (B, Hkv, g, T, D, S, lens, commit, valid)
    (2, 1, 3, 5, 64, 70, [0, 65], [2, 5], [5, 3]),
    (2, 2, 4, 16, 128, 300, [257, 1], [0, 16], [16, 9]),
    (1, 1, 4, 17, 64, 40, [23], [17], [17]),
    (1, 2, 1, 3, 128, 20, [19], [3], [3]),  # 19 + 3 > 20: invalid, so zero rows, no write, the error recorded
    # Lengths past int32 and int64 limits, negative, n_valid > T: each sequence invalid in its own way, none written.
    (3, 1, 2, 4, 64, 20, [2**63 - 1, 3, -1], [1, 2, 0], [4, 5, 2]),
    (2, 1, 4, 4, 128, 20, [2**31, 16], [4, 4], [2**31 + 4, 4]),  # the second sequence is valid and must be exact
    # SmolLM2's decode steps (9 q / 3 KV heads, D 64): NTP (T = 1, M = 3 packed rows: warps 0-2 one row each, warp 3
    # none) and verify at k = 4 (T = 5, M = 15), over a cache split across blocks
    (1, 3, 3, 1, 64, 600, [300], [1], [1]),
    (1, 3, 3, 5, 64, 600, [300], [1], [5]),
    # Head dim 32 (the embedded demo models): 4 chunks per row (its own swizzle), one output dim per lane.
    (2, 2, 2, 16, 32, 300, [257, 3], [16, 5], [16, 9]),
    (1, 1, 4, 33, 32, 80, [40], [20], [33]),
    # No new rows: nothing computed or appended, but the lengths are still checked (the first invalid one, 1, is
    # recorded; an H200 run found such calls accepted); and a valid T = 0 call records nothing.
    (4, 1, 2, 0, 64, 20, [0, 25, 2**31 - 2, 3], [0, 0, 0, 0], [0, 0, 0, 1]),
    (2, 2, 1, 0, 128, 8, [3, 8], [0, 0], [0, 0]),
]


# The kernels each dtype has: fp32 only the CUDA-core (simt) one, bf16 / fp16 the tensor-core (mma) one and simt.
KERNELS = [
    ("simt", torch.float32),
    *[(k, dt) for k in ("mma", "simt") for dt in (torch.bfloat16, torch.float16)],
]


@pytest.mark.parametrize(("kernel", "dtype"), KERNELS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("case", ATTN, ids=lambda c: f"g{c[2]}-T{c[3]}-D{c[4]}-S{c[5]}")
def test_block_attention_emulated(so, case, dtype, kernel):
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


FEATURES = [  # (B, Hkv, g, T, D, S, lens, commit, valid, softcap, window_left)
    (2, 1, 3, 5, 64, 70, [0, 65], [2, 5], [5, 3], 2.0, 3),  # both features, commit + block + padding rows
    (2, 2, 4, 16, 128, 300, [257, 1], [0, 16], [16, 9], 0.0, 0),  # a window of one key: each row sees itself
    # 33 cache splits (the capacity sets the count) over the rows the window leaves: [500, 700) of a 700-row cache.
    (1, 1, 4, 16, 128, 8448, [700], [0], [16], 1.5, 200),
]


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "mma"), (torch.float32, "simt"), (torch.float16, "simt")])
@pytest.mark.parametrize("case", FEATURES, ids=lambda c: f"cap{c[9]}-w{c[10]}-S{c[5]}")
def test_block_attention_features_emulated(so, case, dtype, kernel):
    """Logit soft-capping and the sliding window (sbd/block_attention_params.h) in both CUDA attention kernels."""
    B, Hkv, g, T, D, S, lens, commit, valid, softcap, window_left = case
    emu.check_block_attention(
        so, B, Hkv, g, T, D, S, lens, commit, valid, dtype, num_sms=132, simt=kernel == "simt", seed=T,
        len_dtype=torch.int32, strided_q=True, softcap=softcap, window_left=window_left,
    )  # fmt: skip


TILES = [  # (B, Hkv, g, T, D, S, lens, commit, valid): two m-tiles in one 8-warp block, and three (a block of two
    # and a block of one whose second 4 warps hold no rows), over cache splits and the new rows, at both D = 128
    # pipelines and D = 64
    (1, 2, 4, 32, 128, 700, [650], [16], [32]),
    (1, 1, 4, 40, 128, 8448, [700], [8], [40]),
    (2, 1, 8, 24, 64, 300, [290, 5], [0, 24], [24, 10]),
]


@pytest.mark.parametrize("smem", [228 * 1024, 164 * 1024, 0], ids=["h100-3-stages", "a100-2-stages", "unknown"])
@pytest.mark.parametrize("case", TILES, ids=lambda c: f"g{c[2]}-T{c[3]}-D{c[4]}-S{c[5]}")
def test_block_attention_tiles_and_stages_emulated(so, case, smem, monkeypatch):
    """The tensor-core kernel's shapes from block_attention_plan: m-tiles per block (1 or 2) and K/V stages (2 or
    3, by the shared memory per SM the harness reports: SBD_EMU_SMEM_PER_SM)."""
    monkeypatch.setenv("SBD_EMU_SMEM_PER_SM", str(smem))
    B, Hkv, g, T, D, S, lens, commit, valid = case
    emu.check_block_attention(
        so, B, Hkv, g, T, D, S, lens, commit, valid, torch.bfloat16, num_sms=132, simt=False, seed=T,
        len_dtype=torch.int64, strided_q=True,
    )  # fmt: skip
