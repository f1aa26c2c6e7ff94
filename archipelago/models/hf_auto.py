"""The `hf` family: any dense transformers causal LM, built from a directory's config.json.

`--model.name hf --model.flavor DIR` trains the architecture DIR/config.json describes
(`transformers.AutoModelForCausalLM.from_config`, random weights; `--checkpoint.initial_load_path
DIR` loads its safetensors), so architectures this package has not written still train on
an island and across islands. The flavor may also name a transformers model type with
its default shape and optional overrides (`gpt2`, `mistral:num_hidden_layers=2,hidden_size=256`).
transformers is needed for this family only:
`pip install archipelago[hf]`. Nothing is downloaded: the directory must be local.

Limits: parallelism is FSDP per decoder layer (the model's longest ModuleList); no expert
parallelism, KV-cache generation, LoRA targets by our names or export (the weights are
transformers' already: `save_pretrained` on `model.hf` writes them); FLOPs per token are
counted as 6 x the non-embedding parameters (attention's share is not added).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .registry import BUILDERS, register_family


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # the family is an extra
        raise ValueError("the hf family needs transformers: pip install 'archipelago[hf]'") from exc
    return transformers


@dataclass
class HFAutoArgs:
    """A transformers architecture from a local directory holding its config.json."""

    source: str = ""
    vocab_size: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    @classmethod
    def from_flavor(cls, flavor: str) -> HFAutoArgs:
        """A local directory holding a config.json, or `model_type[:key=value,...]`."""
        folder = Path(flavor).expanduser()
        if folder.is_dir():
            path = folder / "config.json"
            if not path.is_file():
                raise ValueError(f"hf flavor {flavor!r}: no config.json in that directory (the flavor of the hf "
                                 "family is a directory holding a transformers config.json, or a model type)")
            config = json.loads(path.read_text())
            source = str(folder)
        else:
            config = _config_by_name(flavor).to_dict()
            source = flavor
        return cls(source=source, vocab_size=int(config["vocab_size"]), config=config,
                   max_seq_len=int(config.get("max_position_embeddings", config.get("n_positions", 2048))),
                   tie_embeddings=bool(config.get("tie_word_embeddings", True)))

    def hf_config(self) -> Any:
        if Path(self.source).expanduser().is_dir():
            return _transformers().AutoConfig.from_pretrained(self.source, local_files_only=True)
        return _config_by_name(self.source)

    def _meta_counts(self) -> tuple[int, int]:
        with torch.device("meta"):
            model = _transformers().AutoModelForCausalLM.from_config(self.hf_config())
        total = sum(p.numel() for p in model.parameters())
        return total, total - model.get_input_embeddings().weight.numel()

    def num_params(self) -> int:
        return self._meta_counts()[0]

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self._meta_counts()[1]


def _value(text: str) -> Any:
    """An override's value: an int, a float, true/false, or the text itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def _config_by_name(flavor: str) -> Any:
    """transformers' default config of a model type, with `key=value` overrides after a colon."""
    name, _, overrides = flavor.partition(":")
    values = {}
    for item in filter(None, (part.strip() for part in overrides.split(","))):
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"hf flavor {flavor!r}: override {item!r} is not key=value")
        values[key.strip()] = _value(text)
    try:
        config = _transformers().AutoConfig.for_model(name.strip(), **values)
    except ValueError as exc:
        raise ValueError(f"hf flavor {flavor!r} is neither a directory with a config.json nor a transformers "
                         f"model type (gpt2, llama, mistral, ...): {str(exc)[:120]}...") from exc
    known = type(config)().to_dict()  # for_model keeps unknown keys as attributes: compare with the defaults
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ValueError(f"hf flavor {flavor!r}: {type(config).__name__} has no field {', '.join(unknown)}")
    return config


class HFCausalLM(nn.Module):
    """A transformers causal LM behind our model interface: tokens -> logits."""

    def __init__(self, args: HFAutoArgs) -> None:
        super().__init__()
        self.args = args
        self.hf = _transformers().AutoModelForCausalLM.from_config(args.hf_config())

    def parallel_blocks(self) -> list[tuple[nn.Module, str]]:
        """The decoder layers, for parallelize: the children of the longest ModuleList."""
        lists = [m for m in self.hf.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            raise ValueError(f"{type(self.hf).__name__}: no list of decoder layers found")
        layers = max(lists, key=len)
        return [(layers, str(i)) for i in range(len(layers))]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """transformers' own initialisation of every module, from `seed`."""
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.hf.apply(self.hf._init_weights)
            self.hf.tie_weights()


class _Directories(dict):
    """The hf family's flavors: any local directory with a config.json, or a model type (made on lookup)."""

    def __contains__(self, flavor: object) -> bool:
        return isinstance(flavor, str)  # __getitem__ says what is wrong with a directory

    def __getitem__(self, flavor: str) -> HFAutoArgs:
        return HFAutoArgs.from_flavor(flavor)


FLAVORS: dict[str, Any] = _Directories()

register_family("hf", FLAVORS)
BUILDERS[HFAutoArgs] = HFCausalLM  # build_model finds the builder by the args' type
