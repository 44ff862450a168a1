"""What int8 weights cost in accuracy against fp32, on the held-out sets: ``sbd_ext.quantize(model, "int8")``
(weight-only) and ``"w8a8"`` (int8 weights and int8 layer inputs, per block of 32).

    python bench/int8_accuracy.py [--arith-n 100] [--general-n 16] [--ppl-tokens 16384] [--json PATH]

* arithmetic: the NTP control ``smollm2-ntp`` with its shipped drafter ``smollm2-arith-drafter`` on the first
  ``--arith-n`` held-out problems (greedy, max 96 new tokens, batch 50), verify at the drafter's shipped settings,
  fp32 / int8 / w8a8: accuracy, mean forwards, and how many completions equal fp32's;
* general: SmolLM2-135M-Instruct's NTP decoding of the first ``--general-n`` held-out chat prompts (64 new tokens):
  how many answers are identical to fp32's and how many leading tokens they share;
* perplexity of the unmodified base on the recipe's text (Python standard-library docstrings,
  :func:`sbd_ext.recipes.smollm2.evaluate.perplexity_table`'s text and windows).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import sbd_ext
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import decode, format_prompt
from sbd_ext.drafter import read_drafter_config
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint, evaluate

SCHEMES = ("fp32", "int8", "w8a8")
DRAFTER, CONTROL = "smollm2-arith-drafter", "smollm2-ntp"


def _variants(model):
    for name in SCHEMES:
        yield name, model if name == "fp32" else sbd_ext.quantize(copy.deepcopy(model), name)


def _common_prefix(a: list, b: list) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _arith(n: int) -> dict:
    model, tok = models.load(DRAFTER)
    gen = read_drafter_config(models.path(DRAFTER))["sbd"]["generation"]
    kw = dict(block_size=gen["sbd_block_size"], sampler=gen["sbd_sampler"], threshold=gen["sbd_threshold"])
    probs = list(tasks.problems("test", n))
    texts = [format_prompt(p.prompt, models.demo_info(CONTROL).get("prompt_template")) for p in probs]
    out, completions = {}, {}
    for name, m in _variants(model):
        res = decode(m, tok, texts, batch_size=50, max_new_tokens=96, verify=True, **kw)
        out[name] = {"accuracy": tasks.accuracy(res["completions"], probs), "mean_nfe": sum(res["nfe"]) / n}
        completions[name] = res["completions"]
        same = sum(a == b for a, b in zip(completions["fp32"], res["completions"], strict=True))
        out[name]["same_completions_as_fp32"] = same
    return {"n": n, "model": f"{CONTROL} + {DRAFTER}", "settings": {**kw, "verify": True}, **out}


def _general(n: int) -> dict:
    base, tok = checkpoint.load_smollm2(attn_implementation="sbd")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])]) for p in eval_prompts()[:n]]
    answers, out = {}, {"n": n}
    for name, m in _variants(base):
        answers[name] = [
            sbd_ext.generate(m, p, mode="ntp", max_new_tokens=64, eos_token_id=eos).sequences[0, p.shape[1] :].tolist()
            for p in prompts
        ]
        if name != "fp32":
            common = [_common_prefix(a, b) for a, b in zip(answers["fp32"], answers[name], strict=True)]
            same = sum(a == b for a, b in zip(answers["fp32"], answers[name], strict=True))
            out[name] = {"identical": same, "mean_common_prefix_tokens": sum(common) / n, "common_prefix": common}
    return out


def _perplexity(max_tokens: int) -> dict:
    text, _ = evaluate.stdlib_text()
    base, tok = checkpoint.load_smollm2(attn_implementation="sdpa")
    ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
    out = {}
    with torch.no_grad():
        for name, m in _variants(base):
            out[name] = evaluate.perplexity(m, ids)
    return {"tokens": len(ids), **out}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arith-n", type=int, default=100)
    ap.add_argument("--general-n", type=int, default=16)
    ap.add_argument("--ppl-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"arith": _arith(args.arith_n), "general": _general(args.general_n), "ppl": _perplexity(args.ppl_tokens)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
