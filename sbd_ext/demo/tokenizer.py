"""Tokenizers for the embedded demo models, as HuggingFace ``PreTrainedTokenizerFast`` objects.

Both share the special tokens ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<|mask|>`` (3), ``<unk>`` (4) and an
alphabet of newline plus the 95 printable ASCII characters, so any ASCII text can be encoded; ``<bos>`` is
prepended when ``add_special_tokens`` is true, and decoding concatenates the token strings back (no spaces are
inserted). Built with the ``tokenizers`` library and saved as ``tokenizer.json``, so
``AutoTokenizer.from_pretrained(folder)`` loads them offline with nothing but ``tokenizers`` installed.

Text is text: both are built with ``split_special_tokens=True`` (kept in ``tokenizer_config.json``), so ``<eos>`` or
``<|mask|>`` inside a string encodes as its characters; the special tokens enter a sequence only by id (the
``<bos>`` the post-processor adds, the ``<eos>`` training appends, the mask id decoding writes). A character outside
the alphabet (``é``, a tab) becomes ``<unk>``: :func:`unknown_characters` finds them, and the CLI names them.

* :func:`build_bpe_tokenizer` (the demo models' tokenizer): a small BPE trained by the project on generated
  problems of :mod:`sbd_ext.demo.tasks`. Pre-tokenization keeps a word with its leading space, every digit apart (one
  token per digit, so numbers keep a fixed number of tokens), and runs of punctuation; the merges then make each
  template word one token (" bought", " apples", "\\n####"). ~240 tokens; a problem is ~70 tokens instead of ~180
  characters, which halves the training cost and gives an SBD block fixed token positions to fill in.
* :func:`build_char_tokenizer`: one token per character (no training), the simplest alternative.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from . import tasks

__all__ = ["CHARS", "SPECIAL_TOKENS", "build_bpe_tokenizer", "build_char_tokenizer", "unknown_characters"]

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "mask_token": "<|mask|>"}
UNK = "<unk>"
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
_SPECIALS = [SPECIAL_TOKENS[k] for k in ("pad_token", "bos_token", "eos_token", "mask_token")] + [UNK]
# A word with its leading whitespace | one digit (with its leading whitespace) | a run of punctuation | whitespace.
PRETOKENIZE = r"\s?[A-Za-z]+|\s?\d|\s?[^\sA-Za-z\d]+|\s+"


def _wrap(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    bos = SPECIAL_TOKENS["bos_token"]
    bos_id = tok.token_to_id(bos)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        split_special_tokens=True,  # a prompt that says "<eos>" must not end itself (see the module docstring)
        **SPECIAL_TOKENS,
    )


def unknown_characters(tok, text: str) -> list[str]:
    """The characters of ``text`` that ``tok`` encodes as its unknown token, each once, in order of appearance.

    Works for any fast tokenizer with an unknown token (byte-level BPEs have none and return []); special-token
    text is encoded as characters, as the embedded tokenizers do.
    """
    if tok.unk_token_id is None or not text:
        return []
    enc = tok(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    found: dict[str, None] = {}
    for tid, (start, end) in zip(enc.input_ids, enc.offset_mapping, strict=True):
        if tid == tok.unk_token_id:
            found.update(dict.fromkeys(text[start:end]))
    return list(found)


def build_char_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """One token per character: the specials (ids 0-4), then newline and printable ASCII (ids 5-100)."""
    vocab = {t: i for i, t in enumerate(_SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return _wrap(tok, model_max_length)


def build_bpe_tokenizer(
    n_problems: int = 3000, vocab_size: int = 400, seed: int = 12345, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """A BPE trained on the prompts and completions of ``n_problems`` training problems of seed ``seed``.

    Deterministic (same corpus, same merges). Merges stop at ``vocab_size`` or when no pair occurs twice; the
    alphabet is always complete, so unseen words fall back to characters.
    """

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=list(CHARS),
        min_frequency=2,
        show_progress=False,
    )
    corpus = []
    for p in tasks.problems("train", n_problems, seed=seed):
        corpus += [p.prompt, p.completion]
    tok.train_from_iterator(corpus, trainer)
    return _wrap(tok, model_max_length)
