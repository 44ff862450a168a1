"""``sbd_ext.generate_reference``: the no-cache reference decoder the tests compare :func:`sbd_ext.generate` with.

Every forward recomputes each sequence from scratch with a dense 4D mask (prefix causal, block bidirectional)
through the model's own SDPA/eager attention and samples with the pure-PyTorch references of
:mod:`sbd_ext.reference`. Same arguments, outputs and random stream as :func:`~sbd_ext.generate`: with a
deterministic model it returns exactly the same tokens.
"""

from __future__ import annotations

import torch

from .. import families, reference
from .gen_config import resolve_settings
from .output import SBDGenerateOutput, finish
from .sampling import ban_mask, position_key, sample_block, sample_positions
from .settings import GenerationSettings, make_job, model_device_dtype
from .state import SequenceState, block_tensor

__all__ = ["generate_reference"]


@torch.no_grad()
def generate_reference(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    settings: GenerationSettings | None = None,
    *,
    return_trace: bool = True,
    **overrides,
) -> SBDGenerateOutput:
    """The no-cache reference decoder: every forward recomputes each sequence with a dense mask (sliding layers' with
    their window: :func:`sbd_ext.families.reference_mask`) through the model's own attention (SDPA/eager; the 'sbd'
    backend falls back to SDPA, or eager when soft-capping, for a 4D mask), one sequence at a time, and uses the
    pure-PyTorch reference samplers. Same arguments and outputs as :func:`generate` (no return_cache)."""
    families.check_model(model)
    job = make_job(model, input_ids, attention_mask, resolve_settings(model, settings, overrides))
    if job.verify:
        raise ValueError("generate_reference has no verify mode: compare sbd_ext.generate(verify=True) with mode='ntp'")
    device, dtype = model_device_dtype(model)
    B, K, V = len(job.prompts), job.block_size, job.vocab
    seqs = [SequenceState(prompt, job) for prompt in job.prompts]
    sbd = job.mode == "sbd"
    f = 0
    while not all(seq.done for seq in seqs):
        active = [not seq.done for seq in seqs]
        x = torch.zeros(B, K if sbd else 1, V, dtype=torch.float32, device=device)
        for b, seq in enumerate(seqs):
            if not active[b]:
                continue
            clean = seq.prompt + seq.gen
            toks = torch.tensor([clean + (seq.block if sbd else [])], dtype=torch.int64, device=device)
            n = toks.shape[1]
            out = (
                model(
                    input_ids=toks,
                    attention_mask=families.reference_mask(
                        model.config, len(clean), len(seq.block) if sbd else 0, dtype, device
                    ),
                    position_ids=torch.arange(n, device=device).view(1, n),
                    use_cache=False,
                )
                .logits[0]
                .float()
            )
            if sbd:
                x[b, : len(seq.block)] = out[len(clean) :]
            else:
                x[b, 0] = out[len(clean) - 1]
        if sbd:
            block = block_tensor(seqs, active, job)
            n_rev, n_rem = sample_block(
                x.cpu(), block, job.mask_id, job.sampler, job.threshold, job.temperature, job.seed, f, impl=reference
            )[:2]
            for b, seq in enumerate(seqs):
                if active[b]:
                    seq.after_sbd_forward(f, block[b].tolist(), int(n_rev[b]), int(n_rem[b]), b)
        else:
            keys = [position_key(b, seq.block_start) for b, seq in enumerate(seqs)]
            x = ban_mask(x.view(B, V).cpu(), job.mask_id)
            tok = sample_positions(x, job.temperature, job.seed, keys, impl=reference)[2]
            for b, seq in enumerate(seqs):
                if active[b]:
                    seq.after_ntp_forward(f, int(tok[b]), b)
        f += 1
    return finish(seqs, job, input_ids.device, return_trace)
