"""GPT-OSS: the mixture-of-experts family, against transformers' GptOssForCausalLM and by its own rules."""

from __future__ import annotations

import pytest
import torch

from archipelago.models import build_model, get_model_args
from archipelago.models.gpt_oss import GptOssArgs, YarnScaling

transformers = pytest.importorskip("transformers")


def _hf_config(args: GptOssArgs, vocab: int):
    yarn = args.yarn
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if yarn is not None:
        rope.update(rope_type="yarn", factor=yarn.factor, beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow,
                    truncate=False, original_max_position_embeddings=yarn.original_max_seq_len)
    return transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=args.dim, intermediate_size=args.ffn_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        num_local_experts=args.n_experts, num_experts_per_tok=args.top_k, sliding_window=args.sliding_window,
        rms_norm_eps=args.norm_eps, max_position_embeddings=args.max_seq_len, rope_parameters=rope,
        swiglu_limit=args.swiglu_limit, tie_word_embeddings=False)


def _their_names(n_layers: int) -> dict[str, str]:
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attention_norm.weight": "input_layernorm.weight",
                 "ffn_norm.weight": "post_attention_layernorm.weight", "attention.sinks": "self_attn.sinks",
                 "moe.router.weight": "mlp.router.weight", "moe.router.bias": "mlp.router.bias",
                 "moe.experts.gate_up": "mlp.experts.gate_up_proj",
                 "moe.experts.gate_up_bias": "mlp.experts.gate_up_proj_bias",
                 "moe.experts.down": "mlp.experts.down_proj", "moe.experts.down_bias": "mlp.experts.down_proj_bias"}
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        for kind in ("weight", "bias"):
            per_layer[f"attention.{ours}.{kind}"] = f"self_attn.{theirs}.{kind}"
    for i in range(n_layers):
        names.update({f"layers.{i}.{a}": f"model.layers.{i}.{b}" for a, b in per_layer.items()})
    return names


YARN = YarnScaling(factor=4.0, original_max_seq_len=16)  # frequencies visibly different from plain RoPE


def _tiny(n_layers: int = 3, yarn: YarnScaling | None = YARN, spread: float = 0.2, seed: int = 0):
    """A small GPT-OSS with its window shorter than the test sequences, and weights moved off
    their initial values (biases and sinks start at zero) so that every mapping counts."""
    args = GptOssArgs(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=96, ffn_dim=32,
                      n_experts=4, top_k=2, sliding_window=5, yarn=yarn, max_seq_len=64)
    model = build_model(args, device="cpu").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * spread)
    return args, model


@pytest.mark.parametrize("flavor", ["20b", "120b"])
def test_published_shapes_have_transformers_parameter_counts(flavor):
    args = get_model_args("gpt_oss", flavor)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(args, args.vocab_size))
    assert sum(p.numel() for p in theirs.parameters()) == args.num_params()
    # The published active counts: 3.6B and 5.1B per token.
    assert round(args.num_active_params() / 1e8) == {"20b": 36, "120b": 51}[flavor]


@pytest.mark.parametrize("yarn", [None, YARN], ids=["rope", "yarn"])
def test_logits_equal_transformers_with_the_same_weights(yarn):
    args, ours = _tiny(yarn=yarn)
    theirs = transformers.AutoModelForCausalLM.from_config(_hf_config(args, 96)).eval()
    theirs.config._attn_implementation = "eager"
    state = ours.state_dict()
    theirs.load_state_dict({b: state[a] for a, b in _their_names(args.n_layers).items()})
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=0, atol=1e-4)


def test_batched_experts_equal_a_loop_over_experts_and_routing_weights_sum_to_one():
    args = get_model_args("gpt_oss", "debug", vocab_size=128)
    model = build_model(args, device="cpu")
    moe = model.layers[0].moe
    x = torch.randn(40, args.dim, generator=torch.Generator().manual_seed(0))
    logits = moe.router(x)
    top, chosen = logits.topk(args.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    torch.testing.assert_close(weights.sum(-1), torch.ones(40))
    torch.testing.assert_close(moe.experts(x, chosen, weights), moe.experts.forward_loop(x, chosen, weights),
                               rtol=0, atol=1e-5)
    moe(x)
    assert int(moe.load.sum()) == 40 * args.top_k


def test_the_balancing_loss_is_one_when_routing_is_uniform_and_has_a_gradient():
    args = get_model_args("gpt_oss", "debug", vocab_size=128)
    model = build_model(args, device="cpu")
    moe = model.layers[0].moe
    with torch.no_grad():  # a router that gives every expert the same logit: uniform probabilities
        moe.router.weight.zero_()
        moe.router.bias.zero_()
    moe(torch.randn(64, args.dim))
    # Ties go to the lowest experts, so the load is not balanced, but the probabilities are uniform:
    # experts x sum(load share x 1/experts) = 1 whatever the load.
    assert float(moe.aux_loss.detach()) == pytest.approx(1.0)
    model = build_model(args, device="cpu")
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens)
    model.aux_loss.backward()
    assert model.layers[0].moe.router.weight.grad.abs().sum() > 0


def test_causal_and_windowed():
    args = get_model_args("gpt_oss", "debug", vocab_size=128)
    model = build_model(args, device="cpu").eval()
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 128
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0, :12], model(changed)[0, :12])


@pytest.mark.timeout(400)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_a_federation_of_two_and_one_ranks_trains_gpt_oss(tmp_path):
    """Island 0 spreads its experts over its 2 ranks (expert parallelism); island 1 holds all."""
    import json

    from conftest import losses, records, run_cli

    run = tmp_path / "federation"
    done = run_cli(["local", "--islands", "2,1", "--no-table", "--config", "configs/gpt_oss/federation.toml",
                    "--data.seq_len", "64", "--training.steps", "12", "--fault_tolerance.sync_steps", "4",
                    "--training.val_every", "0", "--checkpoint.interval", "4", "--metrics.log_every", "1",
                    "--lr_scheduler.warmup_steps", "2", "--metrics.progress", "plain", "--metrics.no_tensorboard",
                    "--parallelism.expert_parallel", "--job.run_dir", str(run)], timeout=380)
    assert done.returncode == 0, done.output[-4000:]
    fed = json.loads((run / "federation.json").read_text())
    assert fed["global_hash_agree"], fed["islands"]
    assert [o["participants"] for o in fed["outer_steps"]] == [2, 2, 2, 2]
    for island in ("island-0", "island-1"):
        curve = losses(run / island)
        assert curve[12] < curve[1] - 1.0, curve  # ln(4096) = 8.3 at the start
        logged = [r for r in records(run / island) if "expert_load_max" in r]  # router statistics
        assert len(logged) == 12 and all(r["expert_load_max"] >= 1 and r["aux_loss"] > 0 for r in logged)


def test_hugging_face_round_trips(tmp_path):
    from archipelago.checkpoint.hf import read_hf_weights, write_hf

    args, ours = _tiny(n_layers=2)
    out = write_hf(tmp_path / "hf", "gpt_oss", args, ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "GptOssForCausalLM"
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-4)
    again = build_model(args, device="cpu")
    again.load_state_dict(read_hf_weights(out, "gpt_oss", args))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_expert_parallel_needs_fsdp():
    from archipelago.config import Config, ConfigError, parse_overrides, validate

    with pytest.raises(ConfigError, match="expert_parallel needs parallelism.data_parallel"):
        validate(parse_overrides(Config(), ["--parallelism.expert_parallel", "--parallelism.data_parallel", "ddp"]))


@pytest.mark.timeout(300)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_an_expert_parallel_island_resumes_to_the_same_losses(tmp_path):
    from conftest import TINY, events, losses, run_cli

    common = ["train", *TINY, "--model.name", "gpt_oss", "--nproc", "2", "--parallelism.expert_parallel",
              "--training.steps", "6", "--training.val_every", "0", "--metrics.log_every", "1",
              "--checkpoint.interval", "3"]
    reference = run_cli([*common, "--job.run_dir", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.output[-3000:]
    run = tmp_path / "broken"
    broken = run_cli([*common, "--job.run_dir", str(run)], env={"ARCHIPELAGO_FAULT": "error@5"})
    assert broken.returncode != 0
    resumed = run_cli([*common, "--job.run_dir", str(run)])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [e["step"] for e in events(run) if e["event"] == "resume"] == [3]
    want, got = losses(tmp_path / "reference"), losses(run)
    for step in range(4, 7):  # every rank's experts came back from the checkpoint
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, want, got)


def test_greedy_generation_equals_transformers_generate(tmp_path):
    from archipelago.checkpoint.hf import write_hf
    from archipelago.models.generation import generate

    args, ours = _tiny(spread=0.3, seed=1)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(write_hf(tmp_path / "hf", "gpt_oss", args,
                                                                        ours.state_dict()), dtype=torch.float32)
    prompt = [5, 17, 33, 2, 80, 41]
    got = generate(ours, prompt, 20)  # past the window: the cache's positions are masked as the full pass does
    want = theirs.eval().generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
    assert got == want.tolist() and len(set(got)) > 3, (got, want.tolist())
