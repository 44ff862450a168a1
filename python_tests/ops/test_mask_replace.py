"""mask_replace against sbd_ext.reference.mask_replace, and each acceptance rule's defining property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from utils import assert_close, cuda_only

import sbd_ext
from sbd_ext import reference as R

MASK = 99


def _case(B, K, seed, p_mask=0.7, ties=False, invalid=0.0, nan=0.0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (B, K), generator=g)
    tokens[torch.rand(B, K, generator=g) < p_mask] = MASK
    proposals = torch.randint(0, 50, (B, K), generator=g)
    proposals[torch.rand(B, K, generator=g) < invalid] = -1
    ent = torch.rand(B, K, generator=g) * 2
    if ties:
        ent = (ent * 4).round() / 4  # many equal entropies: the tie order by position matters
    ent[torch.rand(B, K, generator=g) < nan] = float("nan")
    pmax = torch.rand(B, K, generator=g)
    if ties:
        pmax = (pmax * 4).round() / 4
    return tokens, proposals, ent, pmax


def _run_both(tokens, proposals, ent, pmax, rule, thr, device):
    t_ours = tokens.clone().to(device)
    counts = sbd_ext.mask_replace(t_ours, proposals.to(device), ent.to(device), pmax.to(device), MASK, rule, thr)
    t_ref = tokens.clone()
    ref_counts = R.mask_replace(t_ref, proposals, ent, pmax, MASK, rule, thr)
    return t_ours.cpu(), [c.cpu() for c in counts], t_ref, ref_counts


@pytest.mark.parametrize("B", [1, 3, 64])
@pytest.mark.parametrize("K", [1, 4, 16, 33])
@pytest.mark.parametrize("rule, thr", [("eb", 0.0), ("eb", 0.35), ("eb", 1.5), ("entropy", 0.5), ("confidence", 0.6)])
@pytest.mark.parametrize("ties", [False, True])
def test_matches_reference(device, B, K, rule, thr, ties):
    case = _case(B, K, seed=B * 1000 + K, ties=ties, invalid=0.1, nan=0.05)
    t_ours, counts, t_ref, ref_counts = _run_both(*case, rule, thr, device)
    assert_close(t_ours, t_ref, msg="tokens")
    assert_close(counts[0], ref_counts[0], msg="n_revealed")
    assert_close(counts[1], ref_counts[1], msg="n_remaining")


@settings(max_examples=200, deadline=None)
@given(
    K=st.integers(1, 24),
    ent=st.lists(st.floats(0, 3, width=32), min_size=24, max_size=24),
    masked=st.lists(st.booleans(), min_size=24, max_size=24),
    gamma=st.floats(0, 4),
)
def test_eb_rule_property(K, ent, masked, gamma):
    """EB reveals exactly the largest entropy-sorted prefix whose entropies, all but the last, sum to <= gamma."""
    e = torch.tensor(ent[:K]).view(1, K)
    m = torch.tensor(masked[:K]).view(1, K)
    tokens = torch.where(m, torch.tensor(MASK), torch.tensor(7))
    proposals = torch.arange(K).view(1, K)
    t = tokens.clone()
    n_rev, n_rem = sbd_ext.mask_replace(t, proposals, e, torch.rand(1, K), MASK, "eb", gamma)
    revealed = (tokens == MASK) & (t != MASK)
    n_masked = int(m.sum())
    assert int(n_rev) == int(revealed.sum()) and int(n_rem) == n_masked - int(n_rev)
    assert torch.equal(t[revealed], proposals[revealed])  # revealed positions get their proposal
    assert torch.equal(t[~m], tokens[~m])  # known tokens untouched
    if n_masked == 0:
        assert int(n_rev) == 0
        return
    order = sorted(range(K), key=lambda i: (float(e[0, i]), i))
    order = [i for i in order if m[0, i]]
    s = int(n_rev)
    assert s >= 1
    assert set(order[:s]) == set(revealed[0].nonzero().flatten().tolist())
    sums = [sum(float(e[0, j]) for j in order[:r]) for r in range(len(order) + 1)]
    assert sums[s - 1] <= gamma + 1e-6  # the revealed prefix obeys the bound (all but its largest entropy)
    if s < len(order):
        assert sums[s] > gamma - 1e-6  # and is the largest such prefix


@settings(max_examples=100, deadline=None)
@given(K=st.integers(1, 16), vals=st.lists(st.floats(0, 1, width=32), min_size=16, max_size=16), thr=st.floats(0, 1))
def test_threshold_rules_property(K, vals, thr):
    v = torch.tensor(vals[:K]).view(1, K)
    tokens = torch.full((1, K), MASK)
    proposals = torch.arange(K).view(1, K) + 1
    # entropy threshold: every H < gamma, else exactly the argmin
    t = tokens.clone()
    sbd_ext.mask_replace(t, proposals, v, torch.zeros(1, K), MASK, "entropy", thr)
    expect = v[0].double() < thr  # the op compares the fp32 value with the threshold exactly (in fp64)
    if not expect.any():
        expect[int(torch.argmin(v[0]))] = True
    assert torch.equal(t[0] != MASK, expect)
    # confidence threshold: every p > tau, else exactly the argmax
    t = tokens.clone()
    sbd_ext.mask_replace(t, proposals, torch.zeros(1, K), v, MASK, "confidence", thr)
    expect = v[0].double() > thr
    if not expect.any():
        expect[int(torch.argmax(v[0]))] = True
    assert torch.equal(t[0] != MASK, expect)


def test_no_masked_and_all_masked(device):
    tokens = torch.tensor([[1, 2, 3, 4], [MASK] * 4], device=device)
    prop = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], device=device)
    ent = torch.tensor([[0.0] * 4, [0.5, 0.01, 0.2, 3.0]], device=device)
    n_rev, n_rem = sbd_ext.mask_replace(tokens, prop, ent, torch.ones_like(ent), MASK, "eb", 0.25)
    assert tokens[0].tolist() == [1, 2, 3, 4]
    # sorted: 0.01 (pos 1), 0.2 (pos 2), 0.5 (pos 0), 3.0: prefix sums 0, 0.01, 0.21, 0.71 -> reveal 3 positions
    assert tokens[1].tolist() == [9, 10, 11, MASK]
    assert n_rev.tolist() == [0, 3] and n_rem.tolist() == [0, 1]


def test_invalid_proposals_are_never_revealed(device):
    """A NaN-logit row proposes -1: never written; with nothing else left, the call reveals 0 (caller errors)."""
    tokens = torch.full((1, 3), MASK, device=device)
    prop = torch.tensor([[-1, 4, -1]], device=device)
    ent = torch.tensor([[float("nan"), 0.3, float("nan")]], device=device)
    n_rev, n_rem = sbd_ext.mask_replace(tokens, prop, ent, torch.ones_like(ent), MASK, "eb", 0.0)
    assert tokens.tolist() == [[MASK, 4, MASK]] and n_rev.item() == 1 and n_rem.item() == 2
    n_rev, n_rem = sbd_ext.mask_replace(tokens, prop, ent, torch.ones_like(ent), MASK, "eb", 10.0)
    assert n_rev.item() == 0 and n_rem.item() == 2
    # a proposal equal to the mask id is not a reveal either
    tokens = torch.full((1, 2), MASK, device=device)
    n_rev, _ = sbd_ext.mask_replace(
        tokens,
        torch.tensor([[MASK, MASK]], device=device),
        torch.zeros(1, 2, device=device),
        torch.ones(1, 2, device=device),
        MASK,
        "entropy",
        1.0,
    )
    assert n_rev.item() == 0


def test_non_contiguous_views(device):
    tokens, prop, ent, pmax = _case(4, 16, seed=3)
    big = torch.full((4, 32), 5, dtype=torch.int64, device=device)
    big[:, ::2] = tokens.to(device)
    view = big[:, ::2]  # stride 2 along K
    ent_t = ent.t().contiguous().t().to(device)  # column-major
    sbd_ext.mask_replace(view, prop.to(device), ent_t, pmax.to(device), MASK, "eb", 0.3)
    ref = tokens.clone()
    R.mask_replace(ref, prop, ent, pmax, MASK, "eb", 0.3)
    assert torch.equal(view.cpu(), ref)
    assert (big[:, 1::2] == 5).all()  # the interleaved columns outside the view are untouched


def test_opcheck_and_compile():
    tokens, prop, ent, pmax = _case(3, 8, seed=1)
    torch.library.opcheck(torch.ops.sbd_ext.mask_replace.default, (tokens.clone(), prop, ent, pmax, MASK, "eb", 0.3))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(tokens, prop, ent, pmax):
        n_rev, n_rem = torch.ops.sbd_ext.mask_replace(tokens, prop, ent, pmax, MASK, "confidence", 0.5)
        return n_rev + n_rem

    t = tokens.clone()
    total = step(t, prop, ent, pmax)
    ref = tokens.clone()
    R.mask_replace(ref, prop, ent, pmax, MASK, "confidence", 0.5)
    assert torch.equal(t, ref) and torch.equal(total, (tokens == MASK).sum(1))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(tokens=a["tokens"].int()), "tokens must have dtype"),
        (lambda a: a.update(proposals=a["proposals"].float()), "proposals must have dtype"),
        (lambda a: a.update(entropy=a["entropy"].double()), "entropy must have dtype"),
        (lambda a: a.update(max_prob=a["max_prob"].half()), "max_prob must have dtype"),
        (lambda a: a.update(tokens=a["tokens"].flatten()), r"tokens must be 2-D \[B, K\]"),
        (lambda a: a.update(proposals=a["proposals"][:, :3]), "proposals.size"),
        (lambda a: a.update(entropy=a["entropy"][:1]), "entropy.size"),
        (lambda a: a.update(rule="greedy"), "rule must be one of"),
        (lambda a: a.update(threshold=-0.1), "gamma must be >= 0"),
        (lambda a: a.update(threshold=float("nan")), "threshold must be a number"),
        # tokens is written in place: no memory shared with itself or with the other inputs
        (
            lambda a: a.update(tokens=a["tokens"][:1].expand(2, 4)),
            "tokens is written in place but some of its elements share memory",
        ),
        (lambda a: a.update(proposals=a["tokens"]), "tokens is written in place and shares memory with proposals"),
        (
            lambda a: a.update(entropy=a["tokens"].view(torch.float32)[:, ::2]),
            "tokens is written in place and shares memory with entropy",
        ),
        (lambda a: a.update(tokens=_overlapping_rows(a["tokens"])), "tokens is written in place but some"),
        # the mask id travels as an int64: out-of-range or non-integer ids are refused in the wrapper
        (lambda a: a.update(mask_id=2**63), "mask_id must be a token id that fits in int64"),
        (lambda a: a.update(mask_id=-(2**63) - 1), "mask_id must be a token id that fits in int64"),
        (lambda a: a.update(mask_id=99.5), "mask_id must be an integer"),
        (lambda a: a.update(mask_id="99"), "mask_id must be an integer"),
        (lambda a: a.update(mask_id=True), "mask_id must be an integer"),
    ],
)
def test_bad_inputs(device, change, match):
    tokens, prop, ent, pmax = (t.to(device) for t in _case(2, 4, seed=0))
    args = dict(tokens=tokens, proposals=prop, entropy=ent, max_prob=pmax, mask_id=MASK, rule="eb", threshold=0.3)
    change(args)
    before = args["tokens"].clone()
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        sbd_ext.mask_replace(**args)
    assert torch.equal(args["tokens"], before)


def _overlapping_rows(tokens: torch.Tensor) -> torch.Tensor:
    """[2, 4] rows that are windows of one buffer 2 apart: positions 2, 3 of row 0 are positions 0, 1 of row 1."""
    return torch.arange(6, device=tokens.device).as_strided((2, 4), (2, 1))


@pytest.mark.parametrize("mask_id", [-(2**63), -1, 2**31, 2**63 - 1])
def test_mask_ids_at_the_int64_limits(device, mask_id):
    """Any int64 is a legal mask id: the op matches the reference at the limits (no truncation to 32 bits)."""
    tokens, prop, ent, pmax = _case(3, 8, seed=5)
    tokens[tokens == MASK] = mask_id
    tokens[:, 0] = mask_id
    ours = tokens.clone().to(device)
    counts = sbd_ext.mask_replace(ours, prop.to(device), ent.to(device), pmax.to(device), mask_id, "eb", 0.4)
    ref = tokens.clone()
    ref_counts = R.mask_replace(ref, prop, ent, pmax, mask_id, "eb", 0.4)
    assert torch.equal(ours.cpu(), ref) and torch.equal(counts[0].cpu(), ref_counts[0])
    assert int(counts[0].sum()) > 0  # something was revealed: the mask id was recognised


# ---- CUDA (skipped without an NVIDIA GPU and the CUDA kernels) ----------------------------------------
@cuda_only
@pytest.mark.parametrize("K", [1, 16, 100, 1024])
@pytest.mark.parametrize("rule", R.RULES)
@pytest.mark.parametrize("threshold", [0.0, 0.35, 0.9])
def test_mask_replace_cuda(K, rule, threshold):
    B, mask_id = 6, 3
    g = torch.Generator().manual_seed(K)
    tokens = torch.randint(0, 50, (B, K), generator=g)
    tokens[torch.rand(B, K, generator=g) < 0.7] = mask_id
    tokens[0] = mask_id  # all masked
    tokens[1] = 9  # none masked
    proposals = torch.randint(-1, 50, (B, K), generator=g)
    ent = torch.rand(B, K, generator=g) * 0.5
    ent[:, ::5] = 0.1  # ties
    ent[2, ::3] = float("nan")
    conf = torch.rand(B, K, generator=g)
    want_tok = tokens.clone()
    want = R.mask_replace(want_tok, proposals, ent, conf, mask_id, rule, threshold)
    # Non-contiguous tokens (a column slice), as a decoding loop may keep the block inside a longer buffer.
    buf = torch.full((B, K + 2), -5, dtype=torch.int64, device="cuda")
    g_tok = buf[:, 1 : K + 1]
    g_tok.copy_(tokens)
    got = sbd_ext.mask_replace(g_tok, proposals.cuda(), ent.cuda(), conf.cuda(), mask_id, rule, threshold)
    assert torch.equal(g_tok.cpu(), want_tok)
    assert (buf[:, 0] == -5).all() and (buf[:, -1] == -5).all()
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    c_tok = tokens.clone()
    c = sbd_ext.mask_replace(c_tok, proposals, ent, conf, mask_id, rule, threshold)
    assert torch.equal(c_tok, g_tok.cpu()) and torch.equal(c[0], got[0].cpu()) and torch.equal(c[1], got[1].cpu())


@cuda_only
def test_mask_replace_cuda_rejects_too_long_blocks():
    t = torch.zeros(1, 1025, dtype=torch.int64, device="cuda")
    f = torch.zeros(1, 1025, device="cuda")
    with pytest.raises(ValueError, match="1024"):
        sbd_ext.mask_replace(t, t.clone(), f, f, 0, "eb", 0.1)  # proposals apart from the mutated tokens
