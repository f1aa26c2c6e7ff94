"""RefusalLog (federation/refusal_log.py): refusals named once per source, then counted, with
memory bounded whatever the number of sources. The clock is the test's own."""

from __future__ import annotations

import logging

from archipelago.federation.refusal_log import RefusalLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_sources_are_named_once_and_the_rest_counted_once_a_period(caplog):
    caplog.set_level(logging.WARNING, logger="test.refusals")
    clock = Clock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), "server", capacity=3, period_s=60.0, clock=clock)
    assert [refusals.refused(s, s.upper(), f"refused {s}") for s in "abca"] == [True, True, True, False]
    assert [r.getMessage() for r in caplog.records] == ["refused a", "refused b", "refused c"]
    caplog.clear()
    refusals.refused("d", "D", "refused d")  # beyond the capacity: the count is logged at once...
    refusals.refused("e", "E", "refused e")  # ...then not before the period ends
    refusals.refused("d", "D", "refused d")
    assert [r.getMessage() for r in caplog.records] == [
        "server: 1 refusal(s) in 0 s not named one by one (more than 3 sources were refused); the latest: refused d"]
    caplog.clear()
    clock.now += 61
    refusals.refused("f", "F", "refused f")
    assert [r.getMessage() for r in caplog.records] == [
        "server: 3 refusal(s) in 61 s not named one by one (more than 3 sources were refused); the latest: refused f"]
    caplog.clear()
    refusals.flush()
    assert caplog.records == []  # nothing left to count
    clock.now += 1
    refusals.refused("g", "G", "refused g")
    assert caplog.records == []  # within the period
    refusals.flush()  # at shutdown
    assert [r.getMessage() for r in caplog.records] == [
        "server: 1 refusal(s) in 0 s not named one by one (more than 3 sources were refused); the latest: refused g"]
    assert refusals.named == ["A", "B", "C"]


def test_memory_stays_at_the_capacity_whatever_the_number_of_sources():
    refusals = RefusalLog(logging.getLogger("test.refusals.quiet"), "server", capacity=16)
    for n in range(20_000):
        refusals.refused(f"source {n}" * 50, f"s{n}", "refused")  # long sources: hashed, never kept
    assert len(refusals.named) == 16 and len(refusals._named) == 16
