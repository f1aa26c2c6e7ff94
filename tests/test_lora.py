"""LoRA adapters: the adapted model, training only the adapters, merged export, and a LoRA federation."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, records, run_cli, run_cli_here

from archipelago.models import build_model, get_model_args
from archipelago.models.lora import LoRALinear, add_lora, merge_lora


def _qwen(vocab: int = 128, seed: int = 0):
    args = get_model_args("qwen3", "debug", vocab_size=vocab)
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return args, model.eval()


def test_adapters_start_as_the_base_model_train_alone_and_merge_exactly():
    _, base = _qwen()
    _, model = _qwen()
    assert add_lora(model, ["wq", "wv"], rank=4, alpha=8.0) == 2 * 6  # two per block, 6 blocks
    tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), base(tokens), rtol=0, atol=0)  # B = 0 at the start
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    with torch.no_grad():  # as if trained
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.normal_(std=0.05)
    plain = merge_lora(model.state_dict(), model)
    assert not any(k.endswith((".lora_a", ".lora_b")) for k in plain)
    base.load_state_dict(plain)
    with torch.no_grad():
        torch.testing.assert_close(base(tokens), model(tokens), rtol=0, atol=1e-5)
        assert not torch.allclose(base(tokens), _qwen()[1](tokens), atol=1e-3)


def test_targets_that_match_nothing_name_the_layers_there_are():
    _, model = _qwen()
    with pytest.raises(ValueError, match="matched no linear layer.*w1, w2, w3, wk, wo, wq, wv"):
        add_lora(model, ["q_proj"], rank=4, alpha=8.0)


def test_a_lora_run_from_hf_weights_trains_only_adapters_and_exports_merged(shakespeare, tmp_path):
    transformers = pytest.importorskip("transformers")
    from archipelago.checkpoint.hf import write_hf
    from archipelago.launch.export import load_run

    args, base = _qwen(vocab=shakespeare.vocab_size, seed=3)
    write_hf(tmp_path / "base", "qwen3", args, base.state_dict())
    lora = ["--model.name", "qwen3", "--lora.rank", "4", "--lora.targets", "wq,wv,w2", "--optimizer.lr", "1e-2",
            "--checkpoint.initial_load_path", str(tmp_path / "base")]
    done = run_cli_here(["train", *TINY, *lora, "--training.steps", "4", "--training.val_every", "0",
                         "--job.run_dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.output[-3000:]
    assert "lora: adapters of rank 4 on 18 layers" in done.output
    _cfg, _task, model, _step = load_run(tmp_path / "run")
    trained = model.state_dict()
    for name, tensor in base.state_dict().items():  # the base weights never moved
        assert torch.equal(trained[name], tensor), name
    assert all(trained[f"{n}.lora_b"].abs().sum() > 0 for n, m in model.named_modules() if isinstance(m, LoRALinear))

    refused = run_cli_here(["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert refused.returncode == 2 and "--merge-lora" in refused.output
    exported = run_cli_here(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--merge-lora"])
    assert exported.returncode == 0, exported.output[-3000:]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model.eval()(tokens), rtol=0, atol=1e-5)


def _bytes_per_round(run_dir) -> int:
    sent = [r["bytes_sent"] for r in records(run_dir / "island-0") if r.get("event") == "outer_step"]
    return max(sent)


@pytest.mark.timeout(400)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_a_lora_federation_agrees_and_sends_only_the_adapters(shakespeare, tmp_path):
    common = ["local", "--islands", "1,1", "--no-table", *TINY, "--model.name", "qwen3", "--training.steps", "8",
              "--fault_tolerance.sync_steps", "4", "--training.val_every", "0", "--checkpoint.interval", "4"]
    runs = {}
    for name, extra in (("full", []), ("lora", ["--lora.rank", "4"])):
        runs[name] = tmp_path / name
        done = run_cli([*common, *extra, "--job.run_dir", str(runs[name])], timeout=180)
        assert done.returncode == 0, done.output[-3000:]
        fed = json.loads((runs[name] / "federation.json").read_text())
        assert fed["global_hash_agree"], fed["islands"]
    args = get_model_args("qwen3", "debug", vocab_size=shakespeare.vocab_size)
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    # Rank 4 on wq, wk, wv, wo of 6 blocks: rank x (inputs + outputs) each.
    adapters = 6 * 4 * ((args.dim + q) + 2 * (args.dim + kv) + (q + args.dim))
    full, lora = _bytes_per_round(runs["full"]), _bytes_per_round(runs["lora"])
    # Bytes per outer step fall by the ratio of adapter to model size (4 bytes per value, plus framing).
    assert lora / full == pytest.approx(adapters / args.num_params(), rel=0.05), (lora, full)
