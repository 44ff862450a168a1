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
teacher costs nothing extra), KL(p_base || q_drafter) over the vocabulary without the mask token. Trained on the
base's own answers (self-distillation, :mod:`sbd_ext.recipes.smollm2.drafter`) the drafter learns what *this* model
says, on whatever it is asked.

Artifact (:func:`save_drafter` / :func:`load_drafter`), a folder in peft's layout:

* ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight``
  [out, r] (peft's names and shapes), plus ``sbd_mask_row`` [H] (fp32);
* ``adapter_config.json``: peft's LoRA fields (``r``, ``lora_alpha``, ``target_modules``, ``task_type``,
  ``base_model_name_or_path``) with ``peft_type = "SBD_GATED_LORA"`` and an ``sbd`` object: ``gated``,
  ``mask_token_id``, ``sbd_block_size_range``, ``base_loader``, the recommended decoding settings (``generation``)
  and provenance.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import LORA_TARGETS, MaskRow
from .metadata import set_sbd_metadata

__all__ = [
    "RowGate",
    "GatedLoRALinear",
    "attach",
    "get_drafter",
    "gate_rows",
    "distill_loss",
    "save_drafter",
    "load_drafter",
    "is_drafter",
    "unwrapped",
    "attach_from_checkpoint",
    "CHECKPOINT_SUBFOLDER",
    "read_drafter_config",
    "PEFT_TYPE",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
]

PEFT_TYPE = "SBD_GATED_LORA"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHECKPOINT_SUBFOLDER = "sbd_drafter"  # where an exported checkpoint keeps its drafter (sbd-ext export)
_MASK_ROW_KEY = "sbd_mask_row"
_PREFIX = "base_model.model."


class RowGate:
    """The per-row gate shared by every adapter of one model: ``None`` (adapter off) or a [B, T, 1] tensor."""

    def __init__(self):
        self.gate: torch.Tensor | None = None


class GatedLoRALinear(nn.Module):
    """``base(x) + gate · scale · (x A^T) B^T`` over a frozen linear layer; with no gate set, exactly ``base(x)``."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, holder: RowGate):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank, self.scale = int(rank), float(alpha) / int(rank)
        self.holder = holder
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:  # code that inspects a projection's weight (families, RoPE checks) sees the base
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        gate = self.holder.gate
        if gate is None:
            return y
        delta = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale
        return y + delta * gate.to(y.dtype)


class GatedMaskRow(MaskRow):
    """The mask token's trained row, used only while a gate is set (a forward with no gate sees the base's row)."""

    def __init__(self, model: nn.Module, mask_token_id: int, holder: RowGate):
        super().__init__(model, mask_token_id)
        self.holder = holder

    def _embed_hook(self, module, args, out):
        return None if self.holder.gate is None else super()._embed_hook(module, args, out)

    def _head_hook(self, module, args, out):
        return None if self.holder.gate is None else super()._head_hook(module, args, out)


class Drafter(nn.Module):
    """What :func:`attach` adds to a model (``model.sbd_drafter``): the gate holder, the mask row, the hook."""

    def __init__(self, model: nn.Module, mask_token_id: int, rank: int, alpha: float, targets: tuple[str, ...]):
        super().__init__()
        self.holder = RowGate()
        self.rank, self.alpha, self.targets = int(rank), float(alpha), tuple(sorted(targets))
        self.mask_token_id = int(mask_token_id)
        self._hook = model.get_decoder().register_forward_pre_hook(self._gate_from_plan, with_kwargs=True)
        self._post = model.get_decoder().register_forward_hook(self._clear_plan_gate, with_kwargs=True)

    def _gate_from_plan(self, module, args, kwargs):
        plan = kwargs.get("sbd_plan")
        if plan is None:
            return None  # a forward without a plan keeps whatever gate the caller set (None: the base)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        self.holder.gate = gate_rows(plan.n_commit, plan.n_valid, ids.shape[1], ids.device)
        return None

    def _clear_plan_gate(self, module, args, kwargs, output):
        if kwargs.get("sbd_plan") is not None:
            self.holder.gate = None
        return None

    def lora_modules(self, model: nn.Module) -> list[tuple[str, GatedLoRALinear]]:
        return [(n, m) for n, m in model.named_modules() if isinstance(m, GatedLoRALinear)]


def gate_rows(n_commit: torch.Tensor, n_valid: torch.Tensor, rows: int, device) -> torch.Tensor:
    """The block-row gate [B, rows, 1] (float 0/1): row r of sequence b is a set-block row iff
    ``n_commit[b] <= r < n_valid[b]``."""
    r = torch.arange(rows, device=device).view(1, rows)
    lo = n_commit.to(device=device, dtype=torch.long).view(-1, 1)
    hi = n_valid.to(device=device, dtype=torch.long).view(-1, 1)
    return ((r >= lo) & (r < hi)).to(torch.float32).unsqueeze(-1)


def get_drafter(model: nn.Module) -> Drafter | None:
    """The gated drafter attached to ``model`` (or None)."""
    d = getattr(model, "sbd_drafter", None)
    return d if isinstance(d, Drafter) else None


def attach(
    model: nn.Module,
    mask_token_id: int,
    rank: int = 16,
    alpha: float | None = None,
    targets: Iterable[str] = LORA_TARGETS,
) -> list[nn.Parameter]:
    """Freeze ``model`` and attach a gated drafter (LoRA of ``rank`` on ``targets`` + the mask row); returns the
    trainable parameters. The model's vocabulary must already hold ``mask_token_id``."""
    if get_drafter(model) is not None:
        raise ValueError("the model already has a gated drafter attached")
    emb = model.get_input_embeddings()
    if not 0 <= int(mask_token_id) < emb.num_embeddings:
        raise ValueError(f"mask_token_id {mask_token_id} is not a row of the embedding ({emb.num_embeddings} rows)")
    alpha = 2.0 * rank if alpha is None else float(alpha)
    for p in model.parameters():
        p.requires_grad_(False)
    targets = tuple(targets)
    drafter = Drafter(model, mask_token_id, rank, alpha, targets)
    wrapped = 0
    for module in list(model.get_decoder().modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, GatedLoRALinear(child, rank, alpha, drafter.holder))
                wrapped += 1
    if not wrapped:
        drafter._hook.remove()
        drafter._post.remove()
        raise ValueError(f"no nn.Linear named one of {targets} in the model: nothing to adapt")
    drafter.mask_row = GatedMaskRow(model, mask_token_id, drafter.holder)
    model.sbd_drafter = drafter
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------
def distill_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    block_size: int,
    *,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    eta: torch.Tensor | None = None,
    return_parts: bool = False,
):
    """The drafter's loss on x [B, L]: the SBD layout of Alg. 1 with the clean half run by the frozen base.

    1. clean half, no autograd, gate off: a causal forward of x, its K/V kept (the noisy half attends to them) and
       the base's next-token logits at the rows the loss needs (the teacher);
    2. noisy half, gate on: x with each token replaced by the mask token with probability eta ~ U(0, 1) per
       sequence, position ids 0..L-1, attending to its own block bidirectionally and to strictly earlier clean
       blocks (the SBD mask's noisy rows);
    3. loss: mean over masked positions t with ``loss_mask[b, t]`` (and t >= 1) of KL(p_base(. | x_<t) ||
       q_drafter), the mask token excluded from both.
    ``attention_mask`` [B, L]: right padding (1 = token). Returns the loss, or ``(loss, parts)`` with
    ``mask_accuracy`` (drafter argmax == base argmax) and ``num_masked``.
    """
    from transformers import DynamicCache

    from . import families
    from .training.mask import sbd_attention_mask

    drafter = get_drafter(model)
    if drafter is None:
        raise ValueError("distill_loss: the model has no gated drafter (sbd_ext.drafter.attach)")
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"distill_loss: input_ids [B, L] and loss_mask of the same shape, got "
            f"{tuple(input_ids.shape)} / {tuple(loss_mask.shape)}"
        )
    B, L = input_ids.shape
    device = input_ids.device
    k = int(block_size)
    mask_id = drafter.mask_token_id
    lengths = (
        attention_mask.long().sum(1)
        if attention_mask is not None
        else torch.full((B,), L, dtype=torch.long, device=device)
    )
    pos = torch.arange(L, device=device).view(1, L).expand(B, L)
    decoder = model.get_decoder()
    holder = drafter.holder

    # 1. the base on the clean half
    holder.gate = None
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        clean_hidden = decoder(
            input_ids=input_ids, position_ids=pos, past_key_values=cache, use_cache=True, attention_mask=attention_mask
        ).last_hidden_state

    # 2. the noisy half with the adapter
    if eta is None:
        eta = torch.rand(B, 1, generator=generator, device="cpu").to(device)
    noise = torch.rand(B, L, generator=generator, device="cpu").to(device)
    valid = pos < lengths.view(B, 1)
    masked = (noise < eta.view(B, 1)) & valid
    noisy = torch.where(masked, torch.full_like(input_ids, mask_id), input_ids)
    # Noisy blocks that end before the first position with loss (the prompts) feed no loss and no later block (a
    # noisy block sees its own block only): they are left out. s: the first block holding a loss position.
    sel = masked & loss_mask.bool() & (pos >= 1)
    first = int(loss_mask.bool().any(0).nonzero()[0]) if loss_mask.any() else 0
    s = (first // k) * k
    full = sbd_attention_mask(L, k, lengths, mask_format="bool", device=device)  # [B, 1, 2L, 2L]
    keys = torch.cat([torch.arange(L, device=device), torch.arange(L + s, 2 * L, device=device)])
    mask = full[:, :, L + s :, :][..., keys].contiguous()  # the kept noisy rows over [clean keys, kept noisy keys]
    holder.gate = torch.ones(B, L - s, 1, device=device)
    try:
        hidden = decoder(
            input_ids=noisy[:, s:], position_ids=pos[:, s:], past_key_values=cache, use_cache=True, attention_mask=mask
        ).last_hidden_state
    finally:
        holder.gate = None

    # 3. distillation on the masked positions that carry loss
    bi, ti = sel.nonzero(as_tuple=True)
    n = bi.numel()
    if n == 0:
        zero = hidden.sum() * 0.0
        parts = dict(mask_loss=zero.detach(), mask_accuracy=torch.zeros(()), num_masked=torch.tensor(0))
        return (zero, parts) if return_parts else zero
    with torch.no_grad():
        teacher = families.lm_logits(model, clean_hidden[bi, ti - 1]).float()
        teacher[:, mask_id] = -math.inf
        logp = F.log_softmax(teacher, dim=-1)
        p = logp.exp()
    student = families.lm_logits(model, hidden[bi, ti - s]).float()
    student = student.masked_fill(torch.arange(student.shape[-1], device=device) == mask_id, -math.inf)
    logq = F.log_softmax(student, dim=-1)
    kl = (p * (logp - logq)).nan_to_num(0.0).sum(-1)  # 0 * -inf at the mask column -> 0
    loss = kl.mean()
    if not return_parts:
        return loss
    with torch.no_grad():
        acc = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return loss, dict(mask_loss=loss.detach(), mask_accuracy=acc, num_masked=torch.tensor(n), block_size=k)


# --------------------------------------------------------------------------------------------------------
# artifact
# --------------------------------------------------------------------------------------------------------
def save_drafter(
    model: nn.Module,
    folder: str | Path,
    sbd: dict,
    base_model_name_or_path: str = "",
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Write the drafter of ``model`` into ``folder`` (see module doc); ``sbd``: the SBD fields (``base_loader``,
    ``sbd_block_size_range``, ``generation``, provenance). The LoRA factors are stored in ``dtype`` (bf16: half the
    size; the drafter only drafts, so its rounding never changes verified output), the mask row in fp32. Returns
    the folder's size in bytes."""
    from safetensors.torch import save_file

    drafter = get_drafter(model)
    if drafter is None:
        raise ValueError("save_drafter: the model has no gated drafter")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, m in drafter.lora_modules(model):
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().to(dtype).cpu().contiguous()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().to(dtype).cpu().contiguous()
    tensors[_MASK_ROW_KEY] = drafter.mask_row.row.detach().float().cpu().contiguous()
    save_file(tensors, folder / WEIGHTS_FILE)
    config = {
        "peft_type": PEFT_TYPE,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": drafter.rank,
        "lora_alpha": drafter.alpha,
        "target_modules": list(drafter.targets),
        "sbd": {"gated": True, "mask_token_id": drafter.mask_token_id, **sbd},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def is_drafter(folder: str | Path) -> bool:
    """Whether ``folder`` holds a gated drafter artifact."""
    f = Path(folder) / CONFIG_FILE
    if not f.is_file() or not (Path(folder) / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads(f.read_text()).get("peft_type") == PEFT_TYPE
    except (ValueError, AttributeError):
        return False


def read_drafter_config(folder: str | Path) -> dict:
    """The drafter's ``adapter_config.json``, checked field by field (errors name the file and the field)."""
    path = Path(folder) / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder} is not a drafter folder: {CONFIG_FILE} is missing") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != PEFT_TYPE:
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, not {PEFT_TYPE!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{path}: field 'r' must be an int >= 1, got {r!r}")
    a = cfg.get("lora_alpha")
    if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a):
        raise ValueError(f"{path}: field 'lora_alpha' must be a finite number, got {a!r}")
    t = cfg.get("target_modules")
    if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
        raise ValueError(f"{path}: field 'target_modules' must be a non-empty list of names, got {t!r}")
    sbd = cfg.get("sbd")
    if not isinstance(sbd, dict) or sbd.get("gated") is not True:
        raise ValueError(f"{path}: field 'sbd' must be an object with \"gated\": true")
    m = sbd.get("mask_token_id")
    if not isinstance(m, int) or isinstance(m, bool) or m < 0:
        raise ValueError(f"{path}: field 'sbd.mask_token_id' must be an int >= 0, got {m!r}")
    rng = sbd.get("sbd_block_size_range")
    if (
        not isinstance(rng, list)
        or len(rng) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng)
        or not 1 <= rng[0] <= rng[1]
    ):
        raise ValueError(f"{path}: field 'sbd.sbd_block_size_range' must be [lo, hi] with 1 <= lo <= hi, got {rng!r}")
    return cfg


@torch.no_grad()
def load_weights(model: nn.Module, folder: str | Path, cfg: dict | None = None) -> dict:
    """Attach a drafter to ``model`` (the base, mask token in its vocabulary) from ``folder``; returns the config."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_drafter_config(folder) if cfg is None else cfg
    path = folder / WEIGHTS_FILE
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: cannot read the drafter's weights ({e})") from None
    sbd = cfg["sbd"]
    attach(model, sbd["mask_token_id"], rank=cfg["r"], alpha=cfg["lora_alpha"], targets=cfg["target_modules"])
    drafter = get_drafter(model)
    mods = dict(drafter.lora_modules(model))
    names = {k[len(_PREFIX) :].rsplit(".", 2)[0] for k in tensors if k.startswith(_PREFIX)}
    if names != set(mods):
        raise ValueError(
            f"{path}: adapts {len(names)} layers, the model has {len(mods)} for targets "
            f"{cfg['target_modules']} (missing: {sorted(set(mods) - names)[:3]}, "
            f"unknown: {sorted(names - set(mods))[:3]})"
        )
    for name, m in mods.items():
        for part in ("lora_A", "lora_B"):
            key = f"{_PREFIX}{name}.{part}.weight"
            src, dst = tensors.get(key), getattr(m, part)
            if src is None:
                raise ValueError(f"{path}: tensor {key} is missing")
            if src.shape != dst.shape:
                raise ValueError(
                    f"{path}: {key} is {tuple(src.shape)}, the model needs {tuple(dst.shape)} "
                    f"(rank 'r' = {cfg['r']} in {CONFIG_FILE})"
                )
            if not torch.isfinite(src).all():
                raise ValueError(f"{path}: {key} holds NaN or inf")
            dst.copy_(src.to(dst.dtype))
    row = tensors.get(_MASK_ROW_KEY)
    if row is None or row.shape != drafter.mask_row.row.shape:
        raise ValueError(
            f"{path}: {_MASK_ROW_KEY} must be a [{drafter.mask_row.row.shape[0]}] tensor, got "
            f"{None if row is None else tuple(row.shape)}"
        )
    if not torch.isfinite(row).all():
        raise ValueError(f"{path}: {_MASK_ROW_KEY} holds NaN or inf")
    drafter.mask_row.row.copy_(row.to(drafter.mask_row.row.dtype))
    for p in model.parameters():
        p.requires_grad_(False)
    return cfg


def load_drafter(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sbd",
    device: str | torch.device | None = None,
    trust_base_loader: bool = False,
):
    """``(model, tokenizer)``: the base model the drafter names (its ``base_loader``, imported only if it is a known
    loader or ``trust_base_loader``: see :func:`sbd_ext.adapters.resolve_base_loader`) with the drafter attached
    (gated, not merged), the SBD metadata set, its recommended decoding settings on ``model.generation_config``."""
    from .adapters import resolve_base_loader

    folder = Path(folder)
    cfg = read_drafter_config(folder)
    sbd = cfg["sbd"]
    loader = resolve_base_loader(sbd.get("base_loader", ""), folder / CONFIG_FILE, trust=trust_base_loader)
    model, tok = loader(attn_implementation=attn_implementation)
    load_weights(model, folder, cfg)
    set_sbd_metadata(model, int(sbd["mask_token_id"]), tuple(sbd["sbd_block_size_range"]))
    for key, value in sbd.get("generation", {}).items():
        setattr(model.generation_config, key, value)
    model.to(dtype)
    if device is not None:
        model.to(device)
    return model.eval(), tok


@contextlib.contextmanager
def unwrapped(model: nn.Module):
    """Inside the block ``model`` is its plain base (the wrapped layers put back, the hooks removed, no
    ``sbd_drafter``): e.g. to ``save_pretrained`` the base weights under their own names. The drafter is restored
    after the block (the same parameters)."""
    drafter = get_drafter(model)
    if drafter is None:
        yield model
        return
    wrapped = []
    for name, m in drafter.lora_modules(model):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, m.base)
        wrapped.append((owner, child, m))
    row = drafter.mask_row.row.detach().clone()
    drafter.mask_row.remove()
    drafter._hook.remove()
    drafter._post.remove()
    del model.sbd_drafter
    try:
        yield model
    finally:
        for owner, child, m in wrapped:
            setattr(owner, child, m)
        decoder = model.get_decoder()
        drafter._hook = decoder.register_forward_pre_hook(drafter._gate_from_plan, with_kwargs=True)
        drafter._post = decoder.register_forward_hook(drafter._clear_plan_gate, with_kwargs=True)
        drafter.mask_row = GatedMaskRow(model, drafter.mask_token_id, drafter.holder)
        with torch.no_grad():
            drafter.mask_row.row.copy_(row)
        drafter.mask_row.row.requires_grad_(row.requires_grad)
        model.sbd_drafter = drafter


_ATTACH_LOCK = threading.Lock()


def attach_from_checkpoint(model: nn.Module) -> bool:
    """Attach the drafter an exported checkpoint carries (``<checkpoint>/sbd_drafter/``, written by ``sbd-ext
    export``) to ``model`` loaded from that checkpoint, once; returns whether the model has a drafter afterwards.
    Called by ``model.generate``'s SBD path (``custom_generate``), so a checkpoint loaded with
    ``from_pretrained(dir, trust_remote_code=True)`` decodes with its drafter without any other step."""
    if get_drafter(model) is not None:
        return True
    folder = Path(str(getattr(model, "name_or_path", "") or "")) / CHECKPOINT_SUBFOLDER
    if not is_drafter(folder):
        return False
    with _ATTACH_LOCK:
        if get_drafter(model) is None:
            load_weights(model, folder)
            model.eval()
    return True
