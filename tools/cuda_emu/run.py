"""Run the CUDA kernels of csrc/cuda/kernels on the CPU emulator (tools/cuda_emu/emu.h) against sbd_ext.reference.

For a machine without a GPU: this executes the kernel sources themselves (launchers, work splits, every thread,
barriers, warp shuffles, ldmatrix / mma.sync fragment layouts, cp.async pipelining), not a re-implementation.
Every tensor sits in a larger buffer of sentinel values that must survive (out-of-bounds writes), and the
emulator checks each cp.async / ldmatrix / 16-byte load address (out-of-bounds reads).

    python tools/cuda_emu/run.py            # the quick sweep (~1-3 min on 2 cores)
    python tools/cuda_emu/run.py --full     # more shapes and both cp.async completion modes

Needs g++, the CUDA headers (CUDA_HOME, default /usr/local/cuda) and the CPU torch; not the built extension.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import itertools
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import types

import torch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def load_reference():
    """sbd_ext/reference.py without the package (no compiled extension needed): it and its sibling samplers.py are
    loaded as modules of a stand-in package over the sbd_ext folder, whose __init__ never runs."""
    if "sbd_standalone" not in sys.modules:
        pkg = types.ModuleType("sbd_standalone")
        pkg.__path__ = [str(ROOT / "sbd_ext")]
        sys.modules["sbd_standalone"] = pkg
    return importlib.import_module("sbd_standalone.reference")


ref = load_reference()
TOL = ref.TOLERANCES
# sbd::LengthError codes (csrc/include/sbd/block_attention_params.h) by the reference's names.
LENGTH_ERRORS = {"cache_lens": 1, "n_commit": 2, "n_valid": 3, "n_valid > T": 4, "n_commit > n_valid": 5,
                 "cache overflow": 6}  # fmt: skip


class BlockAttentionStatus(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("ready", ctypes.c_int32)] + [
        (name, ctypes.c_int64) for name in ("b", "cache_len", "n_commit", "n_valid", "T", "S")
    ]


def build(out: pathlib.Path) -> ctypes.CDLL:
    cuda_inc = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    subprocess.run([sys.executable, str(HERE / "transform.py"), str(ROOT / "csrc/cuda/kernels"), str(out)], check=True)
    lib = out / "libsbd_cuda_emu.so"
    cmd = [
        "g++",
        "-std=c++17",
        "-O1",
        "-g",
        "-fPIC",
        "-shared",
        "-w",
        f"-I{out}",
        f"-I{HERE}",
        f"-I{ROOT / 'csrc/include'}",
        f"-I{cuda_inc}",
        # sbd::fast_exp rounds x log2(e) to fp32 as the device's __expf does (sbd/entropy_state.h)
        "-DSBD_EMULATE_DEVICE_EXPF",
        str(HERE / "harness.cpp"),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(str(lib))
    P, I64, INT, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    so.emu_register_range.argtypes = [P, ctypes.c_size_t]
    so.emu_set_late_async.argtypes = [INT]
    so.emu_set_skew.argtypes = [ctypes.c_uint64]
    so.emu_mask_replace.argtypes = [P, P, P, P, P, P, P, I64, I64, I64, INT, D]
    so.emu_entropy_sample.argtypes = [P, INT, I64, I64, I64, D, ctypes.c_uint64, ctypes.c_uint64, P, P, P, INT, P]
    so.emu_block_attention.argtypes = [P, P, D, D, I64, INT, INT, INT, P, P]
    so.emu_gumbel_bounds.argtypes = [P]
    so.emu_gumbel_argmax.argtypes = [P, I64, I64, D, ctypes.c_uint64, ctypes.c_uint64, P]
    return so


# ---- guarded tensors --------------------------------------------------------------------------------------
class Guarded:
    """A tensor with the given strides inside a buffer of sentinels; check() asserts no write outside the view."""

    GUARD = 64  # elements each side

    def __init__(self, t: torch.Tensor, strides=None, offset: int = 0, sentinel=None):
        strides = strides or t.contiguous().stride()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, strides, strict=True)) if t.numel() else 0
        self.flat = torch.empty(extent + 2 * self.GUARD + offset, dtype=t.dtype)
        if sentinel is None:
            sentinel = -7777 if not t.is_floating_point() else 1234.5
        self.flat.fill_(sentinel)
        self.view = self.flat.as_strided(t.shape, strides, self.GUARD + offset)
        self.view.copy_(t)
        self.before = self.flat.clone()
        idx = torch.arange(self.flat.numel()).as_strided(t.shape, strides, self.GUARD + offset)
        self.outside = torch.ones(self.flat.numel(), dtype=torch.bool)
        self.outside[idx.flatten()] = False
        self.start = (self.GUARD + offset) * t.element_size()
        self.nbytes = extent * t.element_size()

    def ptr(self) -> int:
        return self.flat.data_ptr() + self.start

    def register(self, so) -> None:
        if self.nbytes:
            so.emu_register_range(self.ptr(), self.nbytes)

    def check(self, name: str) -> None:
        a, b = self.flat[self.outside], self.before[self.outside]
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        if not bool(same.all()):
            raise AssertionError(f"{name}: {int((~same).sum())} elements written outside the tensor")


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    a, e = actual.double(), expected.double()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    if bad.any():
        i = bad.nonzero()[:4].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} differ, max err {(a - e).abs().nan_to_num(1e9).max():.3g}; "
            f"first at {i}: got {[a[tuple(j)].item() for j in i]} expected {[e[tuple(j)].item() for j in i]}"
        )


# ---- mask_replace -------------------------------------------------------------------------------------------
def check_mask_replace(so, B, K, rule, threshold, seed, transposed=False):
    g = torch.Generator().manual_seed(seed)
    mask_id = 5
    tokens = torch.randint(0, 9, (B, K), generator=g)
    tokens[torch.rand(B, K, generator=g) < 0.6] = mask_id
    proposals = torch.randint(-1, 12, (B, K), generator=g)
    ent = torch.rand(B, K, generator=g) * 0.3
    ent[torch.rand(B, K, generator=g) < 0.1] = float("nan")
    ent[:, : K // 3] = 0.05  # ties
    conf = torch.rand(B, K, generator=g)
    conf[torch.rand(B, K, generator=g) < 0.1] = float("nan")
    exp_tok = tokens.clone()
    exp_rev, exp_rem = ref.mask_replace(exp_tok, proposals, ent, conf, mask_id, rule, threshold)
    st = (1, B) if transposed else None  # column-major: non-contiguous rows
    gt, gp, ge, gc = Guarded(tokens, st), Guarded(proposals, st), Guarded(ent, st), Guarded(conf, st)
    rev, rem = Guarded(torch.zeros(B, dtype=torch.int64)), Guarded(torch.zeros(B, dtype=torch.int64))
    strides = (ctypes.c_int64 * 8)(*gt.view.stride(), *gp.view.stride(), *ge.view.stride(), *gc.view.stride())
    rule_id = {"eb": 0, "entropy": 1, "confidence": 2}[rule]
    so.emu_clear_ranges()
    err = so.emu_mask_replace(
        gt.ptr(), gp.ptr(), ge.ptr(), gc.ptr(), rev.ptr(), rem.ptr(), strides, B, K, mask_id, rule_id, threshold
    )
    assert err == 0, f"mask_replace launch error {err}"
    for name, gg in (
        ("tokens", gt),
        ("proposals", gp),
        ("entropy", ge),
        ("max_prob", gc),
        ("n_rev", rev),
        ("n_rem", rem),
    ):
        gg.check(f"mask_replace {name}")
    assert torch.equal(gt.view, exp_tok), f"mask_replace tokens differ (B={B} K={K} {rule} {threshold})"
    assert torch.equal(rev.view, exp_rev) and torch.equal(rem.view, exp_rem), "mask_replace counts differ"


# ---- entropy_sample -----------------------------------------------------------------------------------------
def make_logits(N, V, dtype, seed, special=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 3
    if special and N >= 5 and V >= 4:
        x[1, V // 2] = float("nan")
        x[2, V // 3] = float("inf")
        x[3, :] = float("-inf")
        x[4, :] = torch.randint(0, 3, (V,), generator=g).float()  # many ties at the max
        x[0, :: max(1, V // 7)] = float("-inf")
    return x.to(dtype)


def run_entropy_sample(so, x, temperature, seed, offset, num_sms, pad=0, offset_elems=0):
    """The emulated CUDA entropy_sample of logits x [N, V] (rows padded by `pad`, starting `offset_elems` past an
    aligned address): (entropy, max_prob, token, splits), after checking that nothing outside the outputs changed."""
    N, V = x.shape
    gx = Guarded(x, (V + pad, 1), offset=offset_elems)
    ent = Guarded(torch.zeros(N))
    mp = Guarded(torch.zeros(N))
    tok = Guarded(torch.zeros(N, dtype=torch.int64))
    so.emu_clear_ranges()
    gx.register(so)
    splits = ctypes.c_int(0)
    err = so.emu_entropy_sample(
        gx.ptr(),
        DTYPES[x.dtype],
        N,
        V,
        V + pad,
        temperature,
        seed,
        offset,
        ent.ptr(),
        mp.ptr(),
        tok.ptr(),
        num_sms,
        ctypes.byref(splits),
    )
    what = f"entropy_sample N={N} V={V} {x.dtype} T={temperature} sms={num_sms} splits={splits.value}"
    assert err == 0, f"{what}: error {err}"
    for name, gg in (("logits", gx), ("entropy", ent), ("max_prob", mp), ("token", tok)):
        gg.check(f"{what} {name}")
    return ent.view, mp.view, tok.view, splits.value


def gumbel_argmax(so, x, temperature, seed, offset):
    """Brute-force Gumbel-max tokens of x [N, V]: every exact score (sbd::gumbel_score), no fast path."""
    x = x.float().contiguous()
    tok = torch.zeros(x.shape[0], dtype=torch.int64)
    so.emu_gumbel_argmax(x.data_ptr(), x.shape[0], x.shape[1], temperature, seed, offset, tok.data_ptr())
    return tok


def check_entropy_sample(so, N, V, dtype, temperature, num_sms, seed, pad=0, offset_elems=0):
    x = make_logits(N, V, dtype, seed)
    s, o = 0x1234_5678_9ABC_DEF0 + seed, 17 + seed
    e_ent, e_mp, e_tok = ref.entropy_sample(x, temperature, s, o)
    ent, mp, got, splits = run_entropy_sample(so, x, temperature, s, o, num_sms, pad, offset_elems)
    what = f"entropy_sample N={N} V={V} {dtype} T={temperature} sms={num_sms} splits={splits}"
    # fast_exp is the emulated __expf here (SBD_EMULATE_DEVICE_EXPF): entropies carry the device's error.
    close(ent, e_ent, 1e-5, 1e-4, f"{what} entropy")
    close(mp, e_mp, 1e-6, 1e-5, f"{what} max_prob")
    if temperature == 0.0:
        assert torch.equal(got, e_tok), f"{what}: tokens {got.tolist()} != {e_tok.tolist()}"
    else:
        # Exactly the brute-force argmax of the exact scores (the fast path skips nothing that could win) ...
        valid = e_tok >= 0
        exact = gumbel_argmax(so, x, temperature, s, o)
        assert torch.equal(got[valid], exact[valid]), f"{what}: tokens {got.tolist()} != exact {exact.tolist()}"
        # ... and the reference's, but where torch.log rounds a score 1 ulp apart from sbd::log_f32 (a near-tie).
        u = ref.philox_uniform(N, V, s, o).double()
        score = x.double() / temperature - torch.log(-torch.log(u))
        for r in range(N):
            if int(got[r]) != int(e_tok[r]):
                assert int(e_tok[r]) >= 0 and int(got[r]) >= 0, f"{what}: row {r} validity differs"
                gap = float(score[r, e_tok[r]] - score[r, got[r]])
                assert abs(gap) < 1e-4, f"{what}: row {r} token {int(got[r])} != {int(e_tok[r])} (gap {gap})"
    return splits


# ---- block_attention ----------------------------------------------------------------------------------------
def check_block_attention(
    so, B, Hkv, g, T, D, S, lens, commit, valid, dtype, num_sms, simt, seed, len_dtype, strided_q=False,
    softcap=0.0, window_left=-1,
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    Hq = Hkv * g
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    vc = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)

    def as_lengths(vals, dtype):  # int64 where a value does not fit int32
        return torch.tensor(vals, dtype=torch.int64 if any(not -(2**31) <= x < 2**31 for x in vals) else dtype)

    cl, nc, nv = as_lengths(lens, len_dtype), as_lengths(commit, len_dtype), as_lengths(valid, torch.int32)
    scale = D**-0.5
    # Invalid lengths (negative, n_commit > n_valid, n_valid > T, a cache overflow, values past int32): the kernel
    # must treat the sequence as empty (zero output rows, cache untouched) and record the first such sequence.
    errors = [ref.block_attention_length_error(lens[b], commit[b], valid[b], T, S) for b in range(B)]
    e_kc, e_vc = kc.clone(), vc.clone()
    e_out = torch.zeros(B, T, Hq, D, dtype=dtype)
    for b in range(B):
        if errors[b] is None:
            sl = slice(b, b + 1)
            e_out[sl] = ref.block_attention(
                q[sl], k[sl], v[sl], e_kc[sl], e_vc[sl], cl[sl], nc[sl], nv[sl].long(), scale, softcap, window_left
            )
    # q as the transpose of a [B, T, Hq, D] tensor (what a model's projection gives), or contiguous.
    q_strides = (T * Hq * D, D, Hq * D, 1) if strided_q else None
    gq, gk, gv = Guarded(q, q_strides), Guarded(k), Guarded(v)
    gkc, gvc = Guarded(kc), Guarded(vc)
    out = Guarded(torch.zeros(B, T, Hq, D, dtype=dtype))
    gl, gc, gn = Guarded(cl), Guarded(nc), Guarded(nv)
    so.emu_clear_ranges()
    for gg in (gq, gk, gv, gkc, gvc):
        gg.register(so)
    ptrs = (ctypes.c_void_p * 9)(
        gq.ptr(), gk.ptr(), gv.ptr(), gkc.ptr(), gvc.ptr(), out.ptr(), gl.ptr(), gc.ptr(), gn.ptr()
    )
    ints = (ctypes.c_int64 * 24)(
        int(cl.dtype == torch.int64),
        int(nc.dtype == torch.int64),
        int(nv.dtype == torch.int64),
        *gq.view.stride()[:3],
        *gk.view.stride()[:3],
        *gv.view.stride()[:3],
        *gkc.view.stride()[:3],
        *gvc.view.stride()[:3],
        B,
        Hq,
        Hkv,
        T,
        S,
        D,
    )
    splits = ctypes.c_int(0)
    status = BlockAttentionStatus()
    err = so.emu_block_attention(
        ptrs, ints, scale, softcap, window_left, DTYPES[dtype], num_sms, int(simt), ctypes.byref(splits),
        ctypes.byref(status),
    )  # fmt: skip
    what = (
        f"block_attention B={B} Hkv={Hkv} g={g} T={T} D={D} S={S} lens={lens} commit={commit} valid={valid} "
        f"{dtype} sms={num_sms} simt={simt} splits={splits.value} softcap={softcap} window_left={window_left}"
    )
    assert err == 0, f"{what}: error {err}"
    for name, gg in (("q", gq), ("k", gk), ("v", gv), ("k_cache", gkc), ("v_cache", gvc), ("out", out)):
        gg.check(f"{what} {name}")
    assert torch.equal(gkc.view, e_kc) and torch.equal(gvc.view, e_vc), f"{what}: caches differ"
    if any(e is not None for e in errors):
        b = status.b  # the first invalid sequence, as the CPU's error names it, whatever order the blocks ran in
        first = next(i for i, e in enumerate(errors) if e is not None)
        assert status.ready == 1 and b == first, f"{what}: recorded sequence {b} (ready {status.ready}), not {first}"
        assert status.code == LENGTH_ERRORS[errors[b]], f"{what}: recorded {status.code} for {errors[b]}"
        got = (status.cache_len, status.n_commit, status.n_valid, status.T, status.S)
        assert got == (lens[b], commit[b], valid[b], T, S), f"{what}: recorded {got}"
    else:
        assert status.ready == 0 and status.code == 0, f"{what}: valid lengths recorded as error {status.code}"
    atol, rtol = TOL[dtype]
    close(out.view.float(), e_out.float(), atol, rtol, what)
    return splits.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--only", choices=["mask_replace", "entropy_sample", "block_attention"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        so = build(pathlib.Path(tmp))
        print(f"built the emulated kernels in {time.time() - t0:.0f}s", flush=True)
        # (late cp.async completion, skewed warp scheduling): the quick run uses the mode that finds most.
        modes = [(1, 1), (0, 0), (1, 0)] if args.full else [(1, 1)]
        n = 0
        for late, skew in modes:
            so.emu_set_late_async(late)
            so.emu_set_skew(0x5EED if skew else 0)
            mode = ("late" if late else "early") + " cp.async, " + ("skewed" if skew else "lockstep") + " warps"
            if args.only in (None, "mask_replace"):
                t0 = time.time()
                cases = [(1, 1), (3, 16), (2, 7), (2, 33), (1, 1024)] + ([(4, 100), (2, 0)] if args.full else [])
                for (B, K), rule in itertools.product(cases, ["eb", "entropy", "confidence"]):
                    for thr in (0.0, 0.1, 0.5):
                        check_mask_replace(so, B, K, rule, thr, seed=B * 1000 + K, transposed=K % 2 == 1)
                        n += 1
                print(f"mask_replace ok ({mode}, {time.time() - t0:.0f}s)", flush=True)
            if args.only in (None, "entropy_sample"):
                t0 = time.time()
                shapes = [(1, 1), (5, 7), (6, 1000), (16, 4099), (3, 49152)]
                if args.full:
                    shapes += [(16, 128256), (1, 128256), (7, 65)]
                for (N, V), dtype, temp in itertools.product(shapes, DTYPES, [0.0, 0.7]):
                    for sms, pad, off in ((1, 0, 0), (132, 3, 1)):
                        check_entropy_sample(so, N, V, dtype, temp, sms, seed=N + V, pad=pad, offset_elems=off)
                        n += 1
                print(f"entropy_sample ok ({mode}, {time.time() - t0:.0f}s)", flush=True)
            if args.only in (None, "block_attention"):
                t0 = time.time()
                # (B, Hkv, g, T, D, S, lens, commit, valid)
                cases = [
                    (1, 1, 1, 1, 64, 0, [0], [1], [1]),  # empty cache, one row
                    (2, 1, 3, 5, 64, 70, [0, 65], [2, 5], [5, 3]),  # commit + block + padding, cache writes
                    (2, 2, 4, 16, 128, 300, [257, 1], [0, 16], [16, 9]),
                    (1, 1, 4, 17, 64, 40, [23], [17], [17]),  # M = 68 rows: two m-tiles, causal only
                    (1, 2, 1, 3, 128, 20, [19], [3], [3]),  # cache overflow: 19 + 3 > 20, nothing may be written
                    (3, 1, 2, 4, 64, 20, [2**63 - 1, 3, -1], [1, 2, 0], [4, 5, 2]),  # int64 extremes, n_valid > T
                ]
                if args.full:
                    cases += [
                        (1, 1, 3, 33, 64, 600, [520], [16], [33]),
                        (2, 1, 4, 64, 128, 140, [70, 0], [32, 64], [64, 40]),  # M = 256, several key tiles
                        (1, 3, 3, 16, 64, 1100, [1030], [0], [16]),  # SmolLM2-like, block rows only
                    ]
                for case, dtype in itertools.product(cases, DTYPES):
                    for sms, simt in ((1, False), (132, False), (132, True)):
                        if simt and dtype == torch.float32:
                            continue
                        B, Hkv, g, T, D, S, lens, commit, valid = case
                        len_dtype = torch.int64 if n % 2 else torch.int32
                        check_block_attention(
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
                            sms,
                            simt,
                            seed=n,
                            len_dtype=len_dtype,
                            strided_q=sms == 132,
                        )
                        n += 1
                print(f"block_attention ok ({mode}, {time.time() - t0:.0f}s)", flush=True)
        print(f"all {n} emulated cases agree with sbd_ext.reference ({so.emu_launches()} kernel launches)")


if __name__ == "__main__":
    main()
