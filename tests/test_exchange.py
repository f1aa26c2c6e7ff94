"""How the accepted rows are combined (federation/exchange.py `aggregate`), by hand."""

from __future__ import annotations

import pytest
import torch

from archipelago.federation.exchange import aggregate


def _values(count: int, numel: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    return [torch.randn(numel, generator=g) for _ in range(count)]


def test_the_mean_is_the_weighted_sum_in_row_order():
    values, weights = _values(3), [100.0, 300.0, 50.0]
    expected = torch.zeros(7)
    for w, v in zip(weights, values):
        expected += w * v
    assert torch.equal(aggregate(values, weights), expected)


@pytest.mark.parametrize("count", [3, 4, 5])
def test_the_trimmed_mean_drops_each_coordinates_largest_and_smallest_value(count):
    values, weights = _values(count), [float(10 * (k + 1)) for k in range(count)]
    got = aggregate(values, weights, trimmed=True)
    for i in range(7):  # per coordinate, by hand: sort, drop the ends, weighted mean of the rest
        ranked = sorted(range(count), key=lambda k: float(values[k][i]))[1:-1]
        kept = sum(weights[k] for k in ranked)
        mean = sum(weights[k] * float(values[k][i]) for k in ranked) / kept
        assert float(got[i]) == pytest.approx(mean * sum(weights), rel=1e-5)
    if count == 3:  # three islands: the median, whatever the weights
        assert torch.allclose(got / sum(weights), torch.stack(values).median(dim=0).values, rtol=1e-6, atol=0)


def test_one_islands_huge_values_do_not_move_the_trimmed_mean():
    values = _values(4)
    poisoned = [*values[:3], values[3] * 1e6]
    weights = [1.0] * 4
    trimmed = aggregate(poisoned, weights, trimmed=True) / 4
    assert trimmed.abs().max() < 10  # the plain mean moves by ~1e5
    assert aggregate(poisoned, weights).abs().max() / 4 > 1e4
    assert torch.equal(aggregate(values[:2], [1.0, 2.0], trimmed=True), aggregate(values[:2], [1.0, 2.0]))
