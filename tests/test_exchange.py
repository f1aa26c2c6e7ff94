"""How the accepted rows are combined (federation/exchange.py `aggregate`), by hand, and how
every island checks the reduce-scatter's summed segments."""

from __future__ import annotations

import gc
import math
import threading
import weakref

import pytest
import torch
from conftest import FinishedWork

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation import exchange, sums
from archipelago.federation.codecs import Bf16Codec, Codec, Int8Codec, TopKCodec, build_codec
from archipelago.federation.exchange import (
    FRAME,
    NONFINITE,
    ROUND_SEGMENT,
    SUMSQ,
    WEIGHT,
    Framing,
    inspect_gather,
    start_gather,
    take_handed,
)
from archipelago.federation.outer_core import aggregate
from archipelago.federation.policy import FRAME_OK
from archipelago.federation.sums import finish_gather
from archipelago.federation.trust import FederationKey, new_secret


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


# ---- the reduce-scatter's summed segments, checked by every island -------------------
#
# Three or four islands run the real start_gather / inspect_gather / finish_gather on
# threads of this process, over a process group that hands each island the others' rows
# (`_Bus`). A dishonest summer is island 1 (it sums segment 1) with a function of the
# exchange wrapped for its thread alone: it sums honestly, then lies, and signs the lie.

NUMEL = 1000
LIAR = 1


class _Bus:
    """What the islands' collectives exchange: each call returns when every island made it."""

    def __init__(self, count: int) -> None:
        self.barrier = threading.Barrier(count, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * count

    def swap(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = value.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got


class _Island:
    """One island's torchft manager and process group, as the exchange uses them."""

    def __init__(self, bus: _Bus, rank: int, count: int) -> None:
        import logging

        self.bus, self.rank, self.count = bus, rank, count
        self._pg, self._logger, self.errors = self, logging.getLogger(__name__), list[Exception]()

    def errored(self):
        return self.errors[0] if self.errors else None

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def num_participants(self) -> int:
        return self.count

    def participating_rank(self) -> int:
        return self.rank

    def allgather(self, outputs, inputs, options=None):
        for out, value in zip(outputs[0], self.bus.swap(self.rank, inputs[0])):
            out.copy_(value)
        return FinishedWork()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, options=None):
        for k, value in enumerate(self.bus.swap(self.rank, input)):
            output[k].copy_(value[self.rank])
        return FinishedWork()


def _weights(count: int) -> list[float]:
    return [100.0 * (k + 1) for k in range(count)]


def _chunks(count: int, shared: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    """Each island's pseudo-gradient: a common direction plus its own noise (islands train
    one model on similar data), or with `shared` 1e9 the same chunk on every island (the
    triangle inequality's equality: the tightest honest sum)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=g) * 0.01
    if shared > 1e8:
        return [common.clone() for _ in range(count)]
    return [shared * common + 0.003 * torch.randn(NUMEL, generator=g) for _ in range(count)]


def _codec(name: str, exchange_: str = "reduce_scatter") -> Codec:
    if name == "int8":
        return Int8Codec(NUMEL, 64)
    if name == "bf16":
        return Bf16Codec(NUMEL)
    if name == "auto":  # starts at int8, as before any island has measured its link
        return build_codec(FaultToleranceConfig(codec="auto", codec_block_size=64, topk_chunk_size=16), NUMEL)
    return TopKCodec(NUMEL, 0.25, 2, 16, exchange_)


class _Recording(_Island):
    """An island's manager that also remembers, weakly, every tensor it was handed to send."""

    def __init__(self, bus: _Bus, rank: int, count: int) -> None:
        super().__init__(bus, rank, count)
        self.sent: list[weakref.ref] = []

    def allgather(self, outputs, inputs, options=None):
        self.sent.append(weakref.ref(inputs[0]))
        return super().allgather(outputs, inputs, options)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, options=None):
        self.sent.append(weakref.ref(input))
        return super().alltoall_base(output, input, output_split_sizes, input_split_sizes, options)


def _federate(codecs: list[Codec], chunks: list[torch.Tensor], key: FederationKey | None = None,
              trimmed: bool = False, manager_type: type[_Island] = _Island) -> list[dict]:
    """One exchange among len(chunks) islands (thread `island-k` is replica rank k); each
    island's buffer `into`, its manager and its errors, and the weights it decided."""
    count = len(chunks)
    bus, results = _Bus(count), [dict[str, object]() for _ in range(count)]

    def island(rank: int) -> None:
        try:
            manager, weight = manager_type(bus, rank, count), _weights(count)[rank]
            framing = Framing(key, quorum=3, step=1, fragment=0, island=rank)
            gathered = start_gather(manager, codecs[rank], chunks[rank], int(weight), weight, framing)
            table = inspect_gather(gathered, codecs[rank], manager, count)
            weights = [float(r[WEIGHT]) if r[FRAME] == FRAME_OK and not r[NONFINITE] else 0.0 for r in table]
            into = torch.full((NUMEL + 2,), 7.0)
            finish_gather(gathered, codecs[rank], into, weights, sum(weights), manager, trimmed)
            results[rank].update(into=into, errors=manager.errors, weights=weights, gathered=gathered,
                                 manager=manager)
        except Exception as exc:  # noqa: BLE001 - reported by the test's thread
            results[rank]["raised"] = exc

    threads = [threading.Thread(target=island, args=(k,), name=f"island-{k}") for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for result in results:
        assert "raised" not in result, result["raised"]
    return results


class _LaterWork(FinishedWork):
    """A collective that completes on a thread of its own shortly after it started, as
    gloo's does (after start_gather has returned), or when waited for."""

    def __init__(self) -> None:
        self.future = torch.futures.Future()
        threading.Timer(0.02, self.wait).start()

    def get_future(self):
        return self.future

    def wait(self, timeout=None) -> bool:
        with _LATER:
            if not self.future.done():
                self.future.set_result(None)
        return True


_LATER = threading.Lock()


def test_the_transports_completion_times_reach_the_exchange(monkeypatch):
    # gloo's work completes on the transport's thread, which stamps the time into the list
    # the exchange reads (the measure of its seconds: codec auto's link, decoupled rounds'
    # overlap). An empty list was once swapped for a new one the thread never saw, and the
    # exchange took the wait's return instead: halfway through a round, not the link's time.
    monkeypatch.setitem(globals(), "FinishedWork", _LaterWork)  # what the fake process group returns
    for result in _federate([_codec("int8") for _ in range(3)], _chunks(3)):
        gathered = result["gathered"]
        assert gathered.stamped and len(gathered.done_at) == 1 and gathered.started <= gathered.done_at[0]  # phase 1
        second = gathered.second
        assert second is not None and len(second.done_at) == 1  # the summed segments' all-gather
        assert 0 <= second.seconds() < 60 and second.waited >= second.done_at[0]


def test_what_the_exchange_sends_outlives_its_released_works():
    # gloo may still send from a failed collective's input on the live pairs after its work
    # finished with the error and was let go (agreement.release_works drops it, so that the
    # group's connections close at the abort). Freed under it, a survivor aborted (writev ...
    # Bad address, exit 134 in CI's segment-repair drill). So the manager keeps every tensor
    # the exchange sends (its segments, its table, its summed segment) until the island's
    # attempts take them: kept with a failed attempt, dropped after an agreed one.
    from archipelago.federation.agreement import release_works

    for result in _federate([_codec("int8") for _ in range(3)], _chunks(3), manager_type=_Recording):
        manager, gathered = result.pop("manager"), result.pop("gathered")
        release_works(gathered)
        del gathered
        gc.collect()
        sent = manager.sent
        assert len(sent) == 3 and all(ref() is not None for ref in sent)  # phase 1, the tables, phase 2
        handed = take_handed(manager)
        assert {id(ref()) for ref in sent} <= {id(t) for t in handed}
        assert take_handed(manager) == []  # taken: the next collectives start a new list
        del handed
        gc.collect()
        assert all(ref() is None for ref in sent)  # nothing else held them


def _on_liar() -> bool:
    return threading.current_thread().name == f"island-{LIAR}"


def _dense_reference(codec: Codec, chunks: list[torch.Tensor], trimmed: bool) -> torch.Tensor:
    """The reduce-scatter's result by hand: per segment, every island's encoded segment
    decoded, aggregated in replica order, encoded again and decoded."""
    out = torch.zeros(NUMEL)
    for start, end in codec.segments(len(chunks)):
        piece = codec.for_length(end - start)
        decoded = [piece.decode(piece.encode(x[start:end])) for x in chunks]
        out[start:end] = piece.decode(piece.encode(aggregate(decoded, _weights(len(chunks)), trimmed)))
    return out


@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
@pytest.mark.parametrize("trimmed", [False, True], ids=["mean", "trimmed"])
@pytest.mark.parametrize("shared", [0.0, 1.0, 1e9], ids=["independent", "similar", "identical"])
@pytest.mark.parametrize("count", [3, 4])
@pytest.mark.parametrize("name", ["int8", "bf16", "auto", "topk"])
def test_honest_summed_segments_pass_their_checks_and_match_the_reference(name, count, shared, trimmed, signed):
    # Identical chunks make every sum as large as the bound allows (before the second
    # rounding): the slack must hold there too. Top-k's reduce-scatter ends with the
    # all-gather's result bit for bit; the dense codecs with the hand-computed one.
    key = FederationKey(bytes.fromhex(new_secret())) if signed else None
    chunks = _chunks(count, shared)
    results = _federate([_codec(name) for _ in range(count)], chunks, key, trimmed)
    for result in results:
        assert result["errors"] == [] and torch.equal(result["into"], results[0]["into"])
    if name == "topk":
        reference = _federate([_codec(name, "all_gather") for _ in range(count)], chunks, key, trimmed)[0]["into"]
        assert torch.equal(results[0]["into"], reference)
    else:
        assert torch.equal(results[0]["into"][:-2], _dense_reference(_codec(name), chunks, trimmed))


def _lie(monkeypatch, lie: str) -> None:
    """Island LIAR sums its segment honestly, then: `nan` puts a NaN in it (int8: the
    first block's scale becomes NaN), `times2`/`times4` scales it, `misreport` reports
    ten times the norms of the other islands' segments in its first-phase table (and sends
    4x its sum, inside the bound those widen), `misreport_one` only island 0's, by 10^4."""
    honest_sum, honest_rows = sums.weighted_sum, exchange._inspect_rows

    def summed(*args, **kwargs):
        total = honest_sum(*args, **kwargs)
        if not _on_liar():
            return total
        if lie == "nan":
            total = total.clone()
            total[0] = float("nan")
            return total
        return total * (2 if lie == "times2" else 4)

    def inspected(gathered, codec, rows, kind, segment):
        table = honest_rows(gathered, codec, rows, kind, segment)
        if _on_liar() and kind == ROUND_SEGMENT and lie.startswith("misreport"):
            victims = [0] if lie == "misreport_one" else [k for k in range(len(rows)) if k != LIAR]
            table[victims, SUMSQ] *= 1e8 if lie == "misreport_one" else 100
        return table

    monkeypatch.setattr(sums, "weighted_sum", summed)
    monkeypatch.setattr(exchange, "_inspect_rows", inspected)


@pytest.mark.parametrize("trimmed", [False, True], ids=["mean", "trimmed"])
@pytest.mark.parametrize("count", [3, 4])
@pytest.mark.parametrize("name,lie", [
    *[(name, lie) for name in ("int8", "bf16", "auto", "topk")
      for lie in ("nan", "times2", "times4", "misreport", "misreport_one") if (name, lie) != ("topk", "nan")]])
def test_every_island_refuses_a_dishonest_summers_segment(monkeypatch, name, lie, count, trimmed):
    # (Top-k's exact sums refused non-finite values before: unpack_sum.) The liar signs
    # what it sends with the federation's key, so only the values can give it away: every
    # island, the liar included, reports the same error and keeps nothing of the sums.
    _lie(monkeypatch, lie)
    key = FederationKey(bytes.fromhex(new_secret()))
    results = _federate([_codec(name) for _ in range(count)], _chunks(count), key, trimmed)
    messages = set()
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 1, (rank, result["errors"])
        assert torch.count_nonzero(result["into"][:-2]) == 0, rank  # nothing of the round is kept
        messages.add(str(result["errors"][0]))
    assert len(messages) == 1, messages  # every island alike
    message = messages.pop()
    if lie.startswith("misreport"):  # the victims say so in their summed segments' frames
        assert f"replica rank {LIAR}, which summed segment {LIAR}, misreported" in message
    else:
        assert f"the sum of segment {LIAR} from the island at replica rank {LIAR}" in message
        assert ("not finite" if lie == "nan" else "the most the accepted segments' norms allow") in message


def test_the_trimmed_bound_leaves_out_the_largest_norm():
    # A summer that inflates its own segment's norm (no other island sees that segment)
    # widens the weighted sum's bound by its weight times the lie, the trimmed mean's not.
    summed_norm_bound = sums.summed_norm_bound
    norms, weights = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]
    assert summed_norm_bound(norms, weights, False) == 3.0
    assert summed_norm_bound(norms, weights, True) == pytest.approx(3.0 * 1.5 ** 0.5)
    assert summed_norm_bound([1.0, 1e6, 1.0], weights, True) == pytest.approx(3.0 * 2 ** 0.5)
    assert summed_norm_bound([1e30, 1.0, 1.0], weights, True) == pytest.approx(3.0 * 2 ** 0.5)  # no cancellation
    assert summed_norm_bound([5.0, 1.0, 1.0], [0.0, 2.0, 1.0], True) == 3.0  # two rows: the weighted sum
    assert summed_norm_bound([5.0, 1.0], [0.0, 0.0], False) == 0.0


def test_the_sum_of_squares_adds_in_one_fixed_order():
    # The last half onto the first, level by level (an odd middle value waits): the same
    # bits on any device, whatever order torch's own sum would take there.
    values = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    squares = [v * v for v in values.double().tolist()]
    while len(squares) > 1:
        half = len(squares) // 2
        squares = [a + b for a, b in zip(squares[:half], squares[-half:])] + squares[half:len(squares) - half]
    assert sums._sum_of_squares(values) == squares[0]
    assert squares[0] == pytest.approx(math.fsum(v * v for v in values.double().tolist()), rel=1e-15)
    assert sums._sum_of_squares(torch.zeros(0)) == 0.0
