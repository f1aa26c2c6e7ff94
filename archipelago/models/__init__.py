"""Model families (Llama-3, Qwen3, Qwen3-MoE, GPT-OSS; ResNet) and the flavor registry."""

from .args import ModelArgs, RopeScaling
from .registry import (
    DEFAULT_VOCAB_SIZE,
    FAMILIES,
    IMAGE_FAMILIES,
    build_model,
    family_kind,
    get_image_model_args,
    get_model_args,
    list_flavors,
    register_family,
    register_image_family,
)
from .transformer import Transformer

# Importing the family modules registers their flavors.
from . import gpt_oss, hf_auto, llama3, qwen3, qwen3_moe, resnet  # noqa: E402,F401  isort:skip

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "FAMILIES",
    "IMAGE_FAMILIES",
    "ModelArgs",
    "RopeScaling",
    "Transformer",
    "build_model",
    "family_kind",
    "get_image_model_args",
    "get_model_args",
    "list_flavors",
    "register_family",
    "register_image_family",
]
