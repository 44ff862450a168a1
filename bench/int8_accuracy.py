"""What int8 weights (``sbd_ext.quantize(model, "int8")``) cost in accuracy against fp32, on the held-out sets.

    python bench/int8_accuracy.py [--arith-n 100] [--general-n 16] [--ppl-tokens 16384] [--json PATH]

* arithmetic: the converted ``smollm2-sbd`` on the first ``--arith-n`` held-out problems (greedy, max 96 new tokens,
  batch 50), verify at its shipped settings, fp32 and int8: accuracy and mean forwards;
* general: SmolLM2-135M-Instruct's NTP decoding of the first ``--general-n`` held-out chat prompts (64 new tokens),
  fp32 and int8: how many answers are identical and how many leading tokens they share;
* perplexity of the unmodified base, fp32 and int8, on the recipe's text (Python standard-library docstrings,
  :func:`sbd_ext.recipes.smollm2.evaluate.perplexity_table`'s text and windows).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import sbd_ext
from sbd_ext.demo import models, tasks
from sbd_ext.demo.evaluate import decode
from sbd_ext.recipes.smollm2 import checkpoint, evaluate
from sbd_ext.recipes.smollm2.prompts import eval_prompts


def _arith(n: int) -> dict:
    model, tok = models.load("smollm2-sbd")
    info = models.demo_info("smollm2-sbd")
    probs = list(tasks.problems("test", n))
    kw = dict(block_size=info["block_size"], sampler=info["sampler"], threshold=info["gamma_low"], verify=True)
    out = {}
    for name, m in (("fp32", model), ("int8", sbd_ext.quantize(copy.deepcopy(model), "int8"))):
        res = decode(m, tok, [p.prompt for p in probs], batch_size=50, max_new_tokens=96, **kw)
        out[name] = {"accuracy": tasks.accuracy(res["completions"], probs), "mean_nfe": sum(res["nfe"]) / n}
        out[name]["completions"] = res["completions"]
    same = sum(a == b for a, b in zip(out["fp32"].pop("completions"), out["int8"].pop("completions"), strict=True))
    return {"n": n, "settings": kw, **out, "same_completions": same}


def _general(n: int) -> dict:
    base, tok = checkpoint.load_smollm2(attn_implementation="sbd")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])]) for p in eval_prompts()[:n]]
    answers = {}
    for name, m in (("fp32", base), ("int8", sbd_ext.quantize(copy.deepcopy(base), "int8"))):
        answers[name] = [
            sbd_ext.generate(m, p, mode="ntp", max_new_tokens=64, eos_token_id=eos).sequences[0, p.shape[1] :].tolist()
            for p in prompts
        ]
    common = []
    for a, b in zip(answers["fp32"], answers["int8"], strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        common.append(k)
    same = sum(a == b for a, b in zip(answers["fp32"], answers["int8"], strict=True))
    return {"n": n, "identical": same, "mean_common_prefix_tokens": sum(common) / n, "common_prefix": common}


def _perplexity(max_tokens: int) -> dict:
    text, _ = evaluate.stdlib_text()
    base, tok = checkpoint.load_smollm2(attn_implementation="sdpa")
    ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
    out = {}
    with torch.no_grad():
        for name, m in (("fp32", base), ("int8", sbd_ext.quantize(copy.deepcopy(base), "int8"))):
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
