"""attn_implementation="sbd": registration, equality with "sdpa" for plain causal use (kernel path), and with "eager"
(transformers' pure-PyTorch attention) for padded / custom-mask / autograd use, where "sbd" falls back to SDPA."""

from __future__ import annotations

import types

import pytest
import torch
from sbd_models import (
    VOCAB,
    random_prompts,
    single_thread,  # noqa: F401  (fixture)
    tiny_llama,
)
from transformers import AttentionInterface, DynamicCache, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from utils import assert_close

import sbd_ext
import sbd_ext.hf

# fp32 logits of "sbd" vs "sdpa" (same weights): both accumulate in fp32, in different orders.
FP32_TOL = (2e-5, 1e-4)

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
    ),
]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of sbd_ext.ops.block_attention made by the backend (kernel path vs SDPA fallback)."""
    calls = []
    real = sbd_ext.ops.block_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(sbd_ext.ops, "block_attention", spy)
    return calls


def _pair(n_heads=4, n_kv_heads=2, dtype=torch.float32, ref="sdpa", **kw):
    """The same random weights with attn "sbd" and with ``ref``.

    ``ref="eager"`` (transformers' matmul + softmax attention, pure PyTorch) for the inputs on which "sbd" falls back
    to SDPA: comparing SDPA with SDPA there would check nothing but the routing.
    """
    sbd = tiny_llama(n_heads=n_heads, n_kv_heads=n_kv_heads, dtype=dtype, attn="sbd", **kw)
    other = tiny_llama(n_heads=n_heads, n_kv_heads=n_kv_heads, dtype=dtype, attn=ref, **kw)
    return sbd, other


def test_registered():
    assert sbd_ext.hf.ATTN_IMPLEMENTATION == "sbd"
    assert AttentionInterface._global_mapping["sbd"] is sbd_ext.hf.sbd_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["sbd"] is sbd_ext.hf.sbd_mask


def test_three_ways_to_select(tmp_path):
    model = tiny_llama(attn="sbd")
    assert model.config._attn_implementation == "sbd"
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sbd")
    assert loaded.config._attn_implementation == "sbd"
    other = tiny_llama(attn="sdpa")
    other.set_attn_implementation("sbd")
    assert other.config._attn_implementation == "sbd"
    other.set_attn_implementation("sdpa")
    assert other.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_forward_no_cache(n_heads, n_kv_heads, dtype, kernel_calls):
    sbd, sdpa = _pair(n_heads, n_kv_heads, dtype)
    ids = torch.randint(0, VOCAB, (3, 13))
    with torch.no_grad():
        got, want = sbd(ids).logits, sdpa(ids).logits
    assert len(kernel_calls) == sbd.config.num_hidden_layers  # the kernel ran, no fallback
    if dtype == torch.float32:
        assert_close(got, want, atol=FP32_TOL[0], rtol=FP32_TOL[1])
    else:
        # Low precision: against the fp32 model, the "sbd" run's error is at most 2x SDPA's own bf16 error.
        with torch.no_grad():
            exact = tiny_llama(n_heads=n_heads, n_kv_heads=n_kv_heads, attn="sdpa")(ids).logits
        err_sbd = (got.float() - exact).abs()
        err_sdpa = (want.float() - exact).abs()
        assert err_sbd.max() <= 2 * err_sdpa.max(), (err_sbd.max(), err_sdpa.max())
        assert err_sbd.mean() <= 2 * err_sdpa.mean(), (err_sbd.mean(), err_sdpa.mean())


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 4)])
def test_forward_dynamic_cache_step_by_step(n_heads, n_kv_heads, kernel_calls):
    """Prefill 5, then a 3-token chunk on top of the cache (lower-right causal), then single tokens."""
    sbd, sdpa = _pair(n_heads, n_kv_heads)
    ids = torch.randint(0, VOCAB, (2, 12))
    cache_a, cache_b = DynamicCache(config=sbd.config), DynamicCache(config=sdpa.config)
    start = 0
    with torch.no_grad():
        for n in (5, 3, 1, 1, 2):
            chunk = ids[:, start : start + n]
            got = sbd(chunk, past_key_values=cache_a, use_cache=True).logits
            want = sdpa(chunk, past_key_values=cache_b, use_cache=True).logits
            assert_close(got, want, atol=FP32_TOL[0], rtol=FP32_TOL[1], msg=f"chunk at {start}")
            start += n
    assert len(kernel_calls) == 5 * sbd.config.num_hidden_layers
    for layer_a, layer_b in zip(cache_a.layers, cache_b.layers, strict=True):
        assert_close(layer_a.keys, layer_b.keys, atol=1e-5, rtol=1e-5)
        assert_close(layer_a.values, layer_b.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 2), (4, 4)])
def test_generate_greedy_matches_sdpa(n_heads, n_kv_heads, kernel_calls):
    sbd, sdpa = _pair(n_heads, n_kv_heads)
    ids = torch.randint(0, VOCAB, (2, 7))
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = sbd.generate(ids, **kw)
    want = sdpa.generate(ids, **kw)
    assert torch.equal(got, want)
    assert len(kernel_calls) == 20 * sbd.config.num_hidden_layers


def test_padded_batch_falls_back_and_matches_eager(kernel_calls):
    sbd, eager = _pair(ref="eager")
    ids, mask = random_prompts([4, 9, 6], padding_side="left")
    with torch.no_grad():
        got = sbd(ids, attention_mask=mask).logits
        want = eager(ids, attention_mask=mask).logits
    assert kernel_calls == []  # padding -> materialised mask -> SDPA fallback
    keep = mask.bool()
    assert_close(got[keep], want[keep], atol=FP32_TOL[0], rtol=FP32_TOL[1])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(sbd.generate(ids, attention_mask=mask, **kw), eager.generate(ids, attention_mask=mask, **kw))
    assert kernel_calls == []


def test_unpadded_mask_uses_kernel(kernel_calls):
    """An all-ones 2D attention_mask is plain causal: the kernel path, as without a mask."""
    sbd, sdpa = _pair()
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        got = sbd(ids, attention_mask=torch.ones_like(ids)).logits
        want = sdpa(ids).logits
    assert len(kernel_calls) == sbd.config.num_hidden_layers
    assert_close(got, want, atol=FP32_TOL[0], rtol=FP32_TOL[1])


def test_custom_4d_mask_falls_back(kernel_calls):
    sbd, eager = _pair(ref="eager")
    ids = torch.randint(0, VOCAB, (1, 8))
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    allowed[4:, 4:] = True  # a bidirectional tail, as in an SBD block
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        got = sbd(ids, attention_mask=mask).logits
        want = eager(ids, attention_mask=mask).logits
    assert kernel_calls == []
    assert_close(got, want, atol=FP32_TOL[0], rtol=FP32_TOL[1])


def test_autograd_falls_back_and_matches_eager(kernel_calls):
    sbd, eager = _pair(ref="eager")
    ids = torch.randint(0, VOCAB, (2, 9))
    loss_a = sbd(ids, labels=ids).loss
    loss_b = eager(ids, labels=ids).loss
    loss_a.backward()
    loss_b.backward()
    assert kernel_calls == []  # the kernel has no backward
    assert_close(loss_a, loss_b, atol=1e-5, rtol=1e-5)
    for (name, pa), pb in zip(sbd.named_parameters(), eager.parameters(), strict=True):
        assert_close(pa.grad, pb.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sbd_mask_semantics():
    mask_fn = sbd_ext.hf.sbd_mask
    # plain causal with or without a cache -> None
    assert mask_fn(2, 3, 8, q_offset=5) is None
    assert mask_fn(2, 3, 3, attention_mask=torch.ones(2, 3, dtype=torch.bool)) is None
    # padding, static-cache sizes (keys = whole buffer), non-causal mask functions -> materialised 4D bool
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[0, 0] = False
    m = mask_fn(2, 3, 8, q_offset=5, attention_mask=pad)
    assert m.shape == (2, 1, 3, 8) and m.dtype == torch.bool and not m[0, 0, 0, 0] and m[1, 0, 0, 5]
    assert not m[1, 0, 0, 6]  # causal, lower-right aligned
    assert mask_fn(1, 3, 16, q_offset=5).shape == (1, 1, 3, 16)
    full = mask_fn(1, 4, 4, mask_function=lambda b, h, q, kv: q >= 0)
    assert full is not None and bool(full.all())  # bidirectional is never "None"


def test_cuda_head_dims_route(monkeypatch):
    """CUDA kernels exist for head dims 32, 64 and 128 (the CPU kernel takes any): other head dims send ordinary
    forwards to SDPA, and SBD decoding of such a model is refused up front with the supported list, not by a kernel
    error halfway through a generation."""
    from transformers import LlamaConfig

    from sbd_ext.decoding import api

    monkeypatch.setitem(sbd_ext.hf._kernel_on_device, "cuda", True)  # as on a GPU machine with the CUDA build
    cuda = torch.device("cuda")
    assert [sbd_ext.hf.kernel_available(cuda, d) for d in (32, 64, 128, 96, 256)] == [True] * 3 + [False] * 2
    assert sbd_ext.hf.kernel_available(cuda) and sbd_ext.hf.kernel_available(torch.device("cpu"), 96)
    cfg = LlamaConfig(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    model = types.SimpleNamespace(config=cfg)
    monkeypatch.setattr(api, "model_device_dtype", lambda m: (cuda, torch.float32))
    with pytest.raises(ValueError, match=r"support head dims 32, 64, 128; this model's is 96.*model.to\('cpu'\)"):
        api._check_runnable(model)
    cfg.head_dim = 64  # an explicit head_dim wins over hidden_size / heads
    assert api._check_runnable(model) == (cuda, torch.float32)
