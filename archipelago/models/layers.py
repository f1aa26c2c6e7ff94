"""Transformer building blocks: RMSNorm, RoPE, GQA attention, SwiGLU, block."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs, RopeScaling

_HAS_RMS_NORM = hasattr(F, "rms_norm")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 then cast back before scaling: this matches the
        # reference Llama/Qwen implementations bit-for-bit in bf16 training.
        xf = x.float()
        if _HAS_RMS_NORM:
            normed = F.rms_norm(xf, (self.dim,), eps=self.eps)
        else:
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Inverse frequencies (float64, CPU) for each rotated channel pair."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling is not None:
        freqs = _llama31_scale(freqs, scaling)
    return freqs


def _llama31_scale(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Low frequencies (long wavelengths) are slowed down by `factor` so that
    # positions beyond the original context stay in-distribution; high
    # frequencies keep local resolution; the band in between is blended.
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    out = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, out)


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-valued (cos, sin) tables of shape [max_seq_len, head_dim // 2], float32.

    Real tensors (not complex) keep torch.compile and FSDP happy.
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    shape = (max_seq_len, head_dim // 2)
    if device.type == "meta":
        # Nothing to compute; init_weights() fills them after to_empty().
        return (torch.empty(shape, device=device), torch.empty(shape, device=device))
    # Computed in float64 on CPU so every device gets identical tables.
    freqs = rope_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, freqs)
    cos = angles.cos().to(device=device, dtype=torch.float32)
    sin = angles.sin().to(device=device, dtype=torch.float32)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] using the half-split ("rotate_half") layout.

    The half-split layout is what Hugging Face checkpoints of both Llama and
    Qwen3 use, so their q/k weights load without permutation.
    """
    d2 = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d2], xf[..., d2:]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.type_as(x)


def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class KVCache:
    """Keys and values of the positions seen so far, for generation: one layer's
    [batch, kv_heads, max_len, head_dim] buffers and how many positions they hold."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, H, T, D]; return all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; {end} needed (raise max_len)")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    """Causal grouped-query attention with optional per-head QK RMSNorm (Qwen3)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.head_dim is not None and args.n_kv_heads is not None
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        # Qwen3 normalises each head before RoPE so the rotation acts on unit-scale vectors.
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        start = 0
        if cache is not None:  # generation: attend to the cached positions too
            start = cache.length
            k, v = cache.extend(k, v)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            # Explicit repeat (query head h reads kv head h // n_rep) works on
            # every SDPA backend, unlike enable_gqa.
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, **_causal(start, seqlen, q.device))
        out = out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim)
        return self.wo(out)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _init_linear(linear, std)
        _init_linear(self.wo, out_std)
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.init_weights()
            self.k_norm.init_weights()


def _causal(start: int, seqlen: int, device: torch.device) -> dict:
    """SDPA's causal masking for queries at positions start..start+seqlen-1 over keys 0..end."""
    if start == 0:
        return {"is_causal": True}
    if seqlen == 1:  # one new token sees every cached one
        return {}
    keys = torch.arange(start + seqlen, device=device)
    queries = torch.arange(start, start + seqlen, device=device)
    return {"attn_mask": keys[None, :] <= queries[:, None]}


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        _init_linear(self.w1, std)
        _init_linear(self.w3, std)
        _init_linear(self.w2, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std, out_std)
        self.feed_forward.init_weights(std, out_std)
