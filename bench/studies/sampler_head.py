"""Study: would a sampler head that conditions the drafter's 2-ahead draft on the token before it pay?

In verify decoding with k=2 the block's slot 0 comes from the commit row (the base's own next token t0) and slot 1 is
the drafter's 2-ahead guess, made without knowing t0 (both slots are masks when the block rows run). A small head
after the forward could rescore slot 1's top candidates given t0 (the "sampler head" of Samragh et al., arXiv
2507.11851, which conditions each draft on the one before it). Lossless either way: verify checks every draft.

This script measures the head's ceiling before any decoding code is written:

1. ``collect``: teacher-forced features of the shipped drafter at slot 1 of fully masked k=2 blocks over the base's
   own answers (the SBD layout of ``distill_loss``): the slot's top-64 candidates and log-probabilities, t0, the
   drafter's own slot-0 guess g0, the block row's final hidden state h1, the clean row's hc (the row that predicts
   t0), and the base's greedy token at slot 1 (the target);
2. ``fit``: trains rescoring heads ``score(c) = a * logq(c) + u(features) . E[c]`` over the 64 candidates (E the tied
   embedding/head matrix, u an MLP) on one feature file set and reports slot-1 accuracy on another (held-out prompts).

    python bench/studies/sampler_head.py heldout --out HELDOUT_ANSWERS.pt
    python bench/studies/sampler_head.py collect --samples RUN/samples.pt --out F.pt [--limit N] [--threads 2]
    python bench/studies/sampler_head.py fit --train F1.pt,F2.pt --val HELDOUT.pt [--json OUT.json]
    python bench/studies/sampler_head.py curve --train F1.pt,F2.pt --val HELDOUT.pt --sizes 68000,140000 [--json OUT]

``curve`` trains the heads of t0 alone and of t0 with the block row's hidden state on growing random subsets of the
training positions (the same order for every size), each evaluated on the held-out features.

Results and the decision: docs/drafter.md, "A sampler head on slot 1 (a study)".
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

TOPK = 64


def heldout(out: str, threads: int, max_new_tokens: int = 128) -> None:
    """The base's greedy answers (sbd_ext's NTP decoding) to the 56 held-out prompts, in ``samples.pt``'s format."""
    from sbd_ext.demo import models
    from sbd_ext.recipes.drafter.prompts import eval_prompts
    from sbd_ext.recipes.smollm2 import checkpoint
    from sbd_ext.recipes.smollm2 import drafter as recipe

    torch.set_num_threads(threads)
    model, tok = models.load("smollm2")
    model.eval()
    texts = [p["text"] for p in eval_prompts()]
    ids = [checkpoint.chat_prompt(tok, t) for t in texts]
    res = []
    for lo in range(0, len(ids), 14):
        answers = recipe.greedy_answers(
            model, ids[lo : lo + 14], max_new_tokens, tok.eos_token_id, tok.pad_token_id or 0
        )
        res += [
            {"prompt": t, "prompt_ids": x, "answer_ids": a}
            for t, x, a in zip(texts[lo : lo + 14], ids[lo : lo + 14], answers, strict=True)
        ]
    torch.save(res, out)


def collect(samples_path: str, out: str, limit: int | None, threads: int) -> dict:
    from sbd_ext.demo import models
    from sbd_ext.drafter.sampler_head import collect_slot1

    torch.set_num_threads(threads)
    model, _ = models.load("smollm2")
    model.sbd_drafter.sampler_head = None  # the drafter's own ranking
    res = collect_slot1(model, torch.load(samples_path, weights_only=True)[:limit], topk=TOPK, extra=True)
    torch.save(res, out)
    summary = {
        "positions": len(res["tgt"]),
        "slot1_top1": float((res["top_i"][:, 0] == res["tgt"]).float().mean()),
        "slot1_top4": float((res["top_i"][:, :4] == res["tgt"][:, None]).any(1).float().mean()),
        "slot1_top64": float((res["top_i"] == res["tgt"][:, None]).any(1).float().mean()),
    }
    print(json.dumps(summary), flush=True)
    return summary


class Rescorer(nn.Module):
    """score(c) = a * logq(c) + MLP(features) . E[c] over the slot's top-64 candidates c; zero-initialised, so it
    starts as the drafter's own ranking."""

    def __init__(self, E: torch.Tensor, feats: tuple[str, ...], hidden: int = 512, dropout: float = 0.1):
        super().__init__()
        self.E, self.feats = E, feats
        H = E.shape[1]
        self.net = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(H * len(feats) + 1, hidden), nn.SiLU(), nn.Linear(hidden, H)
        )
        nn.init.zeros_(self.net[3].weight)
        nn.init.zeros_(self.net[3].bias)
        self.a = nn.Parameter(torch.ones(()))

    def forward(self, d: dict, idx: torch.Tensor) -> torch.Tensor:
        t0, g0 = d["t0"][idx].long(), d["g0"][idx].long()
        src = {
            "t0": lambda: self.E[t0],
            "g0": lambda: self.E[g0],
            "h1": lambda: d["h1"][idx].float(),
            "hc": lambda: d["hc"][idx].float(),
        }
        x = torch.cat([src[f]() for f in self.feats] + [(g0 == t0).float()[:, None]], -1)
        cand = self.E[d["top_i"][idx].long()]
        return self.a * d["top_l"][idx].float() + torch.einsum("nkh,nh->nk", cand, self.net(x))


def load(train: list[str], val: str) -> tuple[dict, dict, torch.Tensor]:
    """The training feature files concatenated, the held-out features, and the model's output embedding."""
    from sbd_ext.demo import models

    parts = [torch.load(p, weights_only=True) for p in train]
    tr = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    va = torch.load(val, weights_only=True)
    model, _ = models.load("smollm2")
    return tr, va, model.get_output_embeddings().weight.detach().float()


def train_rescorer(E: torch.Tensor, tr: dict, va: dict, feats: tuple[str, ...], dropout: float, epochs: int) -> list:
    """A :class:`Rescorer` of ``feats`` trained on ``tr`` (the base's token among the candidates; positions where it
    is not among them carry no loss); its held-out top-1 accuracy on ``va`` after each epoch."""
    lab = (tr["top_i"] == tr["tgt"][:, None]).long().argmax(1)
    has = (tr["top_i"] == tr["tgt"][:, None]).any(1)
    m = Rescorer(E, feats, dropout=dropout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05)
    per_epoch = []
    for _ in range(epochs):
        m.train()
        perm = torch.randperm(len(tr["tgt"]))
        for lo in range(0, len(perm), 512):
            idx = perm[lo : lo + 512]
            idx = idx[has[idx]]
            loss = F.cross_entropy(m(tr, idx), lab[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.eval()
        with torch.no_grad():
            pick = va["top_i"].gather(1, m(va, torch.arange(len(va["tgt"]))).argmax(1, keepdim=True)).squeeze(1)
        per_epoch.append(round(float((pick == va["tgt"]).float().mean()), 4))
    return per_epoch


def fit(train: list[str], val: str, threads: int, epochs: int = 5, out_json: str | None = None) -> list[dict]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tr, va, E = load(train, val)
    base = {
        "train_positions": len(tr["tgt"]),
        "val_positions": len(va["tgt"]),
        "drafter_val_top1": float((va["top_i"][:, 0] == va["tgt"]).float().mean()),
        "val_top64": float((va["top_i"] == va["tgt"][:, None]).any(1).float().mean()),
    }
    print(json.dumps(base), flush=True)
    rows = []
    for feats, dropout in (
        (("t0",), 0.1),
        (("t0", "g0"), 0.1),
        (("t0", "g0", "h1"), 0.3),
        (("t0", "g0", "hc"), 0.3),
        (("t0", "g0", "h1", "hc"), 0.3),
    ):
        per_epoch = train_rescorer(E, tr, va, feats, dropout, epochs)
        row = {"features": list(feats), "dropout": dropout, "val_top1_by_epoch": per_epoch}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"baseline": base, "heads": rows, "train": train, "val": val}, f, indent=1)
    return rows


def curve(train: list[str], val: str, sizes: list[int], threads: int, epochs: int = 5, out_json: str | None = None):
    """Held-out slot-1 accuracy of heads trained on the first ``sizes`` positions of one random order of ``train``."""
    torch.set_num_threads(threads)
    tr_all, va, E = load(train, val)
    order = torch.randperm(len(tr_all["tgt"]), generator=torch.Generator().manual_seed(0))
    res = {
        "val_positions": len(va["tgt"]),
        "drafter_val_top1": float((va["top_i"][:, 0] == va["tgt"]).float().mean()),
        "train_total": len(order),
        "rows": [],
    }
    print(json.dumps(res), flush=True)
    for n in sizes:
        tr = {k: v[order[:n]] for k, v in tr_all.items()}
        for feats, dropout in ((("t0",), 0.1), (("t0", "h1"), 0.3), (("t0", "g0", "h1"), 0.3)):
            torch.manual_seed(0)  # each head from the same start, whatever ran before it
            per_epoch = train_rescorer(E, tr, va, feats, dropout, epochs)
            row = {"train_positions": n, "features": list(feats), "dropout": dropout, "val_top1_by_epoch": per_epoch}
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(res | {"train": train, "val": val}, f, indent=1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heldout")
    h.add_argument("--out", required=True)
    h.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("collect")
    c.add_argument("--samples", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--limit", type=int)
    c.add_argument("--threads", type=int, default=2)
    f = sub.add_parser("fit")
    f.add_argument("--train", required=True, help="comma-separated feature files")
    f.add_argument("--val", required=True)
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--epochs", type=int, default=5)
    f.add_argument("--json")
    cv = sub.add_parser("curve")
    cv.add_argument("--train", required=True, help="comma-separated feature files")
    cv.add_argument("--val", required=True)
    cv.add_argument("--sizes", required=True, help="comma-separated counts of training positions")
    cv.add_argument("--threads", type=int, default=1)
    cv.add_argument("--epochs", type=int, default=5)
    cv.add_argument("--json")
    a = ap.parse_args()
    if a.cmd == "heldout":
        heldout(a.out, a.threads)
    elif a.cmd == "collect":
        collect(a.samples, a.out, a.limit, a.threads)
    elif a.cmd == "curve":
        curve(a.train.split(","), a.val, [int(x) for x in a.sizes.split(",")], a.threads, a.epochs, a.json)
    else:
        fit(a.train.split(","), a.val, a.threads, a.epochs, a.json)


if __name__ == "__main__":
    main()
