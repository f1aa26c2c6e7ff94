"""Qwen3-MoE: Qwen3 attention with routed SwiGLU experts, against transformers' Qwen3MoeForCausalLM."""

from __future__ import annotations

import pytest
import torch

from archipelago.models import build_model, get_model_args
from archipelago.models.qwen3_moe import Qwen3MoeArgs

transformers = pytest.importorskip("transformers")


def _hf_config(args: Qwen3MoeArgs):
    return transformers.Qwen3MoeConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, num_experts=args.n_experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn_dim, norm_topk_prob=args.norm_topk_prob, rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings, max_position_embeddings=args.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})


def test_the_published_shape_has_transformers_parameter_count():
    args = get_model_args("qwen3_moe", "30B-A3B")
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(args))
    assert sum(p.numel() for p in theirs.parameters()) == args.num_params() == 30_532_122_624
    # Published: 3.3B activated, counting the embedding table.
    assert round((args.num_active_params() + args.vocab_size * args.dim) / 1e8) == 34


def test_logits_equal_transformers_with_the_same_weights():
    args = get_model_args("qwen3_moe", "debug", vocab_size=96)
    ours = build_model(args, device="cpu").eval()
    theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(args)).eval()
    names = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    for i in range(args.n_layers):
        for a, b in (("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"),
                     ("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                     ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
                     ("self_attn.q_norm", "attention.q_norm"), ("self_attn.k_norm", "attention.k_norm"),
                     ("mlp.gate", "feed_forward.router")):
            names[f"model.layers.{i}.{a}.weight"] = f"layers.{i}.{b}.weight"
    state = ours.state_dict()
    mapped = {theirs_name: state[ours_name] for theirs_name, ours_name in names.items()}
    for i in range(args.n_layers):  # theirs: gate_up [E, 2F, D] and down [E, D, F]; ours transposed
        mapped[f"model.layers.{i}.mlp.experts.gate_up_proj"] = state[f"layers.{i}.feed_forward.experts.gate_up"].mT
        mapped[f"model.layers.{i}.mlp.experts.down_proj"] = state[f"layers.{i}.feed_forward.experts.down"].mT
    theirs.load_state_dict(mapped, strict=False)  # lm_head is tied to the embedding in the debug flavor
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_routing_weights_renormalise_and_the_balancing_loss_is_kept(shakespeare, tmp_path):
    from conftest import TINY, records, run_cli_here

    args = get_model_args("qwen3_moe", "debug", vocab_size=128)
    moe = build_model(args, device="cpu").layers[0].feed_forward
    x = torch.randn(30, args.dim)
    weights, _ = torch.softmax(moe.router(x), -1).topk(args.top_k, dim=-1)
    assert (weights.sum(-1) < 1).all()  # the top-k of a softmax: renormalised in forward
    done = run_cli_here(["train", *TINY, "--model.name", "qwen3_moe", "--training.steps", "6",
                         "--training.val_every", "0", "--metrics.log_every", "1", "--checkpoint.no_enable",
                         "--job.run_dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.output[-3000:]
    logged = [r for r in records(tmp_path / "run") if "loss" in r]
    assert logged[-1]["loss"] < logged[0]["loss"] and all("expert_load_max" in r for r in logged)
