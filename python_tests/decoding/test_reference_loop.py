"""sbd_ext.generate against a minimal SBD decoder written here, token for token, on the embedded SBD model.

``generate_reference`` (the library's no-cache decoder) shares the per-sequence state machine (``_Seq``),
``sample_block`` and ``_finish`` with ``generate``, so a bug there would pass the cached-vs-reference tests. The loop
below shares nothing with sbd_ext but the model weights: batch 1, greedy, the entropy-bounded (EB) rule, no KV cache
(every forward recomputes prompt + output + block with a hand-built mask through transformers' eager attention),
entropies in fp64, written from the paper (Gat et al. 2025, Alg. 2/3, Eq. 8) and the stopping rule of decoding.py's
docstring:

* a block is min(k, tokens left in the budget) mask tokens after the output so far;
* one forward: clean rows causal, block rows see every clean row and the whole block (bidirectional); the
  prediction for block position i is read from the output AT position i; the mask token is never proposed;
* EB: sort the masked positions by entropy (ascending, ties by position), reveal the longest prefix whose entropies,
  all but the last, sum to <= gamma (always >= 1 position);
* the block is done when nothing is masked; the sequence stops at max_new_tokens, or at the first EOS once every
  position before it is revealed (the EOS is kept, the positions after it are dropped).
"""

from __future__ import annotations

import pytest
import torch

import sbd_ext
import sbd_ext.hf
from sbd_ext.demo import models, tasks

pytestmark = pytest.mark.skipif(
    not sbd_ext.hf.kernel_available(torch.device("cpu")), reason="the block_attention CPU kernel is not built"
)

N_PROMPTS = 4


@pytest.fixture(scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.8 M-parameter model: threads only add synchronisation
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def sbd_model(one_thread):
    model, tok = models.load(models.DEFAULT_MODEL)  # attn "sbd": what generate runs
    eager, _ = models.load(models.DEFAULT_MODEL, attn_implementation="eager")  # matmul + softmax, pure PyTorch
    info = models.demo_info()
    prompts = [info["prompt_template"].format(prompt=p.prompt) for p in tasks.problems("test", N_PROMPTS)]
    return model, eager, tok, [tok(p).input_ids for p in prompts]


def _block_mask(n_clean: int, k: int) -> torch.Tensor:
    """[1, 1, n, n] additive mask: causal over the clean rows, the last k rows see all clean rows and each other."""
    n = n_clean + k
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[n_clean:, n_clean:] = True
    return torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def _eb_reveal(entropy: list[float], masked: list[int], gamma: float) -> tuple[list[int], float]:
    """Positions the EB rule reveals, and how far the decision was from gamma (the margin of the last test)."""
    order = sorted(masked, key=lambda j: (entropy[j], j))
    chosen, before, margin = [order[0]], entropy[order[0]], float("inf")
    for j in order[1:]:
        margin = min(margin, abs(before - gamma))
        if before > gamma:
            break
        chosen.append(j)
        before += entropy[j]
    return sorted(chosen), margin


@torch.no_grad()
def minimal_sbd(model, prompt: list[int], k: int, gamma: float, max_new: int, eos: int, mask_id: int):
    """(generated tokens, nfe, trace [(forward, positions, tokens)], smallest EB decision margin)."""
    gen: list[int] = []
    trace = []
    nfe, margin = 0, float("inf")
    while True:
        block = [mask_id] * min(k, max_new - len(gen))
        start = len(prompt) + len(gen)
        while mask_id in block:
            ids = torch.tensor([prompt + gen + block])
            n = ids.shape[1]
            logits = model(
                input_ids=ids,
                attention_mask=_block_mask(start, len(block)),
                position_ids=torch.arange(n)[None],
                use_cache=False,
            ).logits[0, start:]
            nfe += 1
            logits = logits.double()
            logits[:, mask_id] = float("-inf")
            logp = torch.log_softmax(logits, dim=-1)
            entropy = (-(logp.exp() * logp).nansum(-1)).tolist()
            proposal = logits.argmax(-1).tolist()
            masked = [j for j, t in enumerate(block) if t == mask_id]
            reveal, m = _eb_reveal(entropy, masked, gamma)
            margin = min(margin, m)
            for j in reveal:
                block[j] = proposal[j]
            trace.append((nfe - 1, [start + j for j in reveal], [block[j] for j in reveal]))
            stop = next((j for j, t in enumerate(block) if t == eos), None)
            if stop is not None and mask_id not in block[:stop]:
                gen += block[: stop + 1]
                end = start + stop + 1
                trace = [
                    (f, [p for p in ps if p < end], [t for p, t in zip(ps, ts, strict=True) if p < end])
                    for f, ps, ts in trace
                ]
                return gen, nfe, trace, margin
        gen += block
        if len(gen) >= max_new:
            return gen, nfe, trace, margin


@pytest.mark.parametrize(
    "k,gamma,max_new",
    [
        (8, 0.1, 160),  # the demo's setting: answers end at EOS
        (8, 0.35, 160),
        (16, 0.01, 160),
        (8, 0.1, 21),  # the budget ends inside the third block: the last block is shortened to 5 positions
        (4, 0.05, 160),  # small blocks: many block starts per answer
    ],
)
def test_generate_matches_minimal_decoder(sbd_model, k, gamma, max_new):
    model, eager, tok, prompts = sbd_model
    mask_id, eos = model.config.mask_token_id, tok.eos_token_id
    stopped_at_eos = 0
    for i, prompt in enumerate(prompts):
        want, nfe, trace, margin = minimal_sbd(eager, prompt, k, gamma, max_new, eos, mask_id)
        # fp32 kernel entropies vs the fp64 ones here: a decision closer to gamma than this could go either way.
        assert margin > 1e-4, f"prompt {i}: an EB decision is within {margin:.1e} of gamma; pick another prompt"
        out = sbd_ext.generate(
            model,
            torch.tensor([prompt]),
            block_size=k,
            sampler="eb",
            threshold=gamma,
            temperature=0.0,
            max_new_tokens=max_new,
            eos_token_id=eos,
        )
        got = out.sequences[0, len(prompt) : len(prompt) + int(out.num_generated[0])].tolist()
        assert got == want, f"prompt {i}:\n got  {tok.decode(got)!r}\n want {tok.decode(want)!r}"
        assert int(out.nfe[0]) == nfe, f"prompt {i}"
        assert out.trace[0] == trace, f"prompt {i}"
        stopped_at_eos += want[-1] == eos
        assert len(want) <= max_new and (want[-1] == eos or len(want) == max_new)
    if max_new == 160:
        assert stopped_at_eos == len(prompts)  # the EOS path was exercised on every prompt
    else:
        assert stopped_at_eos == 0  # the budget path
