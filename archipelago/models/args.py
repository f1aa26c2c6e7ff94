"""Model hyper-parameters shared by every family (Llama-3, Qwen3)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 RoPE frequency scaling (long-context extension)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low={self.low_freq_factor}, high={self.high_freq_factor}; swap or fix them"
            )
        if self.original_max_seq_len <= 0:
            raise ValueError(
                f"rope_scaling.original_max_seq_len must be > 0, got {self.original_max_seq_len}"
            )


@dataclass
class ModelArgs:
    """Shape of a decoder-only transformer.

    ``head_dim=None`` resolves to ``dim // n_heads``; ``n_kv_heads=None`` means
    ``n_heads`` (plain multi-head attention). ``vocab_size=None`` means the
    vocabulary comes from the tokenizer at build time (see ``get_model_args``).
    """

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    ffn_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}); pick n_kv_heads among the divisors of n_heads"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); "
                    "set head_dim explicitly or change dim/n_heads"
                )
            self.head_dim = self.dim // self.n_heads
        # RoPE rotates pairs of channels, so an odd head_dim cannot be rotated.
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(
                f"vocab_size must be > 0 or None (taken from the tokenizer), got {self.vocab_size}"
            )
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    def _require_vocab(self) -> int:
        if self.vocab_size is None:
            raise ValueError(
                "vocab_size is None; resolve it first, e.g. "
                "get_model_args(family, flavor, vocab_size=tokenizer_vocab_size)"
            )
        return self.vocab_size

    def layer_params(self) -> int:
        """Parameters in one TransformerBlock."""
        assert self.head_dim is not None and self.n_kv_heads is not None
        q_out = self.n_heads * self.head_dim
        kv_out = self.n_kv_heads * self.head_dim
        attn = self.dim * q_out + 2 * self.dim * kv_out + q_out * self.dim
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        ffn = 3 * self.dim * self.ffn_dim
        norms = 2 * self.dim
        return attn + qk_norm + ffn + norms

    def num_params(self) -> int:
        """Unique parameter count (a tied embedding/output matrix counts once)."""
        vocab = self._require_vocab()
        embed = vocab * self.dim
        output = 0 if self.tie_embeddings else vocab * self.dim
        return embed + self.n_layers * self.layer_params() + self.dim + output

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 * N_matmul + 12 * L * H * head_dim * seq_len.

        N_matmul excludes the token-embedding matrix because a lookup is not a
        matmul, but the output projection is always a matmul, so its
        ``vocab * dim`` weights are counted whether or not they are tied to the
        embedding. Hence tied and untied models of the same shape have the same
        FLOPs. The second term is attention's QK^T and AV (PaLM / torchtitan).
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        vocab = self._require_vocab()
        assert self.head_dim is not None
        matmul_params = self.n_layers * self.layer_params() + self.dim + vocab * self.dim
        attn = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * matmul_params + attn
