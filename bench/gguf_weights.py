"""A GGUF of a HF Llama's weights for llama.cpp, made from a GGUF of the same architecture (bench-only helper).

The peer bench compares sbd_ext with llama.cpp on the *same weights*. For the arithmetic runs those are the converted
SBD model's (``smollm2-sbd``, LoRA merged into the projections), which has no GGUF. :func:`gguf_like` copies a
template GGUF whose tensors are all F32 (llama.cpp's own requantization of the shipped SmolLM2 GGUF: tokenizer,
hyper-parameters and tensor layout exactly as llama.cpp wants them) and overwrites every tensor's data with the HF
model's, under llama.cpp's names; Q and K get the row permutation llama.cpp's ``convert_hf_to_gguf.py`` applies to
Llama (HF's rotary layout to GGML's). The mask token's row (index ``vocab_size`` of an SBD model) is not part of the
GGUF vocabulary and is dropped. Writing the unmodified base this way reproduces llama.cpp's F32 file byte for byte
(bench/bench_cpu_peers.py checks it before using the helper).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute for a [rows, K] Q or K weight with n_head heads."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """llama.cpp name -> fp32 tensor (numpy's row-major layout of GGUF's [ne0, ne1]) for a HF Llama."""
    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    vocab = int(cfg.vocab_size) if getattr(cfg, "mask_token_id", None) is None else int(cfg.mask_token_id)
    out = {"token_embd.weight": sd["model.embed_tokens.weight"][:vocab], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"][:vocab]
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_hidden_layers):
        for g, h in names.items():
            w = sd[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                w = _permute(w, cfg.num_attention_heads)
            elif g == "attn_k":
                w = _permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{g}.weight"] = w
    return out


def gguf_like(template: Path, model, out: Path) -> Path:
    """Copy ``template`` (an all-F32 GGUF of the same architecture) to ``out`` with ``model``'s weights."""
    tensors = gguf_tensors(model)
    tmp = out.with_suffix(".tmp")
    shutil.copyfile(template, tmp)
    reader = gguf.GGUFReader(str(tmp), "r+")
    seen = set()
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{template}: tensor {t.name} is {t.tensor_type.name}; the template must be all F32")
        src = tensors[t.name].numpy().astype(np.float32)
        if src.size != t.data.size:
            raise ValueError(f"{t.name}: the model's tensor has {src.size} values, the template's {t.data.size}")
        t.data[...] = src.reshape(t.data.shape)
        seen.add(t.name)
    if set(tensors) != seen:
        raise ValueError(f"tensors not in the template: {sorted(set(tensors) - seen)[:5]}")
    del reader  # flush the memmap
    tmp.rename(out)
    return out
