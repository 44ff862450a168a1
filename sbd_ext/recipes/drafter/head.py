"""The drafter's sampler head (:mod:`sbd_ext.drafter.sampler_head`): slot 1 of a block rescored given slot 0's
token, trained on the drafter's own slot-1 candidates over the base's answers."""

from __future__ import annotations

from pathlib import Path

import torch

from ... import drafter as drafter_mod
from ...demo import models
from ...drafter import sampler_head as sh


def train_head(
    out: Path,
    artifact: Path,
    samples: list[Path],
    limit: int | None = None,
    epochs: int = 5,
    hidden: int = 512,
    topk: int = 64,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Train a sampler head (:mod:`sbd_ext.drafter.sampler_head`) for the drafter in ``artifact`` on its slot-1
    candidates over the base's answers in ``samples`` (``samples.pt`` files of ``data``; the first ``limit`` of
    each), and write the drafter with it to ``out/artifact`` (``ship --out out`` ships it). The features of each
    file are cached in ``out`` (computed once: two forwards of every sample)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter_mod.read_drafter_config(artifact)
    model, _ = models.load(artifact)
    model.to(device)
    drafter = drafter_mod.get_drafter(model)
    drafter.sampler_head = None  # the features are the drafter's own ranking
    parts = []
    for i, path in enumerate(samples):
        cache = out / f"head_features_{i}.pt"
        key = {"source": str(Path(path).resolve()), "limit": limit, "artifact": str(Path(artifact).resolve())}
        got = torch.load(cache, weights_only=True) if cache.is_file() else None
        if got is None or got.get("key") != key:
            rows = torch.load(path, weights_only=True)[:limit]
            got = {"key": key, "feats": sh.collect_slot1(model, rows, topk=topk)}
            torch.save(got, cache)
        parts.append(got["feats"])
    feats = {n: torch.cat([p[n] for p in parts]) for n in sh.FEATURES}
    emb = model.get_input_embeddings().weight.detach().cpu()
    torch.manual_seed(seed)
    head = sh.SamplerHead(emb.shape[1], hidden=hidden, topk=topk)
    before = sh.accuracy(None, emb, feats)
    losses = sh.fit(head, emb, feats, epochs=epochs, seed=seed)
    after = sh.accuracy(head, emb, feats)
    print(f"sampler head: {len(feats['tgt'])} positions, slot-1 accuracy {before:.4f} -> {after:.4f}", flush=True)
    drafter.sampler_head = head
    sbd = {k: v for k, v in cfg["sbd"].items() if k not in ("gated", "mask_token_id")}
    sbd["sampler_head"] = {
        "samples": [str(p) for p in samples],
        "limit": limit,
        "positions": len(feats["tgt"]),
        "epochs": epochs,
        "seed": seed,
        "train_loss": [round(x, 4) for x in losses],
        "train_accuracy_before": round(before, 4),
        "train_accuracy_after": round(after, 4),
    }
    dest = out / "artifact"
    drafter_mod.save_drafter(model, dest, sbd, base_model_name_or_path=cfg.get("base_model_name_or_path", ""))
    return dest
