"""The `hf` family: a transformers architecture we have not written (GPT-2) trains on an island and across islands."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, losses, run_cli, run_cli_here

transformers = pytest.importorskip("transformers")


@pytest.fixture
def gpt2_dir(tmp_path):
    config = transformers.GPT2Config(vocab_size=4096, n_positions=128, n_embd=128, n_layer=3, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    config.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def test_gpt2_from_a_config_directory_learns_and_starts_from_its_weights(shakespeare, gpt2_dir, tmp_path):
    hf = ["--model.name", "hf", "--model.flavor", str(gpt2_dir), "--optimizer.lr", "3e-3"]
    done = run_cli_here(["train", *TINY, *hf, "--training.steps", "30", "--training.val_every", "0",
                         "--metrics.log_every", "1", "--checkpoint.no_enable", "--job.run_dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.output[-3000:]
    curve = losses(tmp_path / "run")
    assert curve[30] < curve[1] - 1.5, curve  # ln(4096) = 8.3 at the start
    # transformers' own save of a model loads as the run's starting weights.
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    saved = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(gpt2_dir))
    saved.save_pretrained(tmp_path / "weights")
    started = run_cli_here(["train", *TINY, *hf, "--training.steps", "3", "--training.val_every", "3",
                            "--checkpoint.initial_load_path", str(tmp_path / "weights"),
                            "--job.run_dir", str(tmp_path / "started")])
    assert started.returncode == 0 and "started from the weights in" in started.output, started.output[-3000:]


@pytest.mark.timeout(400)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_a_federation_of_two_and_one_ranks_trains_gpt2(shakespeare, gpt2_dir, tmp_path):
    run = tmp_path / "federation"
    done = run_cli(["local", "--islands", "2,1", "--no-table", *TINY, "--model.name", "hf", "--model.flavor",
                    str(gpt2_dir), "--training.steps", "8", "--fault_tolerance.sync_steps", "4",
                    "--training.val_every", "0", "--checkpoint.interval", "4", "--job.run_dir", str(run)], timeout=380)
    assert done.returncode == 0, done.output[-4000:]
    fed = json.loads((run / "federation.json").read_text())
    assert fed["global_hash_agree"], fed["islands"]
    assert [o["participants"] for o in fed["outer_steps"]] == [2, 2, 2]


def test_a_model_type_with_overrides_builds_transformers_model_of_that_shape():
    from archipelago.models import build_model, get_model_args

    args = get_model_args("hf", "gpt2:n_layer=2,n_embd=64,n_head=4,tie_word_embeddings=false", vocab_size=512)
    ours = build_model(args, device="meta")
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                                     tie_word_embeddings=False))
    assert {n: tuple(p.shape) for n, p in ours.hf.named_parameters()} == \
        {n: tuple(p.shape) for n, p in reference.named_parameters()}
    assert args.num_params() == sum(p.numel() for p in reference.parameters())
    with pytest.raises(ValueError, match="no field n_layers"):
        get_model_args("hf", "gpt2:n_layers=2", vocab_size=512)
    with pytest.raises(ValueError, match="neither a directory"):
        get_model_args("hf", "no_such_model_type", vocab_size=512)
