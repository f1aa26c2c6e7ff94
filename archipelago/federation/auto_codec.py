"""codec = "auto": the link a bridge rank measured, and the codec each round takes from it.

Every round the members all-gather the slowest link, the lower median round and each codec's
CPU seconds they measured (`agree_on_link`) and choose alike the densest codec whose
exchange, its bytes over the link plus its CPU seconds, fits the round's share of time
(`choose_codec`; int8 until some island has measured). With
`average_optimizer_state`, the averaged moments (two model-sized rows per island, far more
than any codec's row) ride only in rounds whose agreed link carries them too: the densest
codec whose exchange fits beside them is taken; when none does, the round sends the
pseudo-gradient alone, each island keeping its own moments (`choose_round`). A shipped
config taken to a thin link then stops sending three model-sized rows a round by itself.
After an exchange that went through, the rate at which its rows came in becomes this
rank's link for the next choice, and its encoding and decoding seconds that codec's
CPU. The outer loop holds one `AutoCodec` per bridge rank and calls it at three points
of a round: choosing, choosing again on a retry, measuring.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.codecs import AUTO_FIRST, LADDER, Codec
from archipelago.federation.exchange import Framing, Gathered, allgather, round_received, wire_device
from archipelago.federation.trust import FederationKey

MOMENT_ROWS = 2  # average_optimizer_state: AdamW's two moments, each a model-sized row

# codec = "auto": an exchange may take this share of the islands' median round unless
# target_exchange_s says otherwise (95% of the round left for inner steps) ...
AUTO_EXCHANGE_SHARE = 0.05
# ... and with streaming's overlap, this share of the inner steps it overlaps: the rest is
# room for a peer that starts late and for the steps the transfer slows (over 100 Mbit/s
# a fragment exchange sized to fill its whole overlap left 0.1-0.5 s exposed; bench/wan.py).
AUTO_OVERLAP_SHARE = 0.5


def auto_target_s(ft: Any, round_s: float, per_fragment: int | None = None) -> float:
    """codec = "auto": the seconds an exchange may take, `target_exchange_s` or else
    AUTO_EXCHANGE_SHARE of a round of `round_s` compute seconds; with streaming fragments
    and `fragment_sync_delay` steps of overlap, AUTO_OVERLAP_SHARE of those steps' seconds
    if that is more (the exchange hides behind them). `per_fragment`: inner steps per
    fragment round, as the outer loop counts them (default: from the config)."""
    if ft.target_exchange_s:
        return float(ft.target_exchange_s)
    if per_fragment is None:
        per_fragment = ft.sync_steps // max(ft.num_fragments, 1)
    overlap = ft.fragment_sync_delay / max(per_fragment, 1) if ft.round_pacing == "steps" else 0.0
    return max(AUTO_EXCHANGE_SHARE, AUTO_OVERLAP_SHARE * overlap) * round_s


def choose_codec(codec: Any, participants: int, link_bits_s: float, target_s: float, framing: Framing) -> str:
    """codec = "auto": the densest of its options whose exchange among `participants`
    islands, over a link of `link_bits_s`, takes at most `target_s` seconds (the bytes as
    `round_received` counts them); when none does, the one that receives the fewest bytes
    (top-k's all-gather can receive more than int8's reduce-scatter from about seven
    islands on). The same on every island given the same agreed values."""
    return choose_round(codec, participants, link_bits_s, target_s, framing)[0]


def choose_round(codec: Any, participants: int, link_bits_s: float, target_s: float, framing: Framing,
                 moments_row_bytes: int = 0, cpu_s: dict[str, float] | None = None) -> tuple[str, bool]:
    """codec = "auto" with averaged moments (`moments_row_bytes`: one island's row of them,
    0 when the config averages none): (the codec, whether the moments ride). The densest
    codec whose exchange plus the moments' rows fits `target_s`, with them; when none
    does, `choose_codec`'s choice without them. Moments first, codec density second:
    int8 costs little next to each island keeping its own moments (docs/quality.md).
    `cpu_s`: the seconds each codec's exchange measured on the islands' CPUs (encoding,
    opening, judging, decoding; `cpu_key`), added to its bytes' seconds; none measured: 0."""
    received = {name: round_received(option, participants, framing) for name, option in codec.options.items()}
    return densest_round(received, moments_received(moments_row_bytes, participants, framing),
                         link_bits_s, target_s, cpu_s)


def densest_round(received: dict[str, int], moments: int, link_bits_s: float, target_s: float,
                  cpu_s: dict[str, float] | None = None) -> tuple[str, bool]:
    """`choose_round` on bytes: each codec's `received` bytes (densest first) and the
    moments' (`moments`, 0: none averaged), plus the CPU seconds each measured (`cpu_s`)."""
    cpu_s = cpu_s or {}
    if moments:
        for name, size in received.items():
            if (size + moments) * 8 / link_bits_s + cpu_s.get(cpu_key(name, True), cpu_s.get(name, 0.0)) <= target_s:
                return name, True
    return densest_within(received, link_bits_s, target_s, cpu_s), False


def cpu_key(name: str, moments: bool) -> str:
    """The name a codec's CPU seconds go by: a round that carried the averaged moments also
    checked them, so it is timed apart ("int8+moments"); until it has been, the codec's
    own seconds stand for it."""
    return f"{name}+moments" if moments else name


def moments_row_bytes(ft: Any, numel: int) -> int:
    """Bytes of one island's row of averaged moments for `numel` values (AdamW's two, in
    `moments_dtype`); 0 when the config averages none."""
    width = 2 if ft.moments_dtype == "bf16" else 4
    return MOMENT_ROWS * width * numel if ft.average_optimizer_state else 0


def moments_received(row_bytes: int, participants: int, framing: Framing) -> int:
    """Bytes one island receives of the others' moments: their rows are all-gathered
    (inner_state.py), one frame of `row_bytes` per other island (0 bytes: none)."""
    return (participants - 1) * framing.row_bytes(row_bytes) if participants > 1 and row_bytes else 0


def densest_within(received: dict[str, int], link_bits_s: float, target_s: float,
                   cpu_s: dict[str, float] | None = None) -> str:
    """The first codec (densest first) whose `received` bytes cross a link of `link_bits_s`
    in at most `target_s` seconds with its measured CPU seconds (`cpu_s`, 0 where none);
    when none does, the one whose exchange takes the fewest (with no CPU measured: the
    fewest bytes), and of those that tie, the fewest bytes: a link claimed so thin that every
    codec's seconds overflow to inf must not fall to the densest, the first in order."""
    cpu_s = cpu_s or {}
    seconds = {name: size * 8 / link_bits_s + cpu_s.get(name, 0.0) for name, size in received.items()}
    for name, took in seconds.items():
        if took <= target_s:
            return name
    return min(seconds, key=lambda name: (seconds[name], received[name]))


def link_carries(ft: Any, params: int, islands: int, link_bits_s: float,
                 signed: bool) -> dict[str, tuple[int, float]]:
    """What one exchange of a model of `params` parameters costs over a link of
    `link_bits_s`, codec by codec (`codec = "auto"`'s options, densest first): the bytes one
    island receives among `islands` islands (`round_received`, per bridge rank's chunk of
    each fragment: params / sync_width / num_fragments) and the seconds they take; with
    average_optimizer_state, the moments' rows under "moments" (last). No collective:
    `archipelago doctor` prints it for a measured link before any island runs."""
    from archipelago.federation.codecs import build_codec
    from archipelago.federation.trust import FederationKey

    numel = max(1, math.ceil(params / max(ft.sync_width, 1) / max(ft.num_fragments, 1)))
    framing = Framing(FederationKey(bytes(32)) if signed else None)  # only the frame's size matters here
    options = build_codec(replace(ft, codec="auto"), numel).options  # type: ignore[attr-defined]
    received = {name: round_received(option, islands, framing) for name, option in options.items()}
    if ft.average_optimizer_state:
        received["moments"] = moments_received(moments_row_bytes(ft, numel), islands, framing)
    return {name: (size, size * 8 / link_bits_s if link_bits_s > 0 else math.inf) for name, size in received.items()}


@dataclass
class AgreedLink:
    """What the members agreed on for a round's choice (`agree_on_link`)."""

    link_bits_s: float  # the slowest member's measured link
    round_s: float      # the lower median of the members' rounds of compute seconds
    cpu_s: dict[str, float] = field(default_factory=dict)  # by `cpu_key`: each codec's CPU seconds


# Every `cpu_key`, in the order `agree_on_link` sends their seconds.
CPU_KEYS = tuple(cpu_key(name, moments) for moments in (False, True) for name in LADDER)


def agree_on_link(manager: Any, link_bits_s: float, round_s: float, participants: int,
                  device: torch.device, cpu_s: dict[str, float] | None = None) -> AgreedLink | None:
    """codec = "auto": all-gather each island's last measured link rate, round seconds and
    each codec's CPU seconds (`cpu_s` by `cpu_key`; 80 bytes each); the slowest link, the
    lower median of the rounds and, codec by codec, the lower median of the CPU seconds the
    members measured, the same on every island. None before any island has measured a link
    (or when the all-gather fails: the round is lost). A lying island can lower the agreed
    link or round (a sparser codec for all, the moments left out) but not raise them, and
    moves each lower median by one place at most: with two islands it is the honest
    island's value or the lower claim. (The plain median of two is their mean: one claim of
    a 10^12 s round made every exchange's target fit fp32 and the moments.)"""
    cpu_s = cpu_s or {}
    values = torch.tensor([link_bits_s, round_s, *(cpu_s.get(k, 0.0) for k in CPU_KEYS)], dtype=torch.float64,
                          device=device)
    work, outputs = allgather(manager, values, participants)
    work.wait()
    if manager.errored() is not None:
        return None
    rows = [out.cpu().tolist() for out in outputs]
    links = [row[0] for row in rows if _measured(row[0])]
    rounds = [row[1] for row in rows if _measured(row[1])]
    if not links:
        return None
    agreed_cpu = {}
    for at, key in enumerate(CPU_KEYS, start=2):
        seen = [row[at] for row in rows if _measured(row[at])]
        if seen:
            agreed_cpu[key] = statistics.median_low(seen)
    return AgreedLink(min(links), statistics.median_low(rounds) if rounds else 0.0, agreed_cpu)


def _measured(value: float) -> bool:
    return math.isfinite(value) and value > 0


class AutoCodec:
    """The measured link (bits/s) and round (compute seconds) of this bridge rank, and
    whether this round's moments ride (`carries_moments`; always, unless codec = "auto"
    chose otherwise)."""

    def __init__(self, ft: FaultToleranceConfig, manager: Any, key: FederationKey | None, per_fragment: int,
                 moments_bytes_per_value: int = 0) -> None:
        self.ft, self.manager, self.key, self.per_fragment = ft, manager, key, per_fragment
        self.link_bits_s, self.last_round_s = 0.0, 0.0
        # Each codec's last exchange on this rank's CPU (by `cpu_key`): encoding, and for a
        # one-phase exchange opening, judging and decoding the rows; what a codec costs
        # beside its bytes, so a fast link does not take top-k for its few bytes when its
        # decoding outlasts a dense codec's transfer.
        self.cpu_s: dict[str, float] = {}
        # average_optimizer_state: bytes of moments per value of the chunk (2 moments x 4
        # bytes for AdamW in fp32); 0 when the config averages none.
        self.moments_bytes_per_value = moments_bytes_per_value
        self.carries_moments = True

    def choose(self, codec: Codec, buffer: torch.Tensor, contributes: bool) -> torch.Tensor | None:
        """Choose this round's codec (the same on every island), and let a dense round carry
        what top-k held back: added to the pseudo-gradient here, before the guard sees it;
        returned, to be given back if the round does not carry it."""
        self.rechoose(codec, buffer.device)
        residue = codec.take_residue() if contributes else None  # type: ignore[attr-defined]
        if residue is not None:
            buffer[:-2] += residue.to(buffer.device)
        return residue

    def rechoose(self, codec: Codec, device: torch.device) -> None:
        """Agree on the link with the quorum (a collective every member runs, a joining one
        too) and choose from it. On a retry the residue the round took stays in its
        pseudo-gradient, whatever codec now carries it."""
        participants = self.manager.num_participants() if self.manager is not None else 1
        agreed = agree_on_link(self.manager, self.link_bits_s, self.last_round_s, participants,
                               wire_device(self.manager, device), self.cpu_s)
        # Before any island has measured: int8, and no moments (the link may be thin).
        name, self.carries_moments = AUTO_FIRST, False
        if agreed is not None:
            target = auto_target_s(self.ft, agreed.round_s, self.per_fragment)
            name, self.carries_moments = choose_round(codec, participants, agreed.link_bits_s, target,
                                                      Framing(self.key), codec.numel * self.moments_bytes_per_value,
                                                      agreed.cpu_s)
        codec.choose(name)  # type: ignore[attr-defined]

    def measure(self, codec: Codec, gathered: Gathered | None, residue: torch.Tensor | None, carried: bool,
                until_in_s: float, waited: float, round_compute_s: float, decode_s: float = 0.0) -> None:
        """After an exchange: the rate at which its rows came in, from its start until they
        were in (`until_in_s`: the inner steps that ran after, with streaming's overlap, left
        out), and the round's compute seconds. A one-phase exchange received its rows then:
        opening, judging and decoding them after the wait (at `waited`) is the island's CPU,
        not the link; counted as link time it made top-k, whose decoding far outlasts its
        few bytes' transfer, measure a thin link and choose itself again. A reduce-scatter's
        summed segments come in after the wait, so its seconds since then count too (a rate
        too low rather than too high), and are left out of its CPU seconds (its encoding plus,
        for a one-phase exchange, `decode_s`). Top-k's residue goes back to the codec unless
        this round carried it."""
        if residue is not None and not carried:
            codec.give_back(residue)  # type: ignore[attr-defined]
        if self.manager is None or self.manager.errored() is not None or gathered is None:
            return
        elapsed = until_in_s if gathered.segments is None else until_in_s + time.perf_counter() - waited
        if gathered.received > 0:  # alone in the round it received and decoded no rows: nothing to measure
            if elapsed > 0:
                self.link_bits_s = gathered.received * 8 / elapsed
            cpu = gathered.encode_s + (decode_s if gathered.segments is None else 0.0)
            self.cpu_s[cpu_key(codec.current, self.carries_moments)] = cpu  # type: ignore[attr-defined]
        self.last_round_s = round_compute_s
