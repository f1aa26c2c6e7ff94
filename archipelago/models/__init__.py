"""Model families (Llama-3, Qwen3) and the flavor registry."""

from .args import ModelArgs, RopeScaling
from .registry import (
    DEFAULT_VOCAB_SIZE,
    FAMILIES,
    build_model,
    get_model_args,
    list_flavors,
    register_family,
)
from .transformer import Transformer

# Importing the family modules registers their flavors.
from . import llama3, qwen3  # noqa: E402,F401  isort:skip

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "FAMILIES",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "build_model",
    "get_model_args",
    "list_flavors",
    "register_family",
]
