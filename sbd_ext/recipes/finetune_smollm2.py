"""Moved: the SmolLM2 fine-tune is the package :mod:`sbd_ext.recipes.smollm2` (``python -m sbd_ext.recipes.smollm2
train --objective sbd|ntp --out DIR [--resume]``; evaluation: ``... eval``)."""

raise ImportError(
    "sbd_ext.recipes.finetune_smollm2 moved: run `python -m sbd_ext.recipes.smollm2 train --objective sbd --out DIR` "
    "(and `--objective ntp` for the control); in Python: sbd_ext.recipes.smollm2.finetune.train"
)
