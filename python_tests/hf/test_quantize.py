"""sbd_ext.quantize(model, "int8" | "w8a8"): int8 weights in place, against the same model with the dequantised
weights in fp32 (and, for "w8a8", each linear layer's input replaced by the reference's int8 quantisation of it): the
pure-PyTorch reference of what the quantised model computes; and decoding on it. ``"packed"`` (fp32 weights in
row_linear's panel layout) against the same fp32 model with plain ``nn.Linear`` layers."""

import copy

import pytest
import torch
from sbd_models import tiny_llama
from torch import nn

import sbd_ext
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import format_prompt
from sbd_ext.linear import RowLinear, bf16_tiles_in_use, use_row_linear
from sbd_ext.packing import is_bf16_tiles
from sbd_ext.quantization import Int8Linear, PackedLinear, quantize_weight, quantized_scheme
from sbd_ext.reference import quantized_x


def test_quantize_weight_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=g)
    w[3] = 0.0
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (37,)
    assert int(q.abs().max()) == 127 and s[3] == 1.0 and not bool(q[3].any())
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-5)).all())  # round to nearest: half a step per entry
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_weight(w)


def _quantised_input(module, args):
    return (quantized_x(args[0]),)


def _dequantised_copy(model: nn.Module, scheme: str = "int8") -> nn.Module:
    """The reference: a copy of the fp32 model whose linear weights are q * scale in fp32 (what int8 stands for);
    for "w8a8" each linear layer's input also goes through the reference's block quantisation; for "bf16" the
    weights rounded to bf16, in fp32."""
    ref = copy.deepcopy(model)
    use_row_linear(ref, False)  # F.linear: the reference does not run the kernel under test
    if scheme == "packed":  # the same fp32 weights
        return ref
    with torch.no_grad():
        for m in ref.modules():
            if type(m) is nn.Linear:
                if scheme == "bf16":  # the weights rounded to bf16 (to nearest even), as fp32
                    m.weight = nn.Parameter(m.weight.bfloat16().float(), requires_grad=False)
                    if bf16_tiles_in_use():  # AMX-BF16's tiles: the inputs rounded to bf16 too
                        m.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
                    continue
                q, s = quantize_weight(m.weight)
                m.weight = nn.Parameter(q.float() * s[:, None], requires_grad=False)
                if scheme == "w8a8":
                    m.register_forward_pre_hook(_quantised_input)
    return ref


@pytest.mark.parametrize("tie", [False, True])
def test_quantize_switches_every_linear_in_place(tie):
    model = tiny_llama(tie=tie)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    emb = model.get_input_embeddings().weight
    fired = []
    model.lm_head.register_forward_hook(lambda *a: fired.append(1))
    assert sbd_ext.quantize(model, "int8") is model and quantized_scheme(model) == "int8"
    for name, m in model.named_modules():
        if name in linears:
            assert m is linears[name] and type(m) is Int8Linear  # same objects: references and hooks stay
            assert m.weight_int8.dtype == torch.int8 and m.weight_scale.shape == (m.out_features,)
    head = model.lm_head
    if tie:
        assert head.weight is emb  # the embedding keeps the shared fp32 tensor
    else:
        assert "weight" not in head._parameters  # the fp32 weight is freed
        q, s = head.weight_int8, head.weight_scale
        assert torch.equal(head.weight, q.float() * s[:, None])
    model(torch.tensor([[1, 2, 3]]))
    assert fired == [1]
    sbd_ext.quantize(model, "int8")  # again: nothing left to switch
    assert all(type(m) is not nn.Linear for m in model.modules())


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
@pytest.mark.parametrize("rows", [1, 5, 32, 40, 97])  # > ROW_LIMIT (32): a prefill, 32 rows per kernel call
def test_int8_forward_equals_the_dequantised_fp32_model(rows, scheme):
    model = tiny_llama(tie=True)
    ref = _dequantised_copy(model, scheme)
    use_row_linear(model)  # RowLinear layers are quantised too
    assert any(type(m) is RowLinear for m in model.modules())
    sbd_ext.quantize(model, scheme)
    ids = torch.randint(0, 90, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    if scheme == "int8":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        # fp32 rounding upstream can move an input across a rounding edge (one int8 step in a block), and the flips
        # compound over the layers: the whole model is close, and every layer is exact on the input it got.
        assert float((got - want).abs().mean()) < 1e-2
        seen = []

        def check(m, args, out):
            (x,) = args
            w = m.int8_weight().float() * m.weight_scale[:, None]
            want = torch.nn.functional.linear(_quantised_input(m, args)[0], w, m.bias)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
            seen.append(m)

        hooks = [m.register_forward_hook(check) for m in model.modules() if type(m) is Int8Linear]
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        assert len(seen) == len(hooks) > 0


@pytest.mark.parametrize("scheme, seed", [("int8", 1), ("packed", 2)])
def test_linear_paths_agree(scheme, seed):
    """Kernel (1 call, several calls) and the F.linear fallback on the dequantised / unpacked weight (autograd,
    another dtype) compute the same layer, for an output size that is not a multiple of 16 (packed: padded panels);
    the fallback keeps gradients flowing to the input."""
    torch.manual_seed(seed)
    layer = nn.Linear(24, 10)
    w = layer.weight.detach().clone()  # packed: the same fp32 values
    sbd_ext.quantize(layer, scheme)
    if scheme == "int8":
        w = layer.weight_int8.float() * layer.weight_scale[:, None]
    for shape in ((3, 24), (2, 40, 24)):
        x = torch.randn(*shape)
        want = torch.nn.functional.linear(x, w, layer.bias)
        with torch.no_grad():
            got = layer(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        xg = x.clone().requires_grad_(True)
        out = layer(xg)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        torch.testing.assert_close(xg.grad, w.sum(0).expand_as(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert layer(torch.randn(3, 24, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_switching_schemes_keeps_the_weights():
    """quantize(model, "w8a8") after "int8" (and back) switches the layers' inputs, not the int8 weights."""
    model = tiny_llama(tie=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    sbd_ext.quantize(model, "int8")
    q = model.lm_head.int8_weight()
    with torch.no_grad():
        a = model(ids).logits
        sbd_ext.quantize(model, "w8a8")
        assert quantized_scheme(model) == "w8a8" and torch.equal(model.lm_head.int8_weight(), q)
        assert model.lm_head.quantize_x
        b = model(ids).logits
        sbd_ext.quantize(model, "int8")
        assert quantized_scheme(model) == "int8" and not model.lm_head.quantize_x
        assert torch.equal(model(ids).logits, a) and not torch.equal(a, b)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown scheme 'int4'"):
        sbd_ext.quantize(tiny_llama(), "int4")
    with pytest.raises(ValueError, match=r"for fp32 models .* torch.bfloat16: call model.float\(\) first"):
        sbd_ext.quantize(tiny_llama(dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        sbd_ext.quantize(torch.zeros(3))
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        sbd_ext.quantize(model)
    assert all(type(m) is not Int8Linear for m in model.modules())  # nothing changed: refused before any layer


# ---- "packed": fp32 weights in row_linear's panel layout -----------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_pack_switches_every_linear_in_place(tie):
    model = tiny_llama(tie=tie)  # vocab 100: the head is padded to 112 rows (7 panels)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    weights = {n: m.weight.detach().clone() for n, m in linears.items()}
    emb = model.get_input_embeddings().weight
    assert sbd_ext.quantize(model, "packed") is model and quantized_scheme(model) == "packed"
    for name, m in model.named_modules():
        if name in linears:
            assert m is linears[name] and type(m) is PackedLinear
            assert m.weight_packed.shape == (-(-m.out_features // 16), m.in_features, 16)
            assert torch.equal(m.weight, weights[name])  # the same values
    head = model.lm_head
    assert head.weight_packed.shape[0] * 16 == 112
    if tie:
        assert head.weight is emb
    else:
        assert "weight" not in head._parameters
    sbd_ext.quantize(model, "packed")  # again: nothing left to switch
    assert all(type(m) is not nn.Linear for m in model.modules())


@pytest.mark.parametrize("rows", [1, 5, 17, 32, 40, 97])  # > 32: a prefill, slices of 32 rows
def test_packed_forward_equals_the_fp32_model(rows):
    model = tiny_llama(tie=True)
    ref = _dequantised_copy(model, "packed")
    use_row_linear(model)
    sbd_ext.quantize(model, "packed")
    ids = torch.randint(0, 90, (1, rows), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert got.shape == want.shape == (1, rows, 100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_then_int8_and_not_back():
    """ "int8" on a packed model quantises the packed layers (the same int8 weights as from fp32); "packed" on an
    int8 model is refused."""
    model = tiny_llama(tie=False)
    want = quantize_weight(model.lm_head.weight)[0]
    sbd_ext.quantize(model, "packed")
    sbd_ext.quantize(model, "int8")
    assert quantized_scheme(model) == "int8" and type(model.lm_head) is Int8Linear
    assert torch.equal(model.lm_head.weight_int8, want) and "weight_packed" not in model.lm_head._buffers
    with pytest.raises(ValueError, match=r"already rounded to 'int8'; 'packed' is made from the fp32 weights"):
        sbd_ext.quantize(model, "packed")
    with pytest.raises(ValueError, match=r"the packed layout is for fp32 models .* torch.bfloat16"):
        sbd_ext.quantize(tiny_llama(dtype=torch.bfloat16), "packed")


# ---- decoding on int8 (and packed) weights ---------------------------------------------------------------------
@pytest.fixture(scope="module", params=["int8", "w8a8", "packed", "bf16", "bf16 tiles"])
def arith(request):
    scheme = request.param
    if scheme == "bf16 tiles":  # the AMX-BF16 layout on any AVX512-VNNI CPU: the emulated tiles (the tiles' loop)
        if not bf16_tiles_in_use():
            info = sbd_ext.build_info()
            if not ("avx512" in info["cpu_isas"] and info["cpu_vnni"]):
                pytest.skip("the AMX-BF16 tiles and their emulation need an AVX512-VNNI CPU")
            sbd_ext._C.set_cpu_amx("emulate")
            request.addfinalizer(lambda: sbd_ext._C.set_cpu_amx("auto"))
        scheme = "bf16"
    model, tok = models.load(models.DEFAULT_MODEL)
    info = models.demo_info(models.DEFAULT_MODEL)
    probs = list(tasks.problems("test", 4))
    texts = [format_prompt(p.prompt, info.get("prompt_template")) for p in probs]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    ref = _dequantised_copy(model, scheme)
    sbd_ext.quantize(model, scheme)
    if request.param == "bf16 tiles":
        assert all(is_bf16_tiles(m.weight_packed) for m in model.modules() if isinstance(m, PackedLinear))
    kw = dict(max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model, ref, enc.input_ids, enc.attention_mask, info, kw


def test_ntp_and_verify_on_int8_weights(arith):
    """NTP on the int8 model == NTP on the dequantised fp32 copy; verify on it == its own NTP (lossless holds)."""
    model, ref, ids, mask, info, kw = arith
    ntp = sbd_ext.generate(model, ids, mask, mode="ntp", **kw)
    assert torch.equal(ntp.sequences, sbd_ext.generate(ref, ids, mask, mode="ntp", **kw).sequences)
    ver = sbd_ext.generate(model, ids, mask, mode="sbd", verify=True, block_size=info["block_size"], **kw)
    assert torch.equal(ver.sequences, ntp.sequences)
    assert int(ver.nfe.max()) < int(ntp.nfe.max())


def test_compiled_step_on_int8_weights(arith):
    model, _, ids, mask, info, kw = arith
    s = dict(mode="sbd", block_size=info["block_size"], sampler=info["sampler"], threshold=info["gamma_high"], **kw)
    eager = sbd_ext.generate(model, ids, mask, **s)
    compiled = sbd_ext.generate(model, ids, mask, compile=True, **s)
    assert torch.equal(compiled.sequences, eager.sequences) and torch.equal(compiled.nfe, eager.nfe)


# ---- issue 61: saving, tied heads and training on a quantized model ------------------------------------------------
def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("how", ["model.save_pretrained", "integration.save_pretrained"])
def test_packed_model_saves_the_original_weights(tie, how, tmp_path):
    """Issue 61 item 4: a packed model saved with save_pretrained reloaded with random linear weights (the packed
    buffers are no checkpoint keys); now the weights are saved unpacked: the reloaded model is the fp32 model."""
    from transformers import AutoModelForCausalLM

    from sbd_ext.integration import save_pretrained

    fp32 = tiny_llama(tie=tie)
    model = sbd_ext.quantize(copy.deepcopy(fp32), "packed")
    if how == "model.save_pretrained":
        model.save_pretrained(tmp_path)
    else:
        save_pretrained(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(loaded, ids), _logits(fp32, ids), rtol=1e-4, atol=1e-4)
    assert type(model.lm_head) is PackedLinear  # the saved model itself stays packed


@pytest.mark.parametrize("scheme", ["int8", "w8a8"])
@pytest.mark.parametrize("how", ["model.save_pretrained", "integration.save_pretrained"])
def test_int8_model_refuses_to_save(scheme, how, tmp_path):
    """Issue 61 item 4: an int8 model saved without a word and reloaded with random linear weights (logits off by
    20); its int8 values are not the original weights, so saving is refused before any file is written."""
    from sbd_ext.integration import save_pretrained

    model = sbd_ext.quantize(tiny_llama(), scheme)
    with pytest.raises(ValueError, match=rf"quantized with scheme '{scheme}'.*quantize is for inference after loading"):
        if how == "model.save_pretrained":
            model.save_pretrained(tmp_path / "ck")
        else:
            save_pretrained(model, tmp_path / "ck")
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def _edit(model, edit):
    torch.manual_seed(7)  # resize's new rows: the same draws for both models
    if edit == "add_mask_token":
        from sbd_ext.training import add_mask_token

        add_mask_token(model)
    elif edit == "resize_token_embeddings":
        model.resize_token_embeddings(120, mean_resizing=False)
    else:
        with torch.no_grad():
            model.get_input_embeddings().weight[3:9] *= -2.0


@pytest.mark.parametrize("edit", ["add_mask_token", "resize_token_embeddings", "in_place"])
def test_packed_tied_head_follows_the_embedding(edit):
    """Issue 61 item 5: a packed tied head was a copy: after add_mask_token / resize_token_embeddings / an in-place
    edit of the embedding a new token's logit was a constant 0 (the head did not see the edit). Now the logits equal
    the unquantised model's with the same edit."""
    fp32 = tiny_llama(tie=True, mask_id=None)
    model = sbd_ext.quantize(copy.deepcopy(fp32), "packed")
    _edit(fp32, edit)
    _edit(model, edit)
    vocab = fp32.get_input_embeddings().weight.shape[0]
    ids = torch.tensor([[1, 4, 5, 8, vocab - 1, 2, vocab - 1]])
    want = _logits(fp32, ids)
    assert want.shape[-1] == vocab and not bool((want[..., -1] == 0).all())
    torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit", ["add_mask_token", "in_place"])
def test_int8_tied_head_follows_the_embedding(edit):
    """The same for an int8 tied head: after the edit the model computes what the edited fp32 model quantised
    afresh computes."""
    fp32 = tiny_llama(tie=True, mask_id=None)
    model = sbd_ext.quantize(copy.deepcopy(fp32), "int8")
    _edit(fp32, edit)
    _edit(model, edit)
    fresh = sbd_ext.quantize(copy.deepcopy(fp32), "int8")
    ids = torch.tensor([[1, 4, 5, 8, fp32.get_input_embeddings().weight.shape[0] - 1]])
    torch.testing.assert_close(_logits(model, ids), _logits(fresh, ids), rtol=1e-5, atol=1e-5)


def test_add_mask_token_refuses_an_untied_quantized_head():
    """An untied packed head's rows cannot take the new token's: refused before anything changes."""
    from sbd_ext.training import add_mask_token

    model = sbd_ext.quantize(tiny_llama(tie=False, mask_id=None), "packed")
    rows = model.get_input_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=r"add_mask_token: the model's output head holds 'packed' weights"):
        add_mask_token(model)
    assert model.get_input_embeddings().weight.shape[0] == rows


@pytest.mark.parametrize("scheme", ["packed", "int8"])
def test_training_a_quantized_model_warns_once(scheme):
    """Issue 61 item 6: a plain optimizer over a quantized model trains only embeddings and norms (the linears are
    buffers). model.train() and the whole model.parameters() taken (an optimizer's list) warn, once per model;
    next(model.parameters()) (a device / dtype lookup) and a frozen base do not."""
    import warnings

    match = rf"frozen buffers under scheme '{scheme}'"
    model = sbd_ext.quantize(tiny_llama(), scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.device.type == "cpu" and model.dtype == torch.float32
        with torch.no_grad():
            list(model.parameters())  # inference: no autograd, no optimizer
    with pytest.warns(UserWarning, match=match):
        model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.train()  # once per model
        torch.optim.AdamW(model.parameters())
    other = sbd_ext.quantize(tiny_llama(), scheme)
    with pytest.warns(UserWarning, match=match):
        torch.optim.AdamW(other.parameters())
    frozen = sbd_ext.quantize(tiny_llama(), scheme)
    for p in frozen.parameters():
        p.requires_grad_(False)  # adapter training over the frozen base: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frozen.train()
        list(frozen.parameters())
