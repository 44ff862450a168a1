"""entropy_sample against sbd_ext.reference.entropy_sample: statistics, greedy and sampled tokens, edge rows."""

import pytest
import torch
from utils import assert_close

import sbd_ext
from sbd_ext import reference as R

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _logits(n, v, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g) * scale).to(dtype).to(device)


@pytest.mark.parametrize("vocab", [111, 49152, 128256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_matches_reference(device, cpu_isa, vocab, dtype, temperature):
    n = 3 if vocab > 50000 else 16
    x = _logits(n, vocab, dtype, device, seed=vocab)
    ent, pmax, tok = sbd_ext.entropy_sample(x, temperature, seed=1234, offset=7)
    r_ent, r_pmax, r_tok = R.entropy_sample(x, temperature, seed=1234, offset=7)
    # Both compute in fp32 from the same (upcast) inputs, so the fp32 bar applies for every input dtype.
    assert_close(ent, r_ent, torch.float32, msg="entropy")
    assert_close(pmax, r_pmax, torch.float32, msg="max_prob")
    assert_close(tok, r_tok, msg="token")
    assert ent.dtype == pmax.dtype == torch.float32 and tok.dtype == torch.int64


def test_single_row_and_odd_shapes(device, cpu_isa):
    for n, v in [(1, 1), (1, 7), (7, 1025), (1, 128256), (5, 16385)]:
        x = _logits(n, v, torch.float32, device, seed=v)
        for t in (0.0, 1.0):
            got, ref = sbd_ext.entropy_sample(x, t, 3, 4), R.entropy_sample(x, t, 3, 4)
            assert_close(got[0], ref[0], msg=f"entropy {n}x{v}")
            assert_close(got[2], ref[2], msg=f"token {n}x{v}")


def test_entropy_accuracy_vs_float64(device):
    """Our single-pass statistics are at least as accurate as the PyTorch fp32 composite (vs an fp64 truth)."""
    x = _logits(16, 128256, torch.float32, device, seed=5, scale=8.0) + 100.0  # large offset: cancellation bait
    truth = torch.special.entr(torch.softmax(x.double().cpu(), -1)).sum(-1)
    ours = sbd_ext.entropy_sample(x)[0].double().cpu()
    ref = R.entropy_sample(x)[0].double().cpu()
    assert (ours - truth).abs().max() <= 2 * (ref - truth).abs().max() + 1e-6


def test_non_contiguous_rows(device, cpu_isa):
    big = _logits(6, 3000, torch.bfloat16, device)
    x = big[::2, 100:2100]  # row stride 6000, unit stride along V
    assert not x.is_contiguous()
    for t in (0.0, 0.5):
        got, ref = sbd_ext.entropy_sample(x, t, 9, 9), R.entropy_sample(x, t, 9, 9)
        assert_close(got[0], ref[0], torch.float32)
        assert_close(got[2], ref[2])


def test_banned_tokens_never_chosen(device, cpu_isa):
    x = _logits(64, 5000, torch.float32, device)
    allowed = torch.tensor([3, 17, 4096, 4999])
    banned = torch.ones(5000, dtype=torch.bool)
    banned[allowed] = False
    x[:, banned.to(device)] = float("-inf")
    for t in (0.0, 2.0):
        for offset in range(5):
            ent, pmax, tok = sbd_ext.entropy_sample(x, t, seed=1, offset=offset)
            assert torch.isin(tok.cpu(), allowed).all()
            assert torch.isfinite(ent).all() and (ent <= torch.log(torch.tensor(4.0)) + 1e-5).all()
    ref = R.entropy_sample(x)
    assert_close(sbd_ext.entropy_sample(x)[0], ref[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_invalid_rows(device, cpu_isa, dtype):
    """NaN, +inf or all -inf rows give (NaN, NaN, -1) and leave the other rows untouched."""
    x = _logits(5, 20000, dtype, device)
    x[1, 17000] = float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    for t in (0.0, 1.0):
        ent, pmax, tok = sbd_ext.entropy_sample(x, t)
        assert torch.isnan(ent[1:4]).all() and torch.isnan(pmax[1:4]).all()
        assert (tok[1:4] == -1).all()
        ref = R.entropy_sample(x, t)
        assert_close(ent, ref[0], torch.float32)
        assert_close(tok, ref[2])


def test_one_hot_row(device):
    x = torch.full((2, 1000), -1e4, device=device)
    x[0, 42] = 50.0
    x[1] = 0.0  # uniform
    ent, pmax, tok = sbd_ext.entropy_sample(x)
    assert tok[0] == 42 and ent[0].item() == pytest.approx(0.0, abs=1e-6) and pmax[0].item() == pytest.approx(1.0)
    assert ent[1].item() == pytest.approx(torch.log(torch.tensor(1000.0)).item(), rel=1e-6)
    assert tok[1] == 0  # ties go to the first index, as torch.argmax


def test_sampling_is_reproducible(device):
    x = _logits(16, 49152, torch.float32, device, scale=1.0)
    a = sbd_ext.entropy_sample(x, 1.0, seed=42, offset=3)[2]
    b = sbd_ext.entropy_sample(x, 1.0, seed=42, offset=3)[2]
    c = sbd_ext.entropy_sample(x, 1.0, seed=42, offset=4)[2]
    d = sbd_ext.entropy_sample(x, 1.0, seed=43, offset=3)[2]
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    # 64-bit seeds and offsets use all their bits
    e = sbd_ext.entropy_sample(x, 1.0, seed=42 + (1 << 40), offset=3)[2]
    f = sbd_ext.entropy_sample(x, 1.0, seed=2**64 - 1, offset=2**63 + 5)[2]
    assert not torch.equal(a, e)
    assert torch.equal(f, R.entropy_sample(x, 1.0, seed=2**64 - 1, offset=2**63 + 5)[2])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_distribution(device, temperature):
    """Token frequencies over many independent rows match softmax(logits / T)."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    logits[4] = float("-inf")
    n = 40000
    x = logits.expand(n, -1).contiguous().to(device)
    tok = sbd_ext.entropy_sample(x, temperature, seed=7, offset=0)[2].cpu()
    freq = torch.bincount(tok, minlength=12).double() / n
    p = torch.softmax(logits.double() / temperature, -1)
    assert freq[4] == 0
    # 5 standard errors of a binomial proportion, per token
    se = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-9).all(), (freq, p)


def test_empty_batch(device):
    x = torch.empty(0, 100, device=device)
    ent, pmax, tok = sbd_ext.entropy_sample(x)
    assert ent.shape == pmax.shape == tok.shape == (0,)


def test_opcheck_and_compile():
    x = _logits(4, 300, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.sbd_ext.entropy_sample.default, (x, 0.0, 1, 2))
    torch.library.opcheck(torch.ops.sbd_ext.entropy_sample.default, (x.bfloat16(), 0.7, 1, 2))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        ent, pmax, tok = torch.ops.sbd_ext.entropy_sample(x * 2.0, 0.0, 0, 0)
        return ent + 1.0, tok

    ent, tok = f(x)
    ref = R.entropy_sample(x * 2.0)
    assert_close(ent - 1.0, ref[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(tok, ref[2])


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (lambda: torch.zeros(2, 10, dtype=torch.int64), {}, "logits must have dtype"),
        (lambda: torch.zeros(10), {}, r"logits must be 2-D \[N, V\]"),
        (lambda: torch.zeros(2, 3, 10), {}, r"logits must be 2-D \[N, V\]"),
        (lambda: torch.zeros(2, 0), {}, "non-empty vocabulary"),
        (lambda: torch.zeros(10, 4).t(), {}, "contiguous in its last dimension"),
        (lambda: torch.zeros(2, 10), {"temperature": -1.0}, "temperature must be"),
        (lambda: torch.zeros(2, 10), {"temperature": float("nan")}, "temperature must be"),
        (lambda: torch.zeros(2, 10), {"seed": 2**64}, "seed must fit in 64 bits"),
        (lambda: torch.zeros(2, 10), {"offset": -(2**63) - 1}, "offset must fit in 64 bits"),
    ],
)
def test_bad_inputs(make, kwargs, match):
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        sbd_ext.entropy_sample(make(), **kwargs)
