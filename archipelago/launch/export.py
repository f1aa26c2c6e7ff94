"""`archipelago export RUN_DIR OUT --format hf`: a run's newest checkpoint as a Hugging Face directory.

The run's own config.json says which model to build; the newest usable checkpoint of the
run (its manifest checked, and its signature when the run has a federation key) fills it;
checkpoint/hf.py writes it under transformers' names with its config, generation config
and the run's tokenizer, so `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads
it with the same outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from archipelago.config import ConfigError, load_run_config

HELP = """\
Write the newest checkpoint of RUN_DIR as a Hugging Face model directory OUT: config.json,
model.safetensors (shards with an index above --max-shard-gb), generation_config.json and
the run's tokenizer.json. Language models (llama3, qwen3, gpt_oss) only. For a federation, export one
island's directory (RUN_DIR/island-0): after the last outer step every island holds the same
global weights.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="archipelago export", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (holds config.json)")
    p.add_argument("out", metavar="OUT", type=Path, help="the directory to write (created)")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers model directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the written weights (training keeps fp32 weights; bfloat16 halves the size)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file before sharding")
    p.add_argument("--merge-lora", action="store_true",
                   help="a run with LoRA adapters: fold them into the weights (W + alpha/rank B A) and write a "
                        "plain model")
    return p


def _run_config(run_dir: Path):  # noqa: ANN202 - a Config
    path = run_dir / "config.json"
    if not path.is_file():
        islands = sorted(p.name for p in run_dir.glob("island-*") if (p / "config.json").is_file())
        hint = f"; a federation run: export one island, e.g. {run_dir / islands[0]}" if islands else ""
        raise ConfigError(f"{run_dir} holds no config.json: not a run directory{hint}")
    return load_run_config(path)


def load_run(run_dir: Path) -> tuple[Any, Any, Any, int]:
    """(config, task, model on CPU, step) of RUN_DIR's newest usable checkpoint of a language
    model with a Hugging Face mapping (ConfigError naming the problem otherwise)."""
    from archipelago.checkpoint import CheckpointManager, ModelOptimizerState
    from archipelago.checkpoint.hf import HF_FAMILIES
    from archipelago.federation.trust import load_key
    from archipelago.tasks import LanguageModelling, build_task

    cfg = _run_config(run_dir)
    task = build_task(cfg)
    if not isinstance(task, LanguageModelling) or cfg.model.name not in HF_FAMILIES:
        raise ConfigError(f"{cfg.model.name} is not a language model with a Hugging Face mapping "
                          "(llama3, qwen3, gpt_oss)")
    task.prepare(lambda _m: None)  # the run's tokenizer (cached)
    model = task.build_model().module
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    c = cfg.checkpoint
    folder = Path(c.folder) if Path(c.folder).is_absolute() else run_dir / c.folder
    key = load_key(cfg.federation_security.key_file)
    manager = CheckpointManager(folder, keep=0, rank=0, world_size=1, verify=c.verify or key is not None,
                                accept_unsigned=c.accept_unsigned)
    step = manager.load_latest({"train": ModelOptimizerState(model)})
    if step is None:
        raise ConfigError(f"{folder}: no usable checkpoint (train with checkpoint.enable)")
    return cfg, task, model, step


def export_hf(run_dir: Path, out: Path, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
              merge_lora: bool = False) -> int:
    """Write RUN_DIR's newest checkpoint to OUT; returns the step it came from."""
    from archipelago.checkpoint.hf import write_hf
    from archipelago.data import eos_id, load_tokenizer
    from archipelago.models.lora import merge_lora as merged

    cfg, task, model, step = load_run(run_dir)
    state = model.state_dict()
    if cfg.lora.rank:
        if not merge_lora:
            raise ConfigError(f"{run_dir} trained LoRA adapters: add --merge-lora to fold them into the weights")
        state = merged(state, model)
    tokenizer = task.dataset.tokenizer_path
    write_hf(out, cfg.model.name, task.args, state, dtype, tokenizer=tokenizer,
             eos_token_id=eos_id(load_tokenizer(tokenizer)), max_shard_bytes=max_shard_bytes)
    return step


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        step = export_hf(args.run_dir, args.out, args.dtype, int(args.max_shard_gb * 2**30), args.merge_lora)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (step {step} of {args.run_dir}, {args.dtype}): "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(args.out)!r}) loads it")
    return 0
