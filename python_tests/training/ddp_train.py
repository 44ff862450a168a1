"""Train a small random Llama with SBDTrainer and write the logged history as JSON: the script the distributed test
launches under ``accelerate launch`` (1 process x batch 2b and 2 processes x batch b).

    accelerate launch --cpu --num_processes N python_tests/training/ddp_train.py --batch B --out history.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from sbd_ext.training import SBDTrainer

V, MASK, PAD = 48, 47, 0


class Sequences(torch.utils.data.Dataset):
    """Periodic sequences of lengths 9..16 (right-padded by the collator), labels = the tokens."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(9, 17, (1,), generator=g))
            period = int(torch.randint(2, 5, (1,), generator=g))
            base = torch.randint(1, MASK, (period,), generator=g)
            self.items.append(base.repeat(length // period + 1)[:length])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def collate(items):
    L = max(len(x["input_ids"]) for x in items)
    ids = torch.full((len(items), L), PAD)
    am = torch.zeros((len(items), L), dtype=torch.long)
    for b, x in enumerate(items):
        ids[b, : len(x["input_ids"])] = x["input_ids"]
        am[b, : len(x["input_ids"])] = 1
    labels = ids.masked_fill(am == 0, -100)
    return {"input_ids": ids, "attention_mask": am, "labels": labels}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, required=True, help="per-process batch")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    cfg._attn_implementation = "sdpa"
    cfg.mask_token_id = MASK
    model = LlamaForCausalLM(cfg)
    args = TrainingArguments(
        output_dir=a.out + ".trainer",
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_drop_last=True,
    )
    trainer = SBDTrainer(
        model=model, args=args, train_dataset=Sequences(256), data_collator=collate, block_size_range=(2, 6)
    )
    trainer.train()
    if trainer.is_world_process_zero():
        hist = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
        with open(a.out, "w") as f:
            json.dump({"world": trainer.accelerator.num_processes, "history": hist}, f)
    # Leave without tearing gloo down. Freed at the end of main(), DDP's reducer drops the last reference to the
    # process group; ~ProcessGroupGloo joins its worker thread while the main thread holds the GIL, and the worker,
    # still destroying the last barrier's work, waits for the GIL to release that work's tensors: a deadlock (torch
    # 2.13; py-spy: MainThread in std::thread::join under ~Reducer, the worker in gil_scoped_acquire under
    # ~AsyncBarrierWork), in 2 of 3 launches on a loaded 2-core machine. Left to the interpreter's exit instead,
    # gloo's threads could be destroyed while joinable (SIGABRT). Both ranks have passed the barrier, so nothing is
    # in flight: flush and exit the process directly.
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
