"""The character tokenizer built in code: printable ASCII after four special tokens, with a
plain ``role: content`` chat template. The tiny models read it as is; the presets
(:mod:`geartrain.presets`) read it padded with filler tokens to their vocabulary size."""

from __future__ import annotations

import string

from transformers import PreTrainedTokenizerFast

__all__ = ["BOS", "CHARACTERS", "CHAT_TEMPLATE", "EOS", "PAD", "UNK", "char_tokenizer"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
#: Printable ASCII after the four special tokens; ids are stable across versions.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """``<pad>`` (0), ``<s>`` (1), ``</s>`` (2), ``<unk>`` (3), then one token per printable
    ASCII character; with ``vocab_size``, filler tokens ``<|gtN|>`` (N = their id) up to that
    size, so that every id of a model with that vocabulary decodes. Text never encodes to a
    filler token (no merges: text splits into characters).

    The tokens are named as byte-level BPE names bytes (GPT-2's table: a space is ``Ġ``, a
    newline ``Ċ``, the other printable characters themselves) and text goes through the
    byte-level pre-tokenizer and decoder, so the saved tokenizer reads the same through
    ``AutoTokenizer``: for a ``qwen2`` config transformers builds a ``Qwen2Tokenizer`` from
    the file whatever its ``tokenizer_class`` says, a byte-level tokenizer that dropped the
    spaces and newlines of a plain character vocabulary. A character outside printable ASCII
    is one ``<unk>`` per byte of its UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    names = _byte_names()
    tokens = [PAD, BOS, EOS, UNK, *(names[ord(c)] for c in CHARACTERS)]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(tokens)} characters and specials")
        tokens += [f"<|gt{i}|>" for i in range(len(tokens), vocab_size)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _byte_names() -> dict[int, str]:
    """GPT-2's byte -> character table of byte-level BPE (printable ASCII maps to itself)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    names, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in names:
            names[b] = chr(256 + extra)
            extra += 1
    return names
