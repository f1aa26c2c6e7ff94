"""`archipelago generate SOURCE --prompt TEXT`: text from a run's checkpoint or a Hugging Face directory.

SOURCE is a run directory (its newest checkpoint and its tokenizer) or a Hugging Face model
directory (config.json, safetensors, tokenizer.json); the model runs on one device with a
KV cache (models/generation.py) and the text streams to the terminal as it is chosen.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from archipelago.config import ConfigError

HELP = """\
Generate text from SOURCE: a run directory (the newest checkpoint; for a federation, one
island's directory such as RUN_DIR/island-0) or a Hugging Face model directory (llama,
qwen3 or gpt_oss config.json, *.safetensors, tokenizer.json). Greedy with --greedy (or
--temperature 0), else sampling at --temperature from the smallest set of tokens whose
probability reaches --top-p. Stops at the tokenizer's end-of-text token or after
--max-new-tokens.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="archipelago generate", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", type=Path, help="a run directory or a Hugging Face model directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep tokens up to this probability")
    p.add_argument("--greedy", action="store_true", help="always the most likely token (same as --temperature 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, ...")
    return p


def load_hf_model(folder: Path) -> tuple[Any, Path]:
    """(model on CPU, tokenizer path) from a Hugging Face directory of a llama, qwen3 or gpt_oss model."""
    from archipelago.checkpoint.hf import HF_FAMILIES, args_from_hf_config, read_hf_config, read_hf_weights
    from archipelago.models import ModelArgs, build_model
    from archipelago.models.gpt_oss import GptOssArgs

    config = read_hf_config(folder)
    families = {model_type: family for family, (model_type, _) in HF_FAMILIES.items()}
    family = families.get(str(config.get("model_type")))
    if family is None:
        raise ConfigError(f"{folder}: a {config.get('model_type')!r} model; generate reads "
                          f"{', '.join(families)} Hugging Face directories")
    fields = args_from_hf_config(config, family)
    max_seq_len = int(config.get("max_position_embeddings", 2048))
    args: Any = (GptOssArgs(**fields, max_seq_len=max_seq_len) if family == "gpt_oss" else
                 ModelArgs(**fields, qk_norm=family == "qwen3", max_seq_len=max_seq_len))
    model = build_model(args, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()  # RoPE tables; every parameter is then overwritten
    model.load_state_dict(read_hf_weights(folder, family, args))
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError(f"{folder} holds no tokenizer.json")
    return model, tokenizer


def _load(source: Path) -> tuple[Any, Path]:
    config = source / "config.json"
    if config.is_file() and "model_type" in json.loads(config.read_text()):
        return load_hf_model(source)
    from archipelago.launch.export import load_run

    cfg, task, model, _step = load_run(source)
    if not hasattr(model, "new_caches"):
        raise ConfigError(f"{source}: {cfg.model.name} has no KV cache for generation")
    return model, task.dataset.tokenizer_path


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from archipelago.checkpoint.hf import HFMismatch
    from archipelago.data import eos_id, load_tokenizer
    from archipelago.island.device import detect_device_type
    from archipelago.models.generation import generate

    try:
        model, tokenizer_path = _load(args.source)
    except (ConfigError, HFMismatch) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = model.to(detect_device_type(args.device)).eval()
    tokenizer = load_tokenizer(tokenizer_path)
    prompt = tokenizer.encode(args.prompt).ids
    temperature = 0.0 if args.greedy else args.temperature
    chosen: list[int] = []
    shown = ""

    def stream(token: int) -> None:  # decode the whole suffix: a token may be part of a character
        nonlocal shown
        chosen.append(token)
        text = tokenizer.decode(chosen)
        print(text[len(shown):], end="", flush=True)
        shown = text

    print(args.prompt, end="", flush=True)
    try:
        generate(model, prompt, args.max_new_tokens, temperature, args.top_p, eos_id(tokenizer), args.seed, stream)
    except ValueError as exc:  # an empty or too long prompt, a bad top_p
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    print()
    return 0
