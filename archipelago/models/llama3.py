"""Llama-3 / Llama-3.1 flavors."""

from __future__ import annotations

from .args import ModelArgs, RopeScaling
from .registry import register_family

# Llama-3.1's published long-context RoPE scaling (8K -> 128K).
LLAMA31_ROPE_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192
)

# Llama-3.2's (1B, 3B): the same scheme with factor 32.
LLAMA32_ROPE_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192
)

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # 873,312 params with vocab 2048: sized for compute-optimal runs on a 2-core CPU (20 tokens
    # per parameter, 17.6M tokens, in about 20 minutes; configs/llama3/compute-optimal.toml).
    "tiny": ModelArgs(
        dim=96, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=288, vocab_size=None,
        rope_theta=500000.0, norm_eps=1e-5, max_seq_len=2048,
    ),
    # 6,163,712 params with vocab 2048.
    "debug": ModelArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768, vocab_size=None,
        rope_theta=500000.0, norm_eps=1e-5, max_seq_len=2048,
    ),
    # 124,275,456 params with vocab 4096 (GPT-2-small sized).
    "small": ModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3584, vocab_size=None,
        rope_theta=500000.0, norm_eps=1e-5, max_seq_len=2048,
    ),
    # Llama-3.2-1B: 1,235,814,400 params (embedding and output tied): the 1B class, for
    # model FLOPs utilisation on one GPU (bench/throughput.py --flavor 1B).
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        rope_theta=500000.0, rope_scaling=LLAMA32_ROPE_SCALING, norm_eps=1e-5,
        max_seq_len=131072, tie_embeddings=True,
    ),
    # Llama-3.1-8B: 8,030,261,248 params.
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, norm_eps=1e-5,
        max_seq_len=131072,
    ),
    # Llama-3.1-70B: 70,553,706,496 params.
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE_SCALING, norm_eps=1e-5,
        max_seq_len=131072,
    ),
}

register_family("llama3", LLAMA3_FLAVORS)
