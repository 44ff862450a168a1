"""Study: the sampler head chained over a larger block (k = 3, 4), not kept.

The shipped head rescores slot 1 given slot 0's token (the commit row's, known after the forward). With k >= 3 the
same head could rescore each later slot j given the token chosen at slot j-1 (its revealed token, or the argmax of
its rescored logits), so slot 2's draft is conditioned on slot 1's. This script decodes the first 16 held-out prompts
x 128 new tokens with the shipped drafter, verify + branch (+ lookup 16), k = 2, 3, 4, with the head chained this way
(``chain``) or as shipped (``slot1``), and prints the recipe's eval rows (tokens per forward, equality with NTP):

    python bench/studies/head_chain.py --mode chain --threads 1 [--json OUT.json]
    python bench/studies/head_chain.py --mode slot1 --threads 1

Result (2026-11-27, bench/results/drafter/head_chain_16x128.json): k=3 1.569 -> 1.633 tokens per forward chained, k=4
1.581 chained, both at or below k=2's 1.636 (the head on slot 1 alone, a forward of fewer rows): not kept.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sbd_ext.decoding import rows as reveal_rows
from sbd_ext.decoding.sampling import ban_mask
from sbd_ext.recipes.smollm2 import drafter as recipe

DRAFTER = Path(__file__).resolve().parents[2] / "sbd_ext" / "demo" / "models" / "smollm2-drafter"


def chained(job, x, block):
    """``rows.rescore_slot1`` over every slot j >= 1 of ``x`` [B, K, V], given slot j-1's token."""
    head, emb = job.sampler_head
    ban_mask(x, job.mask_id)
    prev = block[:, 0]
    for j in range(1, x.shape[1]):
        masked = block[:, j] == job.mask_id
        cond = (prev != job.mask_id) & masked
        new = head.rescore_(x[:, j].clone(), torch.where(cond, prev, 0), emb)
        x[:, j] = torch.where(cond.view(-1, 1), new, x[:, j])
        prev = torch.where(masked, x[:, j].argmax(-1), block[:, j])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("chain", "slot1"), default="chain")
    ap.add_argument("--artifact", default=str(DRAFTER))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "chain":
        reveal_rows.rescore_slot1 = chained  # sample_rows (the block's, the branch's, the alternates') looks it up
    verify = dict(verify=True, sampler="eb", threshold=100.0, branch=True)
    settings = [verify | dict(block_size=k, lookup=16) for k in (2, 3, 4)]
    settings += [verify | dict(block_size=k, lookup=0) for k in (2, 3)]
    rows = recipe.evaluate(Path(args.artifact), args.n, args.max_new_tokens, settings)
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": args.mode, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
