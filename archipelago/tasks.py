"""What an island learns: next-token prediction on text, or image classification.

The trainer asks its task (`Trainer.build_task`) for everything that depends on the kind
of data: preparing it, the model, the training and held-out batches, the loss and the
metrics beside it. Parallelism, the optimizer, the federation, checkpoints and the metrics
log are the same for every task.

The unit of work is a *token*: what `tokens`, `tokens_per_s`, MFU and the federation's
token weighting count. For text it is a token of a training sequence; for images, one
image (`Task.tokens_per_sample` is `seq_len` or 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from archipelago.checkpoint.hf import HFMismatch, read_hf_tensors, read_hf_weights
from archipelago.config import Config, ConfigError
from archipelago.data import (
    ImageBatchLoader,
    PreparedDataset,
    TokenSequenceLoader,
    prepare_from_config,
    prepare_images_from_config,
    validation_batches,
    validation_image_batches,
)
from archipelago.models import (
    DEFAULT_VOCAB_SIZE,
    ModelArgs,
    build_model,
    family_kind,
    get_image_model_args,
    get_model_args,
)
from archipelago.models.lora import add_lora, reset_adapters
from archipelago.models.resnet import build_resnet

# Models above this size are built on the meta device and initialised shard by shard;
# smaller ones are initialised whole on CPU first, which makes the initial weights
# independent of the rank count (what the 1-rank vs 2-rank equivalence relies on).
META_INIT_MIN_PARAMS = 1_000_000_000

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def validation_batch_size(batch_size: int, world_size: int) -> int:
    """Held-out batches split evenly over the ranks, whatever their training shares: the
    batch size rounded down to a multiple of the rank count (at least one per rank)."""
    return max(world_size, batch_size - batch_size % world_size)


@dataclass(frozen=True)
class TaskModel:
    """A model for one device, before parallelism: initialised on CPU, or on the meta
    device (parallelize materialises it shard by shard)."""

    module: nn.Module
    num_params: int
    flops_per_token: float  # training FLOPs per token (text) or image, for MFU
    description: str        # for the log line


class Task(ABC):
    """One kind of learning; see the module docstring."""

    unit = "tok"  # what a token is, in the progress display ("tok/s")

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log: Callable[[str], None] = lambda _message: None  # prepare() sets the run's

    @abstractmethod
    def prepare(self, log: Callable[[str], None]) -> None:
        """Fetch and cache the data (every rank calls it; a lock lets one do the work)."""

    @abstractmethod
    def build_model(self) -> TaskModel: ...

    @property
    @abstractmethod
    def tokens_per_sample(self) -> int: ...

    @abstractmethod
    def train_loader(self, rank: int, world_size: int, island: int, num_islands: int,
                     log: Callable[[str], None], shares: list[int] | None = None) -> Any:
        """A resumable loader: next_batch() -> (inputs, targets), state_dict, load_state_dict.
        `shares`: samples per rank when ranks take unequal shares of the batch."""

    @abstractmethod
    def validation_batches(self, rank: int, world_size: int) -> Batches: ...

    @abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean training loss of a batch."""

    def initial_weights(self, folder: str) -> dict[str, torch.Tensor]:
        """The full state dict of the model from a pretrained model directory (checkpoint.initial_load_path)."""
        raise ConfigError(f"checkpoint.initial_load_path: {self.cfg.model.name} cannot start from a Hugging Face "
                          "directory (language models only: llama3, qwen3, gpt_oss)")

    def step_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
        """Per-batch values logged beside the loss (on the device; no host sync)."""
        return {}

    def auxiliary_loss(self, model: nn.Module) -> torch.Tensor | None:
        """A loss the model itself adds to the task's (a mixture of experts' balancing loss)."""
        return None

    @abstractmethod
    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """float64 sums over a held-out batch: [loss, count, ...]; summed over batches and ranks."""

    @abstractmethod
    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """The validation metrics from the summed `eval_sums`: `val_loss` first."""


class LanguageModelling(Task):
    """Next-token prediction on a tokenized text corpus (llama3, qwen3, gpt_oss)."""

    dataset: PreparedDataset
    args: ModelArgs  # set by build_model

    def prepare(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.dataset = prepare_from_config(self.cfg.data, self.cfg.training.seed, log=log)

    def build_model(self) -> TaskModel:
        m, t = self.cfg.model, self.cfg.training
        try:
            args = get_model_args(m.name, m.flavor, vocab_size=self.dataset.vocab_size)
        except ValueError as exc:  # e.g. a tokenizer larger than the flavor's vocabulary
            raise ConfigError(f"model: {exc}") from exc
        if args.max_seq_len < self.cfg.data.seq_len:
            raise ConfigError(f"data.seq_len = {self.cfg.data.seq_len} exceeds the model's max_seq_len "
                              f"({args.max_seq_len}); lower --data.seq_len")
        self.args = args
        model = build_model(args, device="meta")
        if args.num_params() < META_INIT_MIN_PARAMS:
            model.to_empty(device="cpu")
            model.init_weights(seed=t.seed)
        if self.cfg.lora.rank:
            self._add_lora(model)
        return TaskModel(model, args.num_params(), args.flops_per_token(self.cfg.data.seq_len),
                         f"{m.name}/{m.flavor}")

    def _add_lora(self, model: nn.Module) -> None:
        lora = self.cfg.lora
        if any(p.is_meta for p in model.parameters()):
            raise ConfigError("lora: models initialised on the meta device (1B parameters or more) cannot take "
                              "adapters yet; use a smaller flavor or lora.rank = 0")
        try:
            count = add_lora(model, [t.strip() for t in lora.targets.split(",") if t.strip()], lora.rank,
                             lora.alpha, lora.dropout)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        reset_adapters(model, self.cfg.training.seed)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        self.log(f"lora: adapters of rank {lora.rank} on {count} layers: {trainable:,} of {total:,} parameters "
                 f"trained ({100 * trainable / total:.2f}%)")

    @property
    def tokens_per_sample(self) -> int:
        return self.cfg.data.seq_len

    def train_loader(self, rank: int, world_size: int, island: int, num_islands: int,
                     log: Callable[[str], None], shares: list[int] | None = None) -> TokenSequenceLoader:
        d = self.dataset
        return TokenSequenceLoader(d.train_path, self.cfg.data.seq_len, self.cfg.training.batch_size,
                                   rank=rank, world_size=world_size, seed=self.cfg.training.seed,
                                   island=island, num_islands=num_islands, dtype=d.dtype, log=log,
                                   vocab_size=d.vocab_size, shares=shares)

    def validation_batches(self, rank: int, world_size: int) -> Batches:
        t, d = self.cfg.training, self.dataset
        return validation_batches(d.val_path, self.cfg.data.seq_len, validation_batch_size(t.batch_size, world_size),
                                  rank, world_size, t.val_batches, d.dtype, d.vocab_size, t.val_offset)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1).float(), targets.flatten())

    def auxiliary_loss(self, model: nn.Module) -> torch.Tensor | None:
        aux = getattr(model, "aux_loss", None)
        coef = self.cfg.model.aux_loss_coef
        return coef * aux if isinstance(aux, torch.Tensor) and coef else None

    def step_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
        """For a mixture of experts: the balancing loss and the busiest expert's load over
        the mean load (1 = balanced), the worst layer's."""
        expert_load = getattr(model, "expert_load", None)
        if expert_load is None:
            return {}
        load = expert_load().float()
        aux: torch.Tensor = model.aux_loss  # type: ignore[assignment]  # set with expert_load by the forward
        return {"aux_loss": aux.detach(),
                "expert_load_max": (load.max(1).values / load.mean(1)).max()}

    def initial_weights(self, folder: str) -> dict[str, torch.Tensor]:
        try:
            if self.cfg.model.name == "hf":  # transformers' own names, under the wrapper's `hf.`
                return read_hf_tensors(folder, prefix="hf.")
            return read_hf_weights(folder, self.cfg.model.name, self.args)
        except HFMismatch as exc:
            raise ConfigError(f"checkpoint.initial_load_path = {folder}: {exc}") from exc

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return torch.stack([loss.double(), torch.tensor(targets.numel(), device=loss.device, dtype=torch.float64)])

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        return {"val_loss": float(sums[0] / sums[1]) if sums[1] > 0 else float("nan")}


class ImageClassification(Task):
    """Fashion-MNIST classes from 28x28 gray images (the resnet family)."""

    unit = "img"
    folder: Any  # Path of the IDX files, set by prepare()

    def prepare(self, log: Callable[[str], None]) -> None:
        if self.cfg.lora.rank:
            raise ConfigError("lora: adapters are for the language-model families; set lora.rank = 0")
        self.folder = prepare_images_from_config(self.cfg.data, log=log)

    def build_model(self) -> TaskModel:
        m = self.cfg.model
        try:
            args = get_image_model_args(m.name, m.flavor)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from exc
        if (args.in_channels, args.image_size, args.num_classes) != (1, 28, 10):
            raise ConfigError(f"model: {m.name}/{m.flavor} takes {args.in_channels}-channel {args.image_size}x"
                              f"{args.image_size} images in {args.num_classes} classes; Fashion-MNIST has 1-channel "
                              "28x28 images in 10 classes: use --model.flavor fashion_mnist")
        model = build_resnet(args, device="meta")
        model.to_empty(device="cpu")
        model.init_weights(seed=self.cfg.training.seed)
        return TaskModel(model, model.num_params(), model.flops_per_image(), f"{m.name}/{m.flavor}")

    @property
    def tokens_per_sample(self) -> int:
        return 1

    def train_loader(self, rank: int, world_size: int, island: int, num_islands: int,
                     log: Callable[[str], None], shares: list[int] | None = None) -> ImageBatchLoader:
        return ImageBatchLoader(self.folder, self.cfg.training.batch_size, rank, world_size,
                                self.cfg.training.seed, island, num_islands, log=log, shares=shares)

    def validation_batches(self, rank: int, world_size: int) -> Batches:
        t = self.cfg.training
        return validation_image_batches(self.folder, validation_batch_size(t.batch_size, world_size), rank,
                                        world_size, t.val_batches, t.val_offset)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets)

    def step_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
        return {"accuracy": (outputs.argmax(-1) == targets).float().mean()}

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs.float(), targets, reduction="sum").double()
        correct = (outputs.argmax(-1) == targets).sum().double()
        return torch.stack([loss, torch.full_like(loss, targets.numel()), correct])

    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        if sums[1] <= 0:
            return {"val_loss": float("nan"), "val_accuracy": float("nan")}
        return {"val_loss": float(sums[0] / sums[1]), "val_accuracy": float(sums[2] / sums[1])}


def check_task(cfg: Config) -> None:
    """The model family and `data.dataset` belong together (ConfigError naming the fix)."""
    try:
        kind = family_kind(cfg.model.name)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from exc
    if kind == "image" and cfg.data.dataset != "fashion_mnist":
        raise ConfigError(f"model: {cfg.model.name} classifies images; add --data.dataset fashion_mnist "
                          "(or use configs/resnet/fashion_mnist.toml)")
    if kind == "language" and cfg.data.dataset != "text":
        raise ConfigError(f"data.dataset = {cfg.data.dataset!r} holds images; {cfg.model.name} is a language "
                          "model: use --model.name resnet --model.flavor fashion_mnist, or --data.dataset text")


def check_model(cfg: Config) -> None:
    """The family, the flavor and the dataset fit together; checked before any process
    starts (ConfigError naming the fix)."""
    check_task(cfg)
    m = cfg.model
    try:
        if family_kind(m.name) == "image":
            get_image_model_args(m.name, m.flavor)
        else:
            get_model_args(m.name, m.flavor, vocab_size=DEFAULT_VOCAB_SIZE)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from exc


def build_task(cfg: Config) -> Task:
    """The task `cfg` describes: image classification for an image family, else language modelling."""
    check_task(cfg)
    return ImageClassification(cfg) if cfg.data.dataset == "fashion_mnist" else LanguageModelling(cfg)
