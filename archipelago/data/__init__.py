"""Data: raw corpora -> tokenizer -> cached token files -> deterministic batches; and images."""

from .corpus import (
    SHAKESPEARE_SPEC,
    CorpusUnavailable,
    Document,
    fetch_shakespeare,
    read_shakespeare,
    read_text_folder,
    split_documents,
)
from .images import ImageBatchLoader, ImagesUnavailable, validation_image_batches
from .loader import TokenRangeError, TokenSequenceLoader, validation_batches
from .prepare import (
    PreparedDataset,
    default_cache_dir,
    prepare_dataset,
    prepare_from_config,
    prepare_images_from_config,
    token_dtype,
)
from .tokenizer import EOS_TOKEN, eos_id, load_tokenizer, train_bpe_tokenizer, vocab_size_of

__all__ = [
    "SHAKESPEARE_SPEC",
    "CorpusUnavailable",
    "TokenRangeError",
    "Document",
    "fetch_shakespeare",
    "read_shakespeare",
    "read_text_folder",
    "split_documents",
    "EOS_TOKEN",
    "train_bpe_tokenizer",
    "load_tokenizer",
    "eos_id",
    "vocab_size_of",
    "PreparedDataset",
    "prepare_dataset",
    "prepare_from_config",
    "default_cache_dir",
    "token_dtype",
    "TokenSequenceLoader",
    "validation_batches",
    "ImageBatchLoader",
    "ImagesUnavailable",
    "prepare_images_from_config",
    "validation_image_batches",
]
