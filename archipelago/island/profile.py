"""Measure one rank for the planner: time per sample, per layer, and memory.

Each rank runs the whole model on its own device (no collectives while timing, so a slow
rank does not slow the others' measurements): a warm-up step, then `repeats` timed forward
and backward passes of one micro-batch, taking the median. Per-layer times come from
forward hooks on the model's blocks (the backward of a block is taken as twice its forward,
the usual ratio for matmul-bound layers); the embedding before the first block and the
norm, output and loss after the last are measured the same way. An emulated slow rank
(`island.rank_slowdown`) has its times multiplied by its factor, as training slows it.

On a GPU every timing point synchronises the device (a CPU-GPU sync point per block:
profiling only, never while training), and peak memory is read from the allocator; on a CPU
memory is not limited by the planner.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

BACKWARD_PER_FORWARD = 2.0  # a block's backward costs about twice its forward (two matmuls per one)
ADAM_BYTES_PER_PARAM = 16   # fp32 weight, gradient and AdamW's two moments


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured (times in seconds per sample, forward and backward)."""

    rank: int
    device: str                   # "cpu" or the GPU's name
    sample_s: float               # the whole model, as a data-parallel rank runs it
    layer_s: tuple[float, ...]    # each block
    first_s: float                # before the first block (embedding)
    last_s: float                 # after the last block (norm, output, loss)
    memory_bytes: float           # what the device can hold (inf on CPU)
    layer_bytes: tuple[float, ...]  # each block's weights, gradients and optimizer state
    activation_bytes: float       # peak activation memory per sample (0 where not measurable)
    micro_batch: int              # the micro-batch size measured
    # (micro-batch size, seconds per sample) at the sizes measured for the planner's choice
    # of micro-batch (measure_sizes), by size; empty where only `micro_batch` was timed.
    sample_s_by_size: tuple[tuple[int, float], ...] = ()

    def max_micro_batch(self, model_bytes: float) -> int:
        """The largest micro-batch whose activations fit beside the whole model (0 = no limit)."""
        if math.isinf(self.memory_bytes) or self.activation_bytes <= 0:
            return 0
        return max(0, int((self.memory_bytes - model_bytes) // self.activation_bytes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return math.inf


class _BlockClock:
    """Forward timestamps around each block, from hooks (read after a forward)."""

    def __init__(self, blocks: list[nn.Module], device: torch.device) -> None:
        self.device = device
        self.starts: list[float] = [0.0] * len(blocks)
        self.ends: list[float] = [0.0] * len(blocks)
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._mark(self.starts, i)))
            self.handles.append(block.register_forward_hook(self._mark(self.ends, i)))

    def _mark(self, into: list[float], i: int) -> Callable[..., None]:
        def hook(*_args: object) -> None:
            _sync(self.device)
            into[i] = time.perf_counter()
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def profile_rank(model: nn.Module, blocks: list[nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rank: int, device: torch.device,
                 slowdown: float = 1.0, repeats: int = 3) -> RankProfile:
    """Time `model` (whole, on `device`) on `batch`; see the module docstring."""
    inputs, targets = (t.to(device) for t in batch)
    n = len(inputs)
    clock = _BlockClock(blocks, device)
    whole, layers, first, last = [], [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        for i in range(repeats + 1):  # the first is a warm-up (allocations, kernel selection)
            _sync(device)
            began = time.perf_counter()
            loss = loss_fn(model(inputs), targets)
            _sync(device)
            forward_end = time.perf_counter()
            loss.backward()
            _sync(device)
            ended = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i:
                whole.append(ended - began)
                layers.append([e - s for s, e in zip(clock.starts, clock.ends)])
                first.append(clock.starts[0] - began)
                last.append(forward_end - clock.ends[-1])
    finally:
        clock.remove()
    scale = slowdown * (1 + BACKWARD_PER_FORWARD) / n
    activation = (torch.cuda.max_memory_allocated(device) - base_bytes) / n if device.type == "cuda" else 0.0
    return RankProfile(
        rank=rank, device=_device_name(device), sample_s=slowdown * statistics.median(whole) / n,
        layer_s=tuple(statistics.median(col) * scale for col in zip(*layers)),
        first_s=statistics.median(first) * scale, last_s=statistics.median(last) * scale,
        memory_bytes=_memory(device),
        layer_bytes=tuple(float(ADAM_BYTES_PER_PARAM * sum(p.numel() for p in b.parameters())) for b in blocks),
        activation_bytes=float(activation), micro_batch=n)


def candidate_sizes(share: int, cap: int = 0) -> tuple[int, ...]:
    """The micro-batch sizes to time for a rank whose even share is `share` samples: 1, a
    quarter, a half and the whole share (at most `cap` where memory limits it, 0 = none).
    Shares above the largest are costed at its time per sample (planner)."""
    sizes = {1, max(1, share // 4), max(1, share // 2), share}
    return tuple(sorted(size for size in sizes if cap <= 0 or size <= cap))


def measure_sizes(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                  sizes: tuple[int, ...], slowdown: float = 1.0, repeats: int = 2) -> tuple[tuple[int, float], ...]:
    """Seconds per sample of a forward and backward of the whole model at each micro-batch
    size (the first `size` samples of `batch`), the median of `repeats` after a warm-up, times
    the emulated slowdown. The model is warm already (profile_rank ran), so one warm-up per
    size is enough to settle its allocations."""
    inputs, targets = (t.to(device) for t in batch)
    out = []
    for size in sizes:
        seconds = []
        for i in range(repeats + 1):
            _sync(device)
            began = time.perf_counter()
            loss_fn(model(inputs[:size]), targets[:size]).backward()
            _sync(device)
            if i:
                seconds.append(time.perf_counter() - began)
            model.zero_grad(set_to_none=True)
        out.append((size, slowdown * statistics.median(seconds) / size))
    return tuple(out)
