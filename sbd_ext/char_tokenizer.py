"""A character-level tokenizer for the embedded demo model, as a HuggingFace ``PreTrainedTokenizerFast``.

Vocabulary: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<|mask|>`` (3), ``<unk>`` (4), then newline and the 95
printable ASCII characters (ids 5..100). Every character is one token; ``<bos>`` is prepended when
``add_special_tokens`` is true; decoding concatenates the characters back (no spaces inserted). Built with the
``tokenizers`` library (WordLevel model over single characters), saved as ``tokenizer.json``, so
``AutoTokenizer.from_pretrained(folder)`` loads it offline with nothing but ``tokenizers`` installed.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["SPECIAL_TOKENS", "build_char_tokenizer", "CHARS"]

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "mask_token": "<|mask|>"}
UNK = "<unk>"
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


def build_char_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """The character-level tokenizer (see the module docstring)."""
    specials = [SPECIAL_TOKENS[k] for k in ("pad_token", "bos_token", "eos_token", "mask_token")] + [UNK]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character, newline included, is its own pre-token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        **SPECIAL_TOKENS,
    )
