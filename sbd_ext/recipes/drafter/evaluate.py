"""The drafter's evaluation: tokens per forward of decoding settings on the held-out prompts of its task, equality
with the base's NTP decoding (and, on the arithmetic task, accuracy), and the teacher-forced accuracy per slot."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ... import drafter as drafter_mod
from ...demo import models, tasks
from .bases import artifact_base, artifact_task, load_task_base, task_prompts
from .data import generate_padded


def slot_accuracy(
    artifact: Path, prompts: list[list[int]], answers: list[list[int]], block_size: int, device: str = "cpu"
) -> list[float]:
    """:func:`sbd_ext.drafter.slot_accuracy` of the drafter in ``artifact`` on its task's frozen base."""
    model, _, _ = load_task_base(artifact_task(artifact), attn_implementation="sdpa", base=artifact_base(artifact))
    drafter_mod.load_weights(model, artifact)
    model.to(device)
    return drafter_mod.slot_accuracy(model, prompts, answers, block_size)


def evaluate(
    artifact: Path,
    n: int,
    max_new_tokens: int,
    settings: list[dict],
    batch_size: int = 8,
    slots: int = 0,
    device: str = "cpu",
) -> list[dict]:
    """Tokens per forward of each decoding ``settings`` (dicts of sbd_ext.generate keywords) with the drafter in
    ``artifact`` on the first ``n`` held-out prompts of its task, and whether verify / NTP equal the base's NTP
    decoding; arithmetic drafters also get each row's accuracy on the held-out problems. ``slots`` > 0: also the
    drafter's teacher-forced accuracy per slot of blocks of that size on the base's answers (:func:`slot_accuracy`)."""
    task = artifact_task(artifact)
    model, tok = models.load(artifact)
    model.to(device)
    if artifact_base(artifact):
        eos = None  # a model of the user's: its generation config's
    else:
        eos = tok.eos_token_id if task == "arith" else tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [x for _, x in task_prompts(tok, task, "test", n)]
    problems = list(tasks.problems("test", n)) if task == "arith" else None

    def accuracy(answers) -> dict:
        if problems is None:
            return {}
        texts = [tok.decode(a, skip_special_tokens=True) for a in answers]
        return {"accuracy": round(tasks.accuracy(texts, problems), 4)}

    drafter = drafter_mod.get_drafter(model)
    head = drafter.sampler_head

    def run(**kw):
        # sampler_head=False: this row without the drafter's sampler head (the ablation)
        drafter.sampler_head = head if kw.pop("sampler_head", True) else None
        toks, nfe, answers = 0, 0, []
        for lo in range(0, len(prompts), batch_size):
            chunk = prompts[lo : lo + batch_size]
            res, got = generate_padded(model, chunk, 0, max_new_tokens=max_new_tokens, eos_token_id=eos, **kw)
            toks += int(res.num_generated.sum())
            nfe += int(res.nfe.sum())
            answers += got
        return toks, nfe, answers

    t0 = time.time()
    ntp_toks, ntp_nfe, ntp_answers = run(mode="ntp", verify=False)
    rows = [
        {"mode": "ntp", "tokens": ntp_toks, "nfe": ntp_nfe, "tokens_per_forward": round(ntp_toks / ntp_nfe, 3)}
        | accuracy(ntp_answers)
    ]
    print(json.dumps(rows[-1]), flush=True)
    if slots:
        acc = slot_accuracy(artifact, prompts, ntp_answers, slots, device=device)
        rows.append({"block_size": slots, "slot_accuracy": [round(a, 4) for a in acc]})
        print(json.dumps(rows[-1]), flush=True)
    for kw in settings:
        toks, nfe, answers = run(**kw)
        same = sum(a == b for a, b in zip(answers, ntp_answers, strict=True))
        rows.append(
            {
                **kw,
                "tokens": toks,
                "nfe": nfe,
                "tokens_per_forward": round(toks / nfe, 3),
                "equal_to_ntp": f"{same}/{len(prompts)}",
                "forwards_vs_ntp": round(ntp_nfe / nfe, 3),
            }
            | accuracy(answers)
        )
        print(json.dumps(rows[-1]), flush=True)
    print(f"drafter eval: {n} prompts, {max_new_tokens} new tokens, {time.time() - t0:.0f} s", flush=True)
    return rows


def verify_settings(generation: dict) -> dict:
    """``sbd_ext.generate`` keywords of verify decoding at a drafter's recommended ``generation`` settings (its
    config's ``sbd.generation``)."""
    return dict(
        block_size=generation["sbd_block_size"],
        sampler=generation["sbd_sampler"],
        threshold=generation["sbd_threshold"],
        verify=True,
        lookup=generation.get("sbd_lookup", 0),
        branch=generation.get("sbd_branch", False),
        alternates=generation.get("sbd_alternates", 0),
    )
