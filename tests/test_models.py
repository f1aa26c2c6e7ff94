"""Tests for archipelago.models: param counts, causality, GQA, RoPE, tying, registry."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from archipelago.models import (
    DEFAULT_VOCAB_SIZE,
    FAMILIES,
    ModelArgs,
    RopeScaling,
    build_model,
    get_model_args,
    list_flavors,
)
from archipelago.models.layers import Attention, apply_rope, rope_frequencies

# (family, flavor, vocab_size passed, exact unique parameter count)
EXACT_COUNTS = [
    ("llama3", "debug", 2048, 6_163_712),
    ("llama3", "1B", None, 1_235_814_400),  # Llama-3.2-1B, tied
    ("llama3", "8B", None, 8_030_261_248),
    ("llama3", "70B", None, 70_553_706_496),
    ("qwen3", "0.6B", None, 596_049_920),
    # Tied, so lm_head is not double counted; see test_qwen3_1_7b_untied_count.
    ("qwen3", "1.7B", None, 1_720_574_976),
    ("qwen3", "8B", None, 8_190_735_360),
]


def _meta_count(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


@pytest.mark.parametrize("family,flavor,vocab,expected", EXACT_COUNTS)
def test_exact_param_counts(family: str, flavor: str, vocab: int | None, expected: int) -> None:
    args = get_model_args(family, flavor, vocab_size=vocab)
    assert args.num_params() == expected
    model = build_model(args, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert _meta_count(model) == expected
    assert model.num_params() == expected


def test_qwen3_1_7b_untied_count() -> None:
    # The published 2,031,739,904 counts lm_head as a separate matrix.
    args = get_model_args("qwen3", "1.7B")
    assert replace(args, tie_embeddings=False).num_params() == 2_031_739_904


def test_small_flavors_near_125m() -> None:
    for family in ("llama3", "qwen3"):
        n = get_model_args(family, "small", vocab_size=DEFAULT_VOCAB_SIZE).num_params()
        assert 115e6 < n < 135e6


def _tiny_model(family: str, seed: int = 0, vocab: int = 97) -> torch.nn.Module:
    args = get_model_args(family, "debug", vocab_size=vocab)
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.float().eval()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_causality(family: str) -> None:
    model = _tiny_model(family)
    torch.manual_seed(1)
    tokens = torch.randint(0, 97, (2, 12))
    t = 5
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % 97
    with torch.no_grad():
        a = model(tokens)
        b = model(changed)
    assert a.dtype == torch.float32 and a.shape == (2, 12, 97)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    diff = (a[:, t:] - b[:, t:]).abs().amax(dim=-1)  # [B, T - t]
    assert (diff > 1e-6).all()


def _reference_attention(attn: Attention, x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Plain softmax attention with manually repeated kv heads; RoPE is identity."""
    bsz, seqlen, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bsz, seqlen, -1, hd)
    k = (x @ attn.wk.weight.T).view(bsz, seqlen, -1, hd)
    v = (x @ attn.wv.weight.T).view(bsz, seqlen, -1, hd)
    if attn.q_norm is not None:
        rms = lambda t, w: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
        q = rms(q, attn.q_norm.weight)
        k = rms(k, attn.k_norm.weight)
    heads = []
    for h in range(q.shape[2]):
        qh = q[:, :, h]  # query head h reads kv head h // n_rep
        kh = k[:, :, h // n_rep]
        vh = v[:, :, h // n_rep]
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(hd)
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ vh)
    out = torch.cat(heads, dim=-1)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gqa_matches_reference(qk_norm: bool) -> None:
    torch.manual_seed(0)
    args = ModelArgs(
        dim=32, n_layers=1, n_heads=6, n_kv_heads=2, head_dim=8, ffn_dim=64,
        vocab_size=16, qk_norm=qk_norm, norm_eps=1e-6,
    )
    attn = Attention(args)
    if qk_norm:
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, 32)
    cos = torch.ones(7, 4)  # identity rotation isolates the attention math
    sin = torch.zeros(7, 4)
    with torch.no_grad():
        got = attn(x, cos, sin)
        want = _reference_attention(attn, x, n_rep=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _reference_llama31_freq(freq: float, s: RopeScaling) -> float:
    wavelen = 2 * math.pi / freq
    if wavelen < s.original_max_seq_len / s.high_freq_factor:
        return freq
    if wavelen > s.original_max_seq_len / s.low_freq_factor:
        return freq / s.factor
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    return (1 - smooth) * freq / s.factor + smooth * freq


def test_llama31_rope_scaling_matches_reference() -> None:
    s = get_model_args("llama3", "8B").rope_scaling
    assert s == RopeScaling(8.0, 1.0, 4.0, 8192)
    head_dim, theta = 128, 500000.0
    got = rope_frequencies(head_dim, theta, s)
    base = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    want = torch.tensor([_reference_llama31_freq(f, s) for f in base], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # All three regimes must actually occur for this config.
    ratios = (got / torch.tensor(base, dtype=torch.float64)).tolist()
    assert any(r == 1.0 for r in ratios)
    assert any(abs(r - 1 / 8) < 1e-12 for r in ratios)
    assert any(1 / 8 + 1e-9 < r < 1 - 1e-9 for r in ratios)


def test_rope_is_relative() -> None:
    # <rope(q, m), rope(k, n)> depends only on m - n.
    model = _tiny_model("llama3")
    torch.manual_seed(0)
    q = torch.randn(1, 1, 1, 16).expand(1, 20, 1, 16)
    k = torch.randn(1, 1, 1, 16).expand(1, 20, 1, 16)
    qr = apply_rope(q, model.rope_cos[:20], model.rope_sin[:20])[0, :, 0]
    kr = apply_rope(k, model.rope_cos[:20], model.rope_sin[:20])[0, :, 0]
    torch.testing.assert_close(qr[7] @ kr[3], qr[15] @ kr[11], rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_storage() -> None:
    args = get_model_args("qwen3", "0.6B")
    model = build_model(args)
    assert model.output.weight is model.tok_embeddings.weight
    for family, flavor, a in list_flavors():
        if a.tie_embeddings:
            m = build_model(a)
            assert m.output.weight is m.tok_embeddings.weight, (family, flavor)
    # The tie survives to_empty (which would otherwise untie it) and init.
    model = _tiny_model("qwen3")
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert "output.weight" not in dict(model.named_parameters())


def test_untied_llama() -> None:
    model = build_model(get_model_args("llama3", "8B"))
    assert model.output.weight is not model.tok_embeddings.weight


def test_qwen3_qk_norm_params() -> None:
    model = build_model(get_model_args("qwen3", "0.6B"))
    attn = model.layers[0].attention
    assert attn.q_norm.weight.shape == (128,)
    assert attn.k_norm.weight.shape == (128,)
    names = dict(model.named_parameters())
    assert "layers.0.attention.q_norm.weight" in names
    llama = build_model(get_model_args("llama3", "debug", vocab_size=64))
    assert not any("q_norm" in n for n, _ in llama.named_parameters())


def test_init_weights_after_to_empty() -> None:
    model = _tiny_model("llama3", seed=3)
    assert "rope_cos" not in model.state_dict()
    assert torch.isfinite(model.rope_cos).all() and model.rope_cos[0].eq(1).all()
    with torch.no_grad():
        out = model(torch.randint(0, 97, (2, 8)))
    assert torch.isfinite(out).all()
    layer = model.layers[0]
    assert layer.attention_norm.weight.eq(1).all()
    std_wq = layer.attention.wq.weight.std().item()
    std_wo = layer.attention.wo.weight.std().item()
    assert 0.015 < std_wq < 0.025
    assert std_wo < std_wq / 2  # scaled by 1/sqrt(2 * n_layers)
    # Same seed -> same weights.
    again = _tiny_model("llama3", seed=3)
    torch.testing.assert_close(again.layers[0].attention.wq.weight, layer.attention.wq.weight)


def test_build_on_cpu_initialises() -> None:
    args = get_model_args("qwen3", "debug", vocab_size=50)
    model = build_model(args, device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert model.rope_cos.device.type == "cpu"
    assert torch.isfinite(model(torch.randint(0, 50, (1, 4)))).all()


def test_unknown_names_suggest_closest() -> None:
    with pytest.raises(ValueError, match=r"'debug'.*debug, small, 1B, 8B, 70B"):
        get_model_args("llama3", "debg", vocab_size=10)
    with pytest.raises(ValueError, match="'8B'"):
        get_model_args("llama3", "8b")
    with pytest.raises(ValueError, match="'qwen3'"):
        get_model_args("qwen", "0.6B")


def test_vocab_resolution() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        get_model_args("llama3", "debug")
    with pytest.raises(ValueError, match="200000.*128256"):
        get_model_args("llama3", "8B", vocab_size=200_000)
    assert get_model_args("llama3", "8B", vocab_size=1000).vocab_size == 128256
    a = get_model_args("llama3", "debug", vocab_size=123)
    assert a.vocab_size == 123
    assert FAMILIES["llama3"]["debug"].vocab_size is None  # a copy was returned
    a.dim = 1
    assert FAMILIES["llama3"]["debug"].dim == 256


def test_list_flavors() -> None:
    entries = list_flavors()
    names = {(f, n) for f, n, _ in entries}
    assert ("llama3", "70B") in names and ("qwen3", "0.6B") in names
    for _, _, a in entries:
        assert a.num_params() > 0
    assert dict(((f, n), a) for f, n, a in entries)[("llama3", "debug")].vocab_size == 4096


def test_args_validation() -> None:
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelArgs(dim=64, n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim"):
        ModelArgs(dim=60, n_heads=8)
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling(factor=8, low_freq_factor=4, high_freq_factor=1)
    assert ModelArgs(dim=64, n_heads=8).head_dim == 8


def test_flops_per_token() -> None:
    # llama3 debug, vocab 2048, seq 128, untied:
    #   params 6,163,712 - embedding 2048*256 = 5,639,424 -> 6x = 33,836,544
    #   attention 12 * 6 layers * 16 heads * 16 head_dim * 128 = 2,359,296
    args = get_model_args("llama3", "debug", vocab_size=2048)
    assert args.flops_per_token(128) == 33_836_544 + 2_359_296
    assert build_model(args).flops_per_token(128) == 36_195_840
    # Tying does not remove the output matmul, so FLOPs are shape-only.
    tied = replace(args, tie_embeddings=True)
    assert tied.flops_per_token(128) == args.flops_per_token(128) > 0


def test_kv_cache_decoding_equals_the_full_forward() -> None:
    args = get_model_args("qwen3", "debug", vocab_size=128)
    model = build_model(args, device="cpu").eval()
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        caches = model.new_caches(2, 12)
        parts = [model(tokens[:, :5], caches),      # the prompt at once (causal)
                 model(tokens[:, 5:9], caches),     # a chunk after cached positions (explicit mask)
                 *[model(tokens[:, t:t + 1], caches) for t in range(9, 12)]]  # one token at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    assert caches[0].length == 12
    with pytest.raises(ValueError, match="KV cache holds 12 positions"):
        model(tokens[:, :1], caches)


def test_top_p_samples_only_from_the_nucleus() -> None:
    from archipelago.models.generation import pick

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    assert pick(logits, 0.0, 1.0, None) == 0
    drawn = {pick(logits, 1.0, 0.7, generator) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.7; the third token never comes
    assert {pick(logits, 1.0, 1.0, generator) for _ in range(400)} == {0, 1, 2, 3}
