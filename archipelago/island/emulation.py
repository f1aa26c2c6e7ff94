"""Emulated slow ranks (`island.rank_slowdown`): one machine plays an island of unlike devices.

A slower device is slower in every kernel, so the emulation slows every *unit* of the
model (each transformer block, the embedding, the final norm and the output head; a
ResNet's stem, stages and head) by the same factor: after a unit's forward the rank waits
(slowdown - 1) x the time the forward took, and when the unit's backward begins it waits
(slowdown - 1) x twice that (a backward costs about two forwards). Waiting unit by unit
matters wherever ranks meet inside the step: FSDP gathers and reduces every block, a
pipeline hands activations on per micro-batch. One wait for the whole step (what this did
before) made a rank that the planner gave half the work wait all at once, while the other
rank stood at the next block's collective, and the pair ran at 0.64 of ideal although the
work was balanced.

Forward time is measured in this thread's CPU time on a CPU (it stands still while a
collective waits for other ranks, so a rank waits for its own compute only) and with the
wall clock after a device sync on a GPU (a CPU-GPU sync point per unit: emulation only).
The time slept is counted (`slept_s`), so metrics can count it as the rank's busy time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from archipelago.island.profile import BACKWARD_PER_FORWARD  # the planner's estimate: the same ratio


def slowdown_units(model: nn.Module) -> list[nn.Module]:
    """The modules that are slowed one by one: each member of the model's block lists
    (`layers`) and every other direct child (embedding, norm, output head)."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units.extend(child.children() if isinstance(child, nn.ModuleList) else child.values())
        else:
            units.append(child)
    return units


def _first_tensor_needing_grad(output: object) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_tensor_needing_grad(item)
            if found is not None:
                return found
    return None


class SlowDevice:
    """Hooks that make every unit of a model `slowdown` times slower (see the module doc)."""

    def __init__(self, model: nn.Module, slowdown: float, device: torch.device) -> None:
        if slowdown < 1:
            raise ValueError(f"a slowdown factor is >= 1 (got {slowdown}); 1 is the rank's own speed")
        self.slowdown, self.device = slowdown, device
        self.slept_s = 0.0  # seconds waited so far: busy time of the emulated device
        self.handles: list[RemovableHandle] = []
        if slowdown > 1:
            for unit in slowdown_units(model):
                self._hook(unit)

    def _clock(self) -> float:
        if self.device.type == "cuda":  # a CPU-GPU sync point; only under emulation
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.thread_time()

    def wait(self, seconds: float) -> None:
        """Wait as a slower device would compute for `seconds` more."""
        if seconds > 0:
            time.sleep(seconds)
            self.slept_s += seconds

    def _hook(self, unit: nn.Module) -> None:
        began: list[float] = [0.0]

        def start(*_args: object) -> None:
            began[0] = self._clock()

        def stop(_module: nn.Module, _inputs: object, output: object) -> None:
            forward_s = self._clock() - began[0]
            self.wait((self.slowdown - 1) * forward_s)
            grad_target = _first_tensor_needing_grad(output) if torch.is_grad_enabled() else None
            if grad_target is not None:  # at the start of this unit's backward
                grad_target.register_hook(self._backward_wait((self.slowdown - 1) * BACKWARD_PER_FORWARD * forward_s))

        self.handles.append(unit.register_forward_pre_hook(start))
        self.handles.append(unit.register_forward_hook(stop))

    def _backward_wait(self, seconds: float) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            self.wait(seconds)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
