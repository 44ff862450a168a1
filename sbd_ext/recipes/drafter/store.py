"""The drafter's draft store (:class:`sbd_ext.decoding.lookup.DraftStore`): n-gram -> the token that most often
followed it in the base's own answers, verify's lookup drafts where the context has none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ... import drafter as drafter_mod
from ...artifact_checks import load_tensor_file
from ...decoding.lookup import DraftStore
from ...drafter.artifact import STORE_PREFIX, draft_store_entries


def build_store(
    out: Path,
    artifact: Path,
    samples: list[Path],
    limit: int | None = None,
    n_max: int = 4,
    n_min: int = 2,
    min_count: int = 3,
    min_share: float = 0.6,
) -> Path:
    """Build a draft store over the answers in ``samples`` (``samples.pt`` files of ``data``; the first ``limit``
    of each) and write the drafter in ``artifact`` with it (replacing any it had) to ``out/artifact`` (``ship --out
    out`` ships it; ``artifact`` may be that folder itself). The drafter's other tensors and fields are copied as
    they are."""
    from safetensors.torch import save_file

    cfg = drafter_mod.read_drafter_config(artifact)
    answers, n_tokens = [], 0
    for path in samples:
        for row in torch.load(path, weights_only=True)[:limit]:
            ids = row["answer_ids"]
            answers.append(ids.tolist() if isinstance(ids, torch.Tensor) else list(ids))
            n_tokens += len(answers[-1])
    store = DraftStore.from_sequences(answers, n_max, n_min, min_count, min_share)
    mask = cfg["sbd"]["mask_token_id"]
    stored, spec = draft_store_entries(store)
    if any(bool((t == mask).any()) for t in stored.values()):
        raise ValueError(f"build_store: the answers hold the mask token {mask}")
    print(f"draft store: {len(answers)} answers, {n_tokens} tokens, {len(store)} n-grams", flush=True)
    tensors = {
        k: v
        for k, v in load_tensor_file(Path(artifact) / drafter_mod.WEIGHTS_FILE).items()
        if not k.startswith(STORE_PREFIX)
    }
    tensors.update(stored)
    cfg["sbd"]["draft_store"] = {
        "samples": [str(p) for p in samples],
        "limit": limit,
        "answers": len(answers),
        "answer_tokens": n_tokens,
        "min_count": min_count,
        "min_share": min_share,
        **spec,
    }
    dest = Path(out) / "artifact"
    dest.mkdir(parents=True, exist_ok=True)
    for f in Path(artifact).iterdir():  # anything else the folder carries (ship_check.json, ...)
        if f.is_file() and f.name not in (drafter_mod.WEIGHTS_FILE, drafter_mod.CONFIG_FILE):
            if f.resolve() != (dest / f.name).resolve():  # (``out`` may be the artifact's own run folder)
                shutil.copy2(f, dest / f.name)
    save_file(tensors, dest / drafter_mod.WEIGHTS_FILE)
    (dest / drafter_mod.CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
    return dest
