"""GPT-OSS: a mixture-of-experts decoder (OpenAI's gpt-oss-20b / -120b shapes), for one device.

Written from the published architecture: grouped-query attention with biases and a learned
*sink* logit per head (a column every query may attend to instead of any token), layers
alternating between a sliding window and full causal attention, RoPE with YaRN scaling,
and in every block a token-choice router (top-k of a linear layer's logits, softmax over
the k chosen) sending each token to k expert SwiGLU FFNs in the published clamped form
(gate clamped above, up clamped both sides, gate * sigmoid(alpha * gate) * (up + 1)).

Experts are dropless and batched: the (token, expert) assignments are sorted by expert
into one [experts, capacity, dim] buffer and each projection is one batched matmul over
all experts (capacity = the busiest expert's load, so nothing is dropped). Every forward
leaves the load-balancing loss (Switch-Transformer form: experts x sum of load fraction x
mean router probability, 1 when routing is uniform) in `aux_loss` and each layer's tokens
per expert in `expert_load`. Attention is computed eagerly in float32 because the sinks
need the softmax's normaliser (no fused kernel takes them): memory grows with the square
of the sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .layers import KVCache, RMSNorm, apply_rope
from .moe import balancing_loss, grouped_experts
from .registry import register_family


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling: interpolate low frequencies by `factor`, keep high ones, blend
    between the `beta_fast` and `beta_slow` rotation counts; cos/sin scaled by 0.1 ln(factor) + 1."""

    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_seq_len: int = 4096


@dataclass
class GptOssArgs:
    """Shape of a GPT-OSS model (`vocab_size=None`: from the tokenizer)."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int | None = None
    ffn_dim: int = 256                # each expert's hidden width
    n_experts: int = 8
    top_k: int = 2
    sliding_window: int = 128         # even layers (0, 2, ...) attend to this many positions
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    yarn: YarnScaling | None = None
    max_seq_len: int = 2048
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k = {self.top_k}: expected 1..n_experts ({self.n_experts})")

    def _vocab(self) -> int:
        if self.vocab_size is None:
            raise ValueError("vocab_size is unset (it comes from the tokenizer); resolve it first")
        return self.vocab_size

    def attention_params(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (self.dim * q + q) + 2 * (self.dim * kv + kv) + (q * self.dim + self.dim) + self.n_heads

    def expert_params(self) -> int:
        """One expert: the gate/up projection and the down projection, with biases."""
        return self.dim * 2 * self.ffn_dim + 2 * self.ffn_dim + self.ffn_dim * self.dim + self.dim

    def layer_params(self, experts: int) -> int:
        router = self.n_experts * self.dim + self.n_experts
        return 2 * self.dim + self.attention_params() + router + experts * self.expert_params()

    def num_params(self) -> int:
        """Every parameter (all experts)."""
        vocab = self._vocab()
        output = 0 if self.tie_embeddings else vocab * self.dim
        return vocab * self.dim + self.n_layers * self.layer_params(self.n_experts) + self.dim + output

    def num_active_params(self) -> int:
        """Parameters one token's forward computes with: the top_k experts of each layer, not
        all of them, and the output layer but not the embedding table (a lookup), as the
        published active counts are given."""
        return self.n_layers * self.layer_params(self.top_k) + self.dim + self._vocab() * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x the active matmul parameters (the output layer, not
        the embedding lookup) + attention's scores and sums over the positions each layer sees."""
        vocab = self._vocab()
        matmul = self.n_layers * self.layer_params(self.top_k) + self.dim + vocab * self.dim
        seen = sum(min(seq_len, self.sliding_window) if k % 2 == 0 else seq_len for k in range(self.n_layers))
        return 6 * matmul + 12 * self.n_heads * self.head_dim * seen


def yarn_frequencies(head_dim: int, theta: float, yarn: YarnScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float64, cos/sin scale) of RoPE, YaRN-scaled when given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    extrapolation = 1.0 / theta**exponents
    if yarn is None:
        return extrapolation, 1.0
    interpolation = extrapolation / yarn.factor

    def dim_of(rotations: float) -> float:  # the channel pair that turns `rotations` times over the original context
        return head_dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(dim_of(yarn.beta_fast), 0.0), min(dim_of(yarn.beta_slow), head_dim - 1.0)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    scale = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return interpolation * (1 - keep) + extrapolation * keep, scale


class SinkAttention(nn.Module):
    """Grouped-query attention with biases, a learned sink logit per head, and an optional window."""

    def __init__(self, args: GptOssArgs, window: int | None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = args.n_heads, args.n_kv_heads, args.head_dim, window
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = apply_rope(self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        start = 0
        if cache is not None:  # generation: the cached positions come first
            start = cache.length
            k, v = cache.extend(k, v)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        queries = torch.arange(start, start + seqlen, device=x.device)
        keys = torch.arange(start + seqlen, device=x.device)
        allowed = keys[None, :] <= queries[:, None]
        if self.window is not None:
            allowed &= queries[:, None] - keys[None, :] < self.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = self.sinks.float().view(1, -1, 1, 1).expand(bsz, -1, seqlen, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink takes its share
        out = (probs.to(v.dtype) @ v).transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)
        return self.wo(out)


class Experts(nn.Module):
    """`n_experts` clamped-SwiGLU FFNs with biases, stored stacked (one tensor per projection)."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        e, d, f = args.n_experts, args.dim, args.ffn_dim
        self.gate_up = nn.Parameter(torch.empty(e, d, 2 * f))  # gate and up interleaved: [..., 0::2], [..., 1::2]
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.down = nn.Parameter(torch.empty(e, f, d))
        self.down_bias = nn.Parameter(torch.empty(e, d))
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D]; experts, weights [N, k] -> the weighted sum of each token's experts [N, D]."""
        n, k = experts.shape
        order = experts.reshape(-1).argsort(stable=True)  # assignments grouped by expert
        out = self.grouped(x[order // k], experts.reshape(-1)[order],
                           (self.gate_up, self.gate_up_bias, self.down, self.down_bias))
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        return x.new_zeros(x.shape).index_add_(0, order // k, out)

    def grouped(self, rows: torch.Tensor, expert_of: torch.Tensor, params: tuple) -> torch.Tensor:
        """Row i through expert expert_of[i] of `params` (gate_up, its bias, down, its bias:
        these experts' or a slice of them), rows sorted by expert (moe.grouped_experts)."""
        gate_up, gate_up_bias, down, down_bias = params
        return grouped_experts(rows, expert_of, gate_up, down, self.activation, gate_up_bias, down_bias)

    def forward_loop(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same as forward with a Python loop over experts (a reference for tests and benchmarks)."""
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            token, choice = torch.where(experts == e)
            if token.numel():
                h = self.activation(x[token] @ self.gate_up[e] + self.gate_up_bias[e])
                out.index_add_(0, token, (h @ self.down[e] + self.down_bias[e]) * weights[token, choice, None])
        return out


class MixtureOfExperts(nn.Module):
    """Token-choice top-k routing to the experts; keeps the balancing loss and the load."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts)
        self.experts = Experts(args)
        self.aux_loss = torch.zeros(())
        self.load = torch.zeros(args.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        top, chosen = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)  # over the chosen experts only
        self.aux_loss, self.load = balancing_loss(logits, chosen)
        return self.experts(x, chosen, weights).reshape(shape)


class GptOssBlock(nn.Module):
    def __init__(self, layer_id: int, args: GptOssArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = SinkAttention(args, args.sliding_window if layer_id % 2 == 0 else None)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MixtureOfExperts(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.moe(self.ffn_norm(h))


class GptOss(nn.Module):
    """Token embeddings -> alternating sliding/full attention blocks with experts -> norm -> output."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.args = args
        vocab = args._vocab()
        self.tok_embeddings = nn.Embedding(vocab, args.dim)
        self.layers = nn.ModuleList(GptOssBlock(k, args) for k in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, vocab, bias=False)
        cos, sin = self._rope_tables(torch.get_default_device())
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.aux_loss = torch.zeros(())

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        freqs, scale = yarn_frequencies(a.head_dim, a.rope_theta, a.yarn)
        if torch.device(device).type == "meta":
            shape = (a.max_seq_len, a.head_dim // 2)
            return torch.empty(shape, device=device), torch.empty(shape, device=device)
        angles = torch.outer(torch.arange(a.max_seq_len, dtype=torch.float64), freqs)
        return ((angles.cos() * scale).float().to(device), (angles.sin() * scale).float().to(device))

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]; with `caches` (generation) the tokens continue
        the cached positions, as in Transformer.forward."""
        start = caches[0].length if caches else 0
        end = start + tokens.shape[1]
        if end > self.args.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        h = self.tok_embeddings(tokens)
        for k, layer in enumerate(self.layers):
            h = layer(h, cos, sin, caches[k]) if caches else layer(h, cos, sin)
        self.aux_loss = torch.stack([moe.aux_loss for moe in self._moes()]).mean()
        return self.output(self.norm(h))

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """Empty KV caches, one per layer, for up to `max_len` positions."""
        a, weight = self.args, self.tok_embeddings.weight
        return [KVCache(batch, a.n_kv_heads, min(max_len, a.max_seq_len), a.head_dim, weight.device, weight.dtype)
                for _ in range(a.n_layers)]

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert in the last forward, [layers, experts]."""
        return torch.stack([moe.load for moe in self._moes()])

    def _moes(self) -> list[MixtureOfExperts]:
        # A block may sit in a checkpoint wrapper, which passes attribute reads through.
        return [cast(GptOssBlock, block).moe for block in self.layers]

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> None:
        """Normal(0, std) matrices and experts, zero biases and sinks, unit norms; RoPE tables again."""
        self.rope_cos, self.rope_sin = self._rope_tables(self.tok_embeddings.weight.device)
        device = self.tok_embeddings.weight.device
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [],
                                   enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for name, p in self.named_parameters():
                if name.endswith("bias") or name.endswith("sinks"):
                    nn.init.zeros_(p)
                elif p.ndim == 1:
                    nn.init.ones_(p)
                else:
                    nn.init.normal_(p, std=std)


def build_gpt_oss(args: GptOssArgs) -> GptOss:
    return GptOss(args)


# The published gpt-oss shapes (both sizes): width 2880, 64 query and 8 key/value heads of 64,
# experts of width 2880, top-4 routing, a 128-token window on every other layer, YaRN x32.
_PUBLISHED: dict[str, Any] = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088, ffn_dim=2880,
                                  top_k=4, sliding_window=128, rope_theta=150000.0, yarn=YarnScaling(),
                                  max_seq_len=131072)

FLAVORS: dict[str, GptOssArgs] = {
    "debug": GptOssArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, ffn_dim=256, n_experts=8,
                        top_k=2, sliding_window=64, rope_theta=150000.0),
    "20b": GptOssArgs(n_layers=24, n_experts=32, **_PUBLISHED),    # 20,914,757,184 parameters, 3,608,307,264 active
    "120b": GptOssArgs(n_layers=36, n_experts=128, **_PUBLISHED),  # 116,829,156,672 parameters, 5,132,849,472 active
}

register_family("gpt_oss", FLAVORS, builder=build_gpt_oss)  # type: ignore[arg-type]
