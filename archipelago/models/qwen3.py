"""Qwen3 (dense) flavors: per-head QK RMSNorm, rope_theta 1e6, norm_eps 1e-6."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs
from .registry import register_family

_QWEN3: dict[str, Any] = dict(qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6)

QWEN3_FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=16, ffn_dim=768,
        vocab_size=None, tie_embeddings=True, max_seq_len=2048, **_QWEN3,
    ),
    # Same trunk as llama3 "small" but Qwen3-style (2:1 GQA, QK norm, tied):
    # 123,490,560 params with vocab 4096.
    "small": ModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=6, head_dim=64, ffn_dim=3584,
        vocab_size=None, tie_embeddings=True, max_seq_len=2048, **_QWEN3,
    ),
    # Qwen3-0.6B: 596,049,920 unique params (tied).
    "0.6B": ModelArgs(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
        vocab_size=151936, tie_embeddings=True, max_seq_len=40960, **_QWEN3,
    ),
    # Qwen3-1.7B: 1,720,574,976 unique params (tied). The often-quoted
    # 2,031,739,904 counts lm_head separately, as the safetensors file stores it.
    "1.7B": ModelArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144,
        vocab_size=151936, tie_embeddings=True, max_seq_len=40960, **_QWEN3,
    ),
    # Qwen3-8B: 8,190,735,360 params (untied).
    "8B": ModelArgs(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288,
        vocab_size=151936, tie_embeddings=False, max_seq_len=40960, **_QWEN3,
    ),
}

register_family("qwen3", QWEN3_FLAVORS)
