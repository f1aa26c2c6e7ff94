"""Hugging Face directories in and out, checked against transformers itself.

transformers is a test dependency only (pinned in the dev extra); the package writes and
reads the files without it. Models are the debug flavors with random weights: what is
compared is the mapping (names, config fields, RoPE, tied embeddings), not training.
"""

from __future__ import annotations

import json

import pytest
import torch

from archipelago.checkpoint.hf import HFMismatch, hf_names, read_hf_weights, write_hf
from archipelago.models import build_model, get_model_args

transformers = pytest.importorskip("transformers")

VOCAB = 512


def _ours(family: str, seed: int = 0):
    args = get_model_args(family, "debug", vocab_size=VOCAB)
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return args, model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_our_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    args, model = _ours(family)
    out = write_hf(tmp_path / "hf", family, args, model.state_dict(), eos_token_id=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert type(theirs).__name__ == expected
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=0, atol=1e-5)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_transformers_model_imports_with_the_same_logits(family, tmp_path):
    args, model = _ours(family)
    config_class = {"llama3": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    config = config_class(vocab_size=VOCAB, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                          num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                          num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
                          rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings,
                          rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    torch.manual_seed(1)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    # A sharded save (with an index file), as large downloads come.
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="1MB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model.load_state_dict(read_hf_weights(tmp_path / "hf", family, args))  # strict: every key
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


def test_llama31_rope_scaling_round_trips_through_transformers(tmp_path):
    from archipelago.models.args import RopeScaling

    args, model = _ours("llama3")
    args.rope_scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
    model.args = args
    model.init_weights(seed=0)  # recomputes the RoPE tables with the scaling
    out = write_hf(tmp_path / "hf", "llama3", args, model.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=0, atol=1e-4)
    assert read_hf_weights(out, "llama3", args).keys() == set(hf_names(args)) == set(model.state_dict())


def test_a_directory_of_another_shape_is_refused_naming_the_fields(tmp_path):
    args, model = _ours("qwen3")
    write_hf(tmp_path / "hf", "qwen3", args, model.state_dict())
    other = get_model_args("qwen3", "debug", vocab_size=VOCAB * 2)
    with pytest.raises(HFMismatch, match=r"vocab_size: 512 in config.json, 1024 in the flavor"):
        read_hf_weights(tmp_path / "hf", "qwen3", other)
    with pytest.raises(HFMismatch, match="'qwen3' model, not 'llama'"):
        read_hf_weights(tmp_path / "hf", "llama3", get_model_args("llama3", "debug", vocab_size=VOCAB))
    with pytest.raises(HFMismatch, match="no config.json"):
        read_hf_weights(tmp_path, "qwen3", args)


def test_a_trained_run_exports_and_a_new_run_starts_from_the_export(shakespeare, tmp_path):
    from conftest import TINY, records, run_cli_here

    tiny = [*TINY, "--model.name", "qwen3", "--training.val_every", "3", "--training.steps", "3"]
    first = run_cli_here(["train", *tiny, "--job.run_dir", str(tmp_path / "first")])
    assert first.returncode == 0, first.output[-3000:]
    exported = run_cli_here(["export", str(tmp_path / "first"), str(tmp_path / "hf"), "--format", "hf"])
    assert exported.returncode == 0, exported.output[-3000:]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert theirs.config.eos_token_id == shakespeare_eos(shakespeare)
    # Text from the run directory (its checkpoint) and from the export: the same weights, the same words.
    texts = []
    for source in (tmp_path / "first", tmp_path / "hf"):
        said = run_cli_here(["generate", str(source), "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "8"])
        assert said.returncode == 0 and said.output.startswith("ROMEO:"), said.output[-2000:]
        texts.append(said.output)
    assert texts[0] == texts[1] and len(texts[0]) > len("ROMEO:\n")

    second = run_cli_here(["train", *tiny, "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                           "--job.run_dir", str(tmp_path / "second")])
    assert second.returncode == 0, second.output[-3000:]
    trained = [r["val_loss"] for r in records(tmp_path / "first") if "val_loss" in r]
    started = [r["val_loss"] for r in records(tmp_path / "second") if "val_loss" in r]
    # The second run's evaluation before its first step is the first run's last one: same weights.
    assert started[0] == pytest.approx(trained[-1], abs=1e-6) and started[0] < trained[0] - 0.5
    assert any(r.get("event") == "initial_load" for r in records(tmp_path / "second"))

    mismatch = run_cli_here(["train", *TINY, "--training.steps", "3", "--checkpoint.initial_load_path",
                             str(tmp_path / "hf"), "--job.run_dir", str(tmp_path / "third")])
    assert mismatch.returncode == 2 and "'qwen3' model, not 'llama'" in mismatch.output


def shakespeare_eos(dataset) -> int:
    from archipelago.data import eos_id, load_tokenizer

    return eos_id(load_tokenizer(dataset.tokenizer_path))


def test_export_of_an_image_model_or_a_federation_directory_says_what_to_do(tmp_path):
    from conftest import run_cli_here

    (tmp_path / "fed" / "island-0").mkdir(parents=True)
    (tmp_path / "fed" / "island-0" / "config.json").write_text("{}")
    done = run_cli_here(["export", str(tmp_path / "fed"), str(tmp_path / "out")])
    assert done.returncode == 2 and "island-0" in done.output


@pytest.mark.parametrize("family,flavor", [("llama3", "1B"), ("llama3", "8B"), ("llama3", "70B"), ("qwen3", "0.6B"),
                                           ("qwen3", "1.7B"), ("qwen3", "8B")])
def test_published_shapes_have_transformers_parameter_counts(family, flavor):
    from archipelago.checkpoint.hf import hf_config

    args = get_model_args(family, flavor)
    config = transformers.AutoConfig.for_model(**hf_config(family, args))
    with torch.device("meta"):  # shapes only
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in theirs.parameters()) == args.num_params()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_generation_equals_transformers_generate(family, tmp_path):
    from archipelago.models.generation import generate

    args, model = _ours(family)
    with torch.no_grad():  # livelier than the initial weights, whose greedy text repeats one token
        generator = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        write_hf(tmp_path / "hf", family, args, model.state_dict()), dtype=torch.float32).eval()
    prompt = [3, 17, 101, 7, 250]
    ours = generate(model, prompt, 20)
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert ours == want and len(set(ours)) > 3, (ours, want)
