"""Every model family of sbd_ext.families decodes exactly, or is refused before any work.

Small random models of each supported family (no downloads; sliding windows smaller than the sequences, Gemma-2's
logit soft-capping strong enough to matter), fp32, greedy:

* NTP mode (``sbd_ext.generate(mode="ntp")``, the block_attention kernel over SBDCache) == HF ``generate`` with
  the eager attention, token for token;
* SBD mode == the no-cache reference decoder (``sbd_ext.generate_reference``), token for token and forward for
  forward;
* the ordinary "sbd" backend (HF ``generate`` and a full forward through it) == eager;
* in each, the CPU kernel did the attention (its call counter grows by at least one call per layer and forward).

Refused: a model type not in the table, gpt-oss (attention sinks), bidirectional Gemma-3.
"""

from __future__ import annotations

import pathlib

import pytest
import sbd_models
import torch
import transformers

import sbd_ext
from sbd_ext import families
from sbd_ext.decoding import set_sbd_metadata

single_thread = sbd_models.single_thread  # the fixture

VOCAB, MASK_ID = sbd_models.VOCAB, sbd_models.MASK_ID
prompts = sbd_models.random_prompts  # ragged random prompts, left-padded, no mask token
WINDOW = 5  # every window is smaller than the sequences below (prompts 7-9 + 20 new tokens)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SLIDE, FULL = "sliding_attention", "full_attention"
FAMILY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **COMMON
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW + 1, max_window_layers=2, **COMMON
    ),
    "mistral": lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON),
    "gemma": lambda: transformers.GemmaConfig(num_hidden_layers=2, **COMMON),
    "gemma2": lambda: transformers.Gemma2Config(
        num_hidden_layers=4,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
        **COMMON,
    ),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        num_hidden_layers=3,
        sliding_window=WINDOW,
        layer_types=[SLIDE, FULL, SLIDE],
        rope_local_base_freq=1000.0,
        query_pre_attn_scalar=16,
        **COMMON,
    ),
}


def tiny_model(model_type: str, seed: int = 0):
    """A random causal LM of the family, attention "sbd", fp32, eval; q/k scaled up so that attention is peaked
    (soft-capping bends it) and the output head scaled so that next-token entropies spread like a trained model's."""
    torch.manual_seed(seed)
    cfg = FAMILY_CONFIGS[model_type]()
    cfg._attn_implementation = "sbd"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sbd").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
        model.lm_head.weight.mul_(8.0)
    set_sbd_metadata(model.config, MASK_ID, None)
    return model


def kernel_calls() -> int:
    return sum(sbd_ext._C.block_attention_cpu_paths())


@pytest.fixture(params=list(FAMILY_CONFIGS), scope="module")
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return tiny_model(family)


def _generated(out, b):
    p = int(out.prompt_lengths[b])
    return out.sequences[b, p : p + int(out.num_generated[b])].tolist()


@pytest.fixture
def eager(model):
    """The same model through transformers' eager attention for the duration of a test."""
    model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.set_attn_implementation("sbd")


def test_table_covers_the_tested_families(family, model):
    assert families.check_model(model) == {
        f: how for f, how in families.FAMILIES[family].items() if families._uses(model.config, f)
    }
    if family in ("qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"):
        assert "sliding_window" in families.check_model(model)  # the window really is on in these tests


def test_ntp_equals_hf_generate(single_thread, model):
    ids, mask = prompts([7, 9], seed=4)
    n_layers = model.config.num_hidden_layers
    before = kernel_calls()
    out = sbd_ext.generate(model, ids, mask, mode="ntp", max_new_tokens=20, eos_token_id=[])
    assert kernel_calls() - before >= n_layers * int(out.nfe.max())
    model.set_attn_implementation("eager")
    try:
        for b in range(2):
            row = ids[b : b + 1][mask[b : b + 1].bool()].view(1, -1)
            hf = model.generate(
                row,
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                suppress_tokens=[model.config.mask_token_id],  # the mask token is never generated
            )
            assert _generated(out, b) == hf[0, row.shape[1] :].tolist(), f"sequence {b}"
    finally:
        model.set_attn_implementation("sbd")


@pytest.mark.parametrize("block_size,threshold", [(4, 1.0), (8, 0.3)])
def test_sbd_equals_reference(single_thread, model, block_size, threshold):
    ids, mask = prompts([8, 5], seed=7)
    kw = dict(block_size=block_size, threshold=threshold, max_new_tokens=20, eos_token_id=[])
    before = kernel_calls()
    out = sbd_ext.generate(model, ids, mask, **kw)
    assert kernel_calls() - before >= model.config.num_hidden_layers * int(out.nfe.max())
    ref = sbd_ext.generate_reference(model, ids, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.nfe.tolist() == ref.nfe.tolist()
    assert out.trace == ref.trace


def test_backend_generate_and_forward_equal_eager(single_thread, model):
    """The ordinary "sbd" route: HF's own cached generate (sliding cache layers keep W - 1 rows) and a full forward
    run the kernel with the layers' features, and equal eager."""
    ids, _ = prompts([9], seed=2)
    before = kernel_calls()
    ours = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert kernel_calls() - before >= model.config.num_hidden_layers * 16
    with torch.no_grad():
        long = torch.cat([ids, ours[:, ids.shape[1] :]], dim=1)
        logits = model(long).logits
    model.set_attn_implementation("eager")
    try:
        theirs = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            eager_logits = model(long).logits
    finally:
        model.set_attn_implementation("sbd")
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)


def test_backend_fallback_keeps_the_features(model):
    """With autograd on, the backend cannot run the kernel: its fallback (SDPA, or eager for soft-capping) still
    applies the window and the cap, so a training forward equals eager too."""
    ids, _ = prompts([12], seed=3)
    logits = model(ids).logits  # grad mode on: the fallback
    model.set_attn_implementation("eager")
    try:
        eager_logits = model(ids).logits
    finally:
        model.set_attn_implementation("sbd")
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2"])  # soft-capping in the attention and the head, alternating windows
def test_compiled_decode_step_equals_eager(single_thread, family):
    """generate(compile=True) runs the decoder and the head itself (decoding._static_forward): the head must apply
    the family's final soft-capping (families.lm_logits), or entropies -- and the revealed positions -- change."""
    model = tiny_model(family)
    ids, mask = prompts([7, 9], seed=4)
    kw = dict(block_size=4, threshold=1.0, max_new_tokens=12, eos_token_id=[])
    eager = sbd_ext.generate(model, ids, mask, **kw)
    compiled = sbd_ext.generate(model, ids, mask, compile=True, **kw)
    assert torch.equal(eager.sequences, compiled.sequences)
    assert eager.trace == compiled.trace


# ---- refused before any work ----------------------------------------------------------------------------
def _refused_models():
    oss = transformers.GptOssConfig(
        num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1, sliding_window=4, **COMMON
    )
    phi = transformers.Phi3Config(num_hidden_layers=2, **{k: v for k, v in COMMON.items() if k != "head_dim"})
    bidir = FAMILY_CONFIGS["gemma3_text"]()
    bidir.use_bidirectional_attention = True
    return {"gpt_oss": (oss, "attention sinks"), "phi3": (phi, "model type 'phi3'"), "gemma3_bidir": (bidir, "bidir")}


@pytest.mark.parametrize("name", ["gpt_oss", "phi3", "gemma3_bidir"])
def test_refused_before_any_work(name):
    cfg, match = _refused_models()[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sbd").eval()
    set_sbd_metadata(model.config, MASK_ID, None)
    ids, mask = prompts([5])
    before = kernel_calls()
    for fn in (sbd_ext.generate, sbd_ext.generate_reference):
        with pytest.raises(families.UnsupportedModelError, match=match) as e:
            fn(model, ids, mask, max_new_tokens=4)
        assert "supported: llama" in str(e.value).lower()
    with pytest.raises(families.UnsupportedModelError, match=match), torch.no_grad():
        model(ids)  # the "sbd" backend refuses it too
    assert kernel_calls() == before


def test_readme_table_is_the_code_table():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()  # the manual
    assert families.markdown_table() in readme
