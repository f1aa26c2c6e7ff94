"""Tokenizers: train a small byte-level BPE, or load any Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# Tried in order when the tokenizer has no EOS_TOKEN: the end-of-document markers
# used by common model families (T5/Llama-2, Llama-3, Gemma).
EOS_ALTERNATIVES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")

# 256 byte symbols + the EOS special token: the smallest vocabulary that can encode anything.
MIN_BPE_VOCAB = 257


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) with ``EOS_TOKEN`` as its only special token.

    Every byte is in the initial alphabet, so any text round-trips exactly through
    encode/decode. Training is deterministic for the same texts and vocab_size. The
    result may have fewer than ``vocab_size`` entries if the texts run out of merges.
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_BPE_VOCAB} (256 bytes + EOS), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json`` (a file, or a folder containing one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer file {p} not found; pass the path of a Hugging Face tokenizer.json "
            f"(or a folder holding one), or omit the tokenizer to train a BPE on the data"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # the Rust side raises a bare Exception on parse errors
        raise ValueError(
            f"could not parse tokenizer file {p}: {exc}; it must be a Hugging Face tokenizers "
            f"JSON file (tokenizer.json), not a sentencepiece .model or vocab file"
        ) from exc


def eos_id(tok: Tokenizer) -> int:
    """Id of the end-of-document token: ``EOS_TOKEN`` if present, else a common alternative."""
    for token in EOS_ALTERNATIVES:
        idx = tok.token_to_id(token)
        if idx is not None:
            return idx
    raise ValueError(
        f"tokenizer has none of the end-of-document tokens {list(EOS_ALTERNATIVES)}; "
        f"add {EOS_TOKEN!r} as a special token to the tokenizer.json, or omit the tokenizer "
        f"to train a byte-level BPE that has one"
    )


def vocab_size_of(tok: Tokenizer) -> int:
    """Embedding rows a model needs: one past the largest id (added tokens included)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
