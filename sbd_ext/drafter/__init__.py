"""A gated SBD drafter: low-rank adapters that act on the set-block rows only, over a model that stays as it is.

The paper's conversion fine-tunes the shared weights, so the converted model's next-token behaviour moves. Here the
trainable part -- a :class:`GatedLoRALinear` on the chosen projections and the mask token's embedding row -- is
multiplied by a per-row gate that is 1 on the rows that hold the set block (mask slots and revealed-but-uncommitted
tokens) and 0 everywhere else. Commit rows and prompt rows therefore run the frozen base: every cached K/V and every
next-token distribution over the original vocabulary is the base model's own computation, so ``mode="ntp"`` and
``verify=True`` return exactly what the unmodified model returns, while the block rows of the same forward draft the
next block (Algorithm 3's one forward per cycle).

Where the gate comes from:

* decoding: a forward pre-hook on the decoder reads the ``sbd_plan`` keyword that every cached SBD forward carries
  (eager, compiled and CUDA alike) and sets the gate to ``n_commit[b] <= row < n_valid[b]``;
* training (:func:`distill_loss`): the clean half runs with the gate off (no autograd, its K/V computed once), the
  noisy half with the gate on;
* any other forward (a plain ``model(...)``, HF ``generate``, a training step of another objective): no gate is
  set, so the adapter is off and the model is the base. No path applies a gated adapter to every row: the artifact
  is not a peft LoRA (``peft_type`` is ``"SBD_GATED_LORA"``, which peft refuses), and :func:`merge`-style folding is
  impossible by construction (the gate depends on the row).

The objective (:func:`distill_loss`) distils the base: on each masked position t of the noisy half the drafter's
distribution is pulled to the base's own next-token distribution at t (read from the clean half's row t-1, so the
teacher costs nothing extra), KL(p_base || q_drafter) over the vocabulary without the mask token (or, with
``divergence``, the total variation or the cross-entropy on the base's greedy token; see docs/drafter.md).
Trained on the base's own answers (self-distillation, :mod:`sbd_ext.recipes.smollm2.drafter`) the drafter learns
what *this* model says, on whatever it is asked.

Artifact (:func:`save_drafter` / :func:`load_drafter`), a folder in peft's layout:

* ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight``
  [out, r] (peft's names and shapes), plus ``sbd_mask_row`` [H] (fp32);
* ``adapter_config.json``: peft's LoRA fields (``r``, ``lora_alpha``, ``target_modules``, ``task_type``,
  ``base_model_name_or_path``) with ``peft_type = "SBD_GATED_LORA"`` and an ``sbd`` object: ``gated``,
  ``mask_token_id``, ``sbd_block_size_range``, ``base_loader``, the recommended decoding settings (``generation``)
  and provenance; a drafter over a user's own checkpoint has no ``base_loader``: its base is the local folder
  ``base_model_name_or_path`` names (:func:`load_folder_base`; ``load_drafter(..., base=DIR)`` points it elsewhere);
* optionally a sampler head (:mod:`sbd_ext.drafter.sampler_head`: verify's slot-1 draft rescored given slot 0's
  token): tensors ``sbd_sampler_head.{w1,b1,w2,b2,a}`` and ``sbd.sampler_head`` (``hidden``, ``topk``, provenance).
  Loaded as ``model.sbd_drafter.sampler_head``; verify decoding uses it (set it to None for the drafter's own
  ranking). It changes which tokens are drafted, never what verify returns.
* optionally a draft store (:class:`sbd_ext.decoding.lookup.DraftStore`: n-gram -> next token over the base's own
  answers, verify's lookup drafts where the context has none): tensors ``sbd_draft_store.keys`` [N, n_max] and
  ``sbd_draft_store.next`` [N] (int32) and ``sbd.draft_store`` (``entries``, ``n_max``, ``n_min``, provenance).
  Loaded as ``model.sbd_drafter.draft_store`` (None: the context's drafts only); like the head, it changes which
  tokens are drafted, never what verify returns.
"""

from .artifact import (
    CHECKPOINT_SUBFOLDER,
    CONFIG_FILE,
    PEFT_TYPE,
    WEIGHTS_FILE,
    attach_from_checkpoint,
    base_folder,
    is_drafter,
    load_drafter,
    load_folder_base,
    load_weights,
    read_drafter_config,
    save_drafter,
)
from .gate import (
    Drafter,
    GatedLoRALinear,
    GatedMaskRow,
    RowGate,
    attach,
    detach,
    gate_rows,
    get_drafter,
    grow_rank,
    unwrapped,
)
from .loss import DIVERGENCES, distill_loss, slot_accuracy
from .sampler_head import SamplerHead

__all__ = [
    "RowGate",
    "GatedLoRALinear",
    "GatedMaskRow",
    "Drafter",
    "attach",
    "detach",
    "get_drafter",
    "gate_rows",
    "unwrapped",
    "grow_rank",
    "distill_loss",
    "DIVERGENCES",
    "slot_accuracy",
    "SamplerHead",
    "save_drafter",
    "load_drafter",
    "load_folder_base",
    "base_folder",
    "load_weights",
    "is_drafter",
    "read_drafter_config",
    "attach_from_checkpoint",
    "PEFT_TYPE",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "CHECKPOINT_SUBFOLDER",
]
