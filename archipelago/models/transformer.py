"""Decoder-only transformer shared by the Llama-3 and Qwen3 families."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from .args import ModelArgs
from .layers import KVCache, RMSNorm, TransformerBlock, precompute_rope

INIT_STD = 0.02


class Transformer(nn.Module):
    """Token embeddings -> pre-norm blocks -> final norm -> output projection.

    Single-device code: parallelism wraps ``model.layers[i]`` from outside.
    Intended lifecycle: build on meta, ``to_empty(device=...)``, ``init_weights()``.
    """

    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.vocab_size is None:
            raise ValueError(
                "ModelArgs.vocab_size is None; use get_model_args(..., vocab_size=...) "
                "with the tokenizer's vocab size before building the model"
            )
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        # Non-persistent: derived from args, so they stay out of checkpoints and
        # are recomputed by init_weights() after meta-device construction.
        cos, sin = self._rope_tables(self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        assert a.head_dim is not None
        return precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)

    def _tie_weights(self) -> None:
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, recurse: bool = True) -> Transformer:
        # nn.Module._apply (to_empty, .to across device types) converts the
        # shared Parameter once per owning module, silently untying it; re-tie.
        module = super()._apply(fn, recurse)
        self._tie_weights()
        return module

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab] in the parameter dtype.

        With `caches` (one KVCache per layer, from `new_caches`; generation) the tokens
        continue the cached positions, and their keys and values are added to the caches."""
        start = caches[0].length if caches else 0
        end = start + tokens.shape[1]
        if end > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {end} exceeds max_seq_len {self.args.max_seq_len}; "
                "raise ModelArgs.max_seq_len or shorten the batch"
            )
        cos = self.rope_cos[start:end]
        sin = self.rope_sin[start:end]
        h = self.tok_embeddings(tokens)
        for k, layer in enumerate(self.layers):
            h = layer(h, cos, sin, caches[k]) if caches else layer(h, cos, sin)
        return self.output(self.norm(h))

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """Empty KV caches, one per layer, for up to `max_len` positions."""
        a = self.args
        assert a.head_dim is not None and a.n_kv_heads is not None
        weight = self.tok_embeddings.weight
        return [KVCache(batch, a.n_kv_heads, min(max_len, a.max_seq_len), a.head_dim, weight.device, weight.dtype)
                for _ in range(a.n_layers)]

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Recompute RoPE tables and initialise every parameter in place."""
        self._tie_weights()
        device = self.rope_cos.device
        self.rope_cos, self.rope_sin = self._rope_tables(device)
        devices = [device.index or 0] if device.type == "cuda" else []
        # fork_rng keeps a seeded init from disturbing the caller's RNG stream.
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self._init_params()

    def _init_params(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=INIT_STD)
        # Residual-branch outputs (wo, w2) are scaled down so the residual
        # stream's variance does not grow with depth (GPT-2 style).
        out_std = INIT_STD / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers:
            cast(TransformerBlock, layer).init_weights(INIT_STD, out_std)
        self.norm.init_weights()
        if not self.args.tie_embeddings:
            w = self.output.weight
            nn.init.trunc_normal_(w, mean=0.0, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)

    def num_params(self) -> int:
        """Actual parameter count; parameters() already dedups tied weights."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """See ModelArgs.flops_per_token."""
        return self.args.flops_per_token(seq_len)
