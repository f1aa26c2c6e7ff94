"""island.rank_slowdown's emulation: every unit waits after its forward and before its backward."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from archipelago.island.emulation import SlowDevice, slowdown_units


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _slow(model: nn.Module, factor: float, monkeypatch: pytest.MonkeyPatch) -> tuple[SlowDevice, list]:
    """A SlowDevice whose clock ticks 1 s per reading and whose waits are recorded, not slept."""
    device = SlowDevice(model, factor, torch.device("cpu"))
    ticks = itertools.count()
    waits: list[tuple[str, float]] = []
    monkeypatch.setattr(device, "_clock", lambda: float(next(ticks)))
    monkeypatch.setattr(device, "wait", lambda s: waits.append(("grad" if _in_backward[0] else "fwd", s)))
    return device, waits


_in_backward = [False]  # set around backward() by the test


def test_units_are_the_blocks_and_the_other_children():
    model = _Blocks()
    assert slowdown_units(model) == [model.embed, model.layers[0], model.layers[1], model.head]


def test_each_unit_waits_after_its_forward_and_twice_that_at_its_backward(monkeypatch):
    torch.manual_seed(0)
    model, reference = _Blocks(), _Blocks()
    reference.load_state_dict(model.state_dict())
    device, waits = _slow(model, 3.0, monkeypatch)
    x = torch.randn(5, 4)
    out = model(x)
    # Each unit's forward reads the clock twice, 1 s apart: it waits (3 - 1) x 1 s.
    assert waits == [("fwd", 2.0)] * 4
    _in_backward[0] = True
    try:
        out.sum().backward()
    finally:
        _in_backward[0] = False
    # Then one wait per unit at the start of its backward: (3 - 1) x 2 x 1 s.
    assert waits[4:] == [("grad", 4.0)] * 4
    # The hooks change nothing the model computes.
    ref_out = reference(x)
    ref_out.sum().backward()
    assert torch.equal(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_evaluation_waits_for_the_forward_only_and_factor_one_adds_no_hooks(monkeypatch):
    model = _Blocks()
    device, waits = _slow(model, 2.0, monkeypatch)
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert waits == [("fwd", 1.0)] * 4
    device.remove()
    model(torch.randn(2, 4)).sum().backward()
    assert len(waits) == 4
    assert SlowDevice(model, 1.0, torch.device("cpu")).handles == []
    with pytest.raises(ValueError, match=">= 1"):
        SlowDevice(model, 0.5, torch.device("cpu"))


def test_time_slept_is_counted():
    device = SlowDevice(_Blocks(), 2.0, torch.device("cpu"))
    device.wait(0.01)
    device.wait(0.0)
    assert device.slept_s == pytest.approx(0.01)
