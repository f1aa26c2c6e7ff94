"""Qwen3-MoE: Qwen3's attention with a mixture of experts in place of every feed-forward.

The router is a linear layer without bias; a token goes to the top-k experts of the
softmax over all experts, their probabilities renormalised to sum to one
(`norm_topk_prob`, as the published models do). Each expert is a plain SwiGLU without
biases. The experts run through the same dropless batched matmuls as gpt_oss's
(models/moe.py), and each forward leaves the same balancing loss and load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs
from .layers import TransformerBlock
from .moe import balancing_loss, grouped_experts
from .registry import register_family
from .transformer import INIT_STD, Transformer


@dataclass
class Qwen3MoeArgs(ModelArgs):
    """A Qwen3 shape whose blocks hold `n_experts` experts of width `moe_ffn_dim` (top_k per token)."""

    n_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 256
    norm_topk_prob: bool = True

    def _moe_params(self, experts: int) -> int:
        return self.n_experts * self.dim + experts * 3 * self.dim * self.moe_ffn_dim  # router + experts

    def layer_params(self) -> int:
        """One block with every expert (the dense feed-forward is not there)."""
        return super().layer_params() - 3 * self.dim * self.ffn_dim + self._moe_params(self.n_experts)

    def num_active_params(self) -> int:
        """Parameters one token's forward computes with: top_k experts per block; the output
        layer, not the embedding table."""
        active_layer = super().layer_params() - 3 * self.dim * self.ffn_dim + self._moe_params(self.top_k)
        return self.n_layers * active_layer + self.dim + self._require_vocab() * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """6 x the active matmul parameters + attention (see ModelArgs.flops_per_token)."""
        assert self.head_dim is not None
        return 6 * self.num_active_params() + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


class SwiGLUExperts(nn.Module):
    """Stacked SwiGLU experts without biases: gate_up [E, D, 2F] ([gate | up]), down [E, F, D]."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(args.n_experts, args.dim, 2 * args.moe_ffn_dim))
        self.down = nn.Parameter(torch.empty(args.n_experts, args.moe_ffn_dim, args.dim))

    @staticmethod
    def activation(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        order = experts.reshape(-1).argsort(stable=True)
        out = self.grouped(x[order // k], experts.reshape(-1)[order], (self.gate_up, None, self.down, None))
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        return x.new_zeros(x.shape).index_add_(0, order // k, out)

    def grouped(self, rows: torch.Tensor, expert_of: torch.Tensor, params: tuple) -> torch.Tensor:
        gate_up, _, down, _ = params
        return grouped_experts(rows, expert_of, gate_up, down, self.activation)


class SparseMoE(nn.Module):
    """Softmax over all experts, the top_k of it (renormalised), their SwiGLUs."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.top_k, self.renormalise = args.top_k, args.norm_topk_prob
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = SwiGLUExperts(args)
        self.aux_loss = torch.zeros(())
        self.load = torch.zeros(args.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        weights, chosen = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        self.aux_loss, self.load = balancing_loss(logits, chosen)
        return self.experts(x, chosen, weights).reshape(shape)

    def init_weights(self, std: float) -> None:
        for p in (self.router.weight, self.experts.gate_up, self.experts.down):
            nn.init.normal_(p, std=std)


class Qwen3Moe(Transformer):
    """Transformer (Qwen3 attention) whose blocks' feed-forward is a SparseMoE."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args)
        for block in self.layers:
            cast(TransformerBlock, block).feed_forward = SparseMoE(args)  # type: ignore[assignment]
        self.aux_loss = torch.zeros(())

    def _moes(self) -> list[SparseMoE]:
        return [cast(SparseMoE, cast(TransformerBlock, block).feed_forward) for block in self.layers]

    def _init_params(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=INIT_STD)
        for block in self.layers:
            b = cast(TransformerBlock, block)
            b.attention_norm.init_weights()
            b.ffn_norm.init_weights()
            b.attention.init_weights(INIT_STD, INIT_STD / (2 * self.args.n_layers) ** 0.5)
            cast(SparseMoE, b.feed_forward).init_weights(INIT_STD)
        self.norm.init_weights()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor, caches: list | None = None) -> torch.Tensor:
        logits = super().forward(tokens, caches)
        self.aux_loss = torch.stack([moe.aux_loss for moe in self._moes()]).mean()
        return logits

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert in the last forward, [layers, experts]."""
        return torch.stack([moe.load for moe in self._moes()])


_QWEN3: dict[str, Any] = dict(qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6)

FLAVORS: dict[str, ModelArgs] = {
    "debug": Qwen3MoeArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, vocab_size=None,
                          tie_embeddings=True, max_seq_len=2048, n_experts=8, top_k=2, moe_ffn_dim=256, **_QWEN3),
    # Qwen3-30B-A3B: 30,532,122,624 parameters; 3,041,867,776 active per token without the embedding
    # table, 3,353,032,704 with it (the published "3.3B activated" counts it).
    "30B-A3B": Qwen3MoeArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144,
                            vocab_size=151936, tie_embeddings=False, max_seq_len=40960, n_experts=128, top_k=8,
                            moe_ffn_dim=768, **_QWEN3),
}

register_family("qwen3_moe", FLAVORS, builder=Qwen3Moe)
