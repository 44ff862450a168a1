"""The drafter's sampler head: slot 1's draft rescored given the token before it (verify decoding).

In verify decoding the block's first slot is the base's own next token t0 (the commit row's choice), known only
after the forward; the block rows drafted slot 1 without it (both slots were masks). The sampler head (after
Samragh et al., arXiv 2507.11851, whose sampler conditions each draft on the one before it) rescores slot 1's top
candidates given t0, on the host side of the reveal, at the cost of one small MLP per sequence:

    logq = log_softmax(slot-1 logits);  (l, c) = the top-``topk`` of logq
    u = W2 · silu(W1 · E[t0] + b1) + b2            (E: the model's input embedding, [V, H])
    score(c_i) = a · l_i + E[c_i] · u              (every other token: -inf)

Zero-initialised (W2 = 0, b2 = 0, a = 1) it ranks exactly as the drafter does. It only changes which tokens are
drafted; verify checks every draft against the base's own choice, so the output is the base's whatever the head
says (tested). Trained on the drafter's teacher-forced slot-1 candidates over the base's own answers
(:func:`collect_slot1`, :func:`fit`), the cross-entropy of the base's greedy token among the candidates.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import families
from ..ops import topk_logsumexp
from .gate import get_drafter
from .loss import clean_and_noisy_forward, padded_batch

__all__ = ["SamplerHead", "collect_slot1", "fit", "rescore_reference"]

FEATURES = ("top_i", "top_l", "t0", "tgt")


class SamplerHead(nn.Module):
    """See the module doc. Parameters: ``w1`` [hidden, H], ``b1`` [hidden], ``w2`` [H, hidden], ``b2`` [H],
    ``a`` [] (plain parameters, no ``nn.Linear``: nothing that packs or wraps a model's linears touches them)."""

    DIRECTION_CACHE = 4096  # tokens whose u rescore_ keeps (SmolLM2: 576 floats each, ~9.4 MB at most)

    def __init__(self, hidden_size: int, hidden: int = 512, topk: int = 64, dropout: float = 0.1):
        super().__init__()
        if hidden_size < 1 or hidden < 1 or topk < 1:
            raise ValueError(f"SamplerHead: sizes must be >= 1, got {hidden_size}, {hidden}, {topk}")
        self.topk, self.dropout = int(topk), float(dropout)
        self.w1 = nn.Parameter(torch.empty(hidden, hidden_size))
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.zeros(hidden_size, hidden))
        self.b2 = nn.Parameter(torch.zeros(hidden_size))
        self.a = nn.Parameter(torch.ones(()))
        nn.init.kaiming_uniform_(self.w1, a=math.sqrt(5))

    @property
    def hidden(self) -> int:
        return self.w1.shape[0]

    @staticmethod
    def param_shapes(hidden_size: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """The parameters' shapes of a head of these sizes, without building one (an artifact's stored tensors are
        checked against them before anything is allocated)."""
        h, n = hidden_size, hidden
        return {"w1": (n, h), "b1": (n,), "w2": (h, n), "b2": (h,), "a": ()}

    def direction(self, emb: torch.Tensor, t0: torch.Tensor) -> torch.Tensor:
        """u [N, H] for tokens ``t0`` [N] (``emb``: the input embedding's weight)."""
        x = emb[t0].to(self.w1.dtype)
        x = F.dropout(x, self.dropout, self.training)
        return F.linear(F.silu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)

    def scores(self, emb: torch.Tensor, t0: torch.Tensor, top_l: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """The candidates' scores [N, K] (``top_l``: their log-probabilities under the drafter, ``top_i``: ids)."""
        u = self.direction(emb, t0)
        cand = emb[top_i].to(u.dtype)  # [N, K, H]
        return self.a * top_l.to(u.dtype) + torch.einsum("nkh,nh->nk", cand, u)

    @torch.no_grad()
    def rescore_(self, logits: torch.Tensor, t0: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Replace ``logits`` [N, V] in place by the head's scores given ``t0`` [N]: the top ``topk`` tokens get
        their score, every other token -inf. The mask token must already be banned (-inf)."""
        if logits.dim() != 2 or t0.shape != logits.shape[:1]:
            raise ValueError(f"rescore_: logits [N, V] and t0 [N], got {tuple(logits.shape)} / {tuple(t0.shape)}")
        if logits.shape[0] == 0:
            return logits
        k = min(self.topk, logits.shape[1])
        # the top k of log_softmax, without it over the vocabulary (one kernel call per row on the CPU)
        top_x, top_i, lse = topk_logsumexp(logits.float(), k)
        top_l, t0 = top_x - lse[:, None], t0.long()
        u = self.cached_direction(emb, t0)
        if u is None:
            s = self.scores(emb, t0, top_l, top_i)
        else:  # scores() with u from the cache, each row's dot products summed alone (the same at any N)
            cand = emb.index_select(0, top_i.reshape(-1)).view(*top_i.shape, -1)  # (emb[top_i], one op: ~2x faster)
            s = self.a * top_l.to(u.dtype) + (cand.to(u.dtype) * u.unsqueeze(1)).sum(-1)
        logits.fill_(-math.inf).scatter_(-1, top_i, s.to(logits.dtype))
        return logits

    @torch.no_grad()
    def cached_direction(self, emb: torch.Tensor, t0: torch.Tensor) -> torch.Tensor | None:
        """:meth:`direction` of ``t0`` [N] where the tokens are on the CPU and the head is in eval mode, each
        token's u computed alone once and kept (at most :attr:`DIRECTION_CACHE` tokens; dropped when the head's
        parameters or ``emb`` change: their versions and storage are the key), else None. u depends on the token
        alone, and a verify reveal asks it once per forward: the MLP's two matrix-vector products (~2.4 MB of
        SmolLM2's head) and ~10 small ops per forward become a lookup."""
        if torch.compiler.is_compiling() or self.training or t0.device.type != "cpu" or t0.dim() != 1:
            return None  # (inside a compiled graph -- the device cycle -- the MLP is part of the graph)
        params = self._parameters.values()  # (the head's own: no submodules; cheaper than self.parameters())
        key = (emb.data_ptr(), emb._version, emb.dtype, *((q.data_ptr(), q._version) for q in params))
        cache = self.__dict__.get("_directions")
        if cache is None or cache[0] != key or len(cache[1]) > self.DIRECTION_CACHE:
            cache = self.__dict__["_directions"] = (key, {})
        rows = []
        for t in t0.tolist():
            u = cache[1].get(t)
            if u is None:
                u = cache[1][t] = self.direction(emb, t0.new_tensor([t]))[0]
            rows.append(u)
        return rows[0].view(1, -1) if len(rows) == 1 else torch.stack(rows)


def rescore_reference(head: SamplerHead, logits: torch.Tensor, t0: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """:meth:`SamplerHead.rescore_` written out row by row in plain torch, for tests: a new tensor."""
    out = torch.full_like(logits, -math.inf)
    p = head.state_dict()
    for n in range(logits.shape[0]):
        logq = torch.log_softmax(logits[n].double(), -1)
        order = torch.argsort(logq, descending=True, stable=True)[: head.topk]
        x = emb[int(t0[n])].double()
        h = p["w1"].double() @ x + p["b1"].double()
        u = p["w2"].double() @ (h * torch.sigmoid(h)) + p["b2"].double()
        for c in order.tolist():
            out[n, c] = float(p["a"]) * float(logq[c]) + float(emb[c].double() @ u)
    return out


@torch.no_grad()
def collect_slot1(
    model: nn.Module,
    samples: list[dict],
    topk: int = 64,
    batch_size: int = 8,
    max_answer: int = 128,
    extra: bool = False,
    log=print,
) -> dict[str, torch.Tensor]:
    """The drafter's teacher-forced slot-1 candidates over ``samples`` (``{"prompt_ids", "answer_ids"}``, the base's
    own answers): the SBD layout of :func:`~sbd_ext.drafter.distill_loss` with every k=2 block fully masked (how
    verify drafts), at each answer position t whose block slot is 1 and whose t-1 is an answer token too.
    Returns ``top_i`` [N, topk] int32 and ``top_l`` [N, topk] fp16 (the drafter's top candidates at t and their
    log-probabilities), ``t0`` [N] (the token at t-1) and ``tgt`` [N] (the base's greedy token at t); with
    ``extra`` also ``h1`` (the block row's final hidden state), ``hc`` (the clean row that predicts t0) and ``g0``
    (the drafter's own slot-0 guess), for studies."""
    drafter = get_drafter(model)
    if drafter is None:
        raise ValueError("collect_slot1: the model has no gated drafter")
    k = 2
    mask_id = drafter.mask_token_id
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    recs: dict[str, list] = {}
    t_start = time.time()
    try:
        for lo in range(0, len(samples), batch_size):
            rows = [(list(s["prompt_ids"]), list(s["answer_ids"])[:max_answer]) for s in samples[lo : lo + batch_size]]
            rows = [(p, a) for p, a in rows if len(a) >= 2]
            if not rows:
                continue
            ids, att, lm = (t.to(device) for t in padded_batch(rows))
            B, L = ids.shape
            pos = torch.arange(L, device=device).view(1, L).expand(B, L)
            noisy = torch.where(pos < att.sum(1, keepdim=True), torch.full_like(ids, mask_id), ids)  # all masked
            clean, hid, s = clean_and_noisy_forward(model, ids, noisy, lm, k, att)
            bi, ti = (lm & (pos % k == 1) & torch.roll(lm, 1, 1)).nonzero(as_tuple=True)
            teacher = families.lm_logits(model, clean[bi, ti - 1]).float()
            teacher[:, mask_id] = -math.inf
            q1 = families.lm_logits(model, hid[bi, ti - s]).float()
            q1[:, mask_id] = -math.inf
            top_l, top_i = q1.log_softmax(-1).topk(topk, -1)
            got = {
                "top_i": top_i.int(),
                "top_l": top_l.half(),
                "t0": ids[bi, ti - 1].int(),
                "tgt": teacher.argmax(-1).int(),
            }
            if extra:
                q0 = families.lm_logits(model, hid[bi, ti - 1 - s]).float()
                q0[:, mask_id] = -math.inf
                got.update(h1=hid[bi, ti - s].half(), hc=clean[bi, ti - 2].half(), g0=q0.argmax(-1).int())
            for n, v in got.items():
                recs.setdefault(n, []).append(v.cpu())
            if log is not None:
                log(f"sampler head features: {lo + B}/{len(samples)} samples, {time.time() - t_start:.0f} s")
    finally:
        model.train(was_training)
    if not recs:
        raise ValueError("collect_slot1: no sample has an answer of 2 or more tokens")
    return {n: torch.cat(v) for n, v in recs.items()}


def accuracy(head: SamplerHead | None, emb: torch.Tensor, feats: dict[str, torch.Tensor], chunk: int = 4096) -> float:
    """Top-1 accuracy over ``feats`` (:func:`collect_slot1`): the head's pick (None: the drafter's own) == ``tgt``."""
    hits = 0
    for lo in range(0, len(feats["tgt"]), chunk):
        sl = slice(lo, lo + chunk)
        top_i = feats["top_i"][sl].long()
        if head is None:
            pick = top_i[:, 0]
        else:
            with torch.no_grad():
                sc = head.scores(emb, feats["t0"][sl].long(), feats["top_l"][sl].float(), top_i)
            pick = top_i.gather(1, sc.argmax(1, keepdim=True)).squeeze(1)
        hits += int((pick == feats["tgt"][sl].long()).sum())
    return hits / max(len(feats["tgt"]), 1)


def fit(
    head: SamplerHead,
    emb: torch.Tensor,
    feats: dict[str, torch.Tensor],
    epochs: int = 4,
    batch_size: int = 512,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    log=print,
) -> list[float]:
    """Train ``head`` on ``feats`` (:func:`collect_slot1`): cross-entropy of the base's token among the candidates
    (positions where it is not among them carry no loss). Returns the last batch's loss per epoch."""
    missing = [n for n in FEATURES if n not in feats]
    if missing:
        raise ValueError(f"fit: features {missing} missing")
    emb = emb.detach().float()
    lab_hit = feats["top_i"].long() == feats["tgt"].long()[:, None]
    has, lab = lab_hit.any(1), lab_hit.long().argmax(1)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    head.train()
    try:
        for ep in range(epochs):
            perm = torch.randperm(len(lab), generator=g)
            perm = perm[has[perm]]
            for lo in range(0, len(perm), batch_size):
                idx = perm[lo : lo + batch_size]
                sc = head.scores(emb, feats["t0"][idx].long(), feats["top_l"][idx].float(), feats["top_i"][idx].long())
                loss = F.cross_entropy(sc, lab[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
            if log is not None:
                log(f"sampler head: epoch {ep + 1}/{epochs}, loss {losses[-1]:.3f}")
    finally:
        head.eval()
    return losses
