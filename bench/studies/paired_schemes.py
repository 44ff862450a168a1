"""Study: verify with and without the branch and the drafter's draft store, in one weight scheme, paired.

The shipped ``smollm2-drafter`` recommends verify + branch + lookup 16 with its draft store; ``bench/bench_drafter.py
-k paired`` measures its packed fp32 rows. This script times the other schemes (``sbd_ext.quantize(model,
SCHEME)``: w8a8, bf16, ...): NTP, verify (branch off), verify + store, verify + branch, verify + branch + store, all
compiled, on the first N held-out chat prompts, every decoder in turn prompt by prompt (the order rotating), PASSES
passes; each answer checked against the scheme's own NTP decoding:

    python bench/studies/paired_schemes.py w8a8 8 96 2 [OUT.json]

Result (2026-12-06, Intel Xeon, AMX, 1 thread; bench/results/drafter/study_xeon_amx_96_paired_store_w8a8.json): w8a8
NTP 84.2 tok/s; verify 0.95x, + store 0.93x; verify + branch 0.84x, + store 0.87x (16/16 equal to NTP each).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import sbd_ext
from sbd_ext.demo import models
from sbd_ext.recipes.drafter.prompts import eval_prompts
from sbd_ext.recipes.smollm2 import checkpoint

torch.set_num_threads(1)
scheme, N, MAXN, PASSES = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, tok = models.load("smollm2")
sbd_ext.quantize(model, scheme)
model.sbd_drafter.merge = None
d = model.sbd_drafter
store = d.draft_store
eos = tok.convert_tokens_to_ids("<|im_end|>")
prompts = [torch.tensor([checkpoint.chat_prompt(tok, p["text"])]) for p in eval_prompts()[:N]]
modes = {
    "ntp": (dict(mode="ntp", verify=False), True),
    "verify": (dict(branch=False), False),
    "verify_store": (dict(branch=False), True),
    "branch": (dict(branch=True), False),
    "branch_store": (dict(branch=True), True),
}


def run(m, p, n):
    kw, st = modes[m]
    d.draft_store = store if st else None
    return sbd_ext.generate(model, p, max_new_tokens=n, eos_token_id=eos, compile=True, **kw)


for m in modes:
    run(m, prompts[0], 8)
res = {m: dict(wall=0.0, nfe=0, tok=0, eq=0) for m in modes}
names = list(modes)
for _ in range(PASSES):
    for i, p in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        outs = {}
        for m in order:
            t0 = time.perf_counter()
            out = run(m, p, MAXN)
            dt = time.perf_counter() - t0
            r = res[m]
            r["wall"] += dt
            r["nfe"] += int(out.nfe.sum())
            r["tok"] += out.sequences.shape[1] - p.shape[1]
            outs[m] = out.sequences
        for m in names:
            res[m]["eq"] += int(torch.equal(outs[m], outs["ntp"]))
base = res["ntp"]["tok"] / res["ntp"]["wall"]
rows = {}
for m, r in res.items():
    rows[m] = dict(
        tok_s=round(r["tok"] / r["wall"], 2),
        x_ntp=round(r["tok"] / r["wall"] / base, 3),
        tok_fwd=round(r["tok"] / r["nfe"], 3),
        ms_fwd=round(r["wall"] / r["nfe"] * 1e3, 2),
        equal=f"{r['eq']}/{N * PASSES}",
    )
    print(scheme, m, rows[m], flush=True)
if len(sys.argv) > 5:
    with open(sys.argv[5], "w") as f:
        json.dump(dict(scheme=scheme, n=N, max_new=MAXN, passes=PASSES, rows=rows), f, indent=1)
