"""codec = "auto": the link a bridge rank measured, and the codec each round takes from it.

Every round the members all-gather the slowest link and the median round they measured
(`exchange.agree_on_link`) and choose alike the densest codec whose exchange fits the
round's share of time (`exchange.choose_codec`; int8 until some island has measured).
After an exchange that went through, the rate at which its rows came in becomes this
rank's link for the next choice. The outer loop holds one `AutoCodec` per bridge rank and
calls it at three points of a round: choosing, choosing again on a retry, measuring.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.codecs import AUTO_FIRST, Codec
from archipelago.federation.exchange import Framing, Gathered, agree_on_link, auto_target_s, choose_codec, wire_device
from archipelago.federation.trust import FederationKey


class AutoCodec:
    """The measured link (bits/s) and round (compute seconds) of this bridge rank."""

    def __init__(self, ft: FaultToleranceConfig, manager: Any, key: FederationKey | None, per_fragment: int) -> None:
        self.ft, self.manager, self.key, self.per_fragment = ft, manager, key, per_fragment
        self.link_bits_s, self.last_round_s = 0.0, 0.0

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
                               wire_device(self.manager, device))
        name = AUTO_FIRST
        if agreed is not None:
            link, round_s = agreed
            target = auto_target_s(self.ft, round_s, self.per_fragment)
            name = choose_codec(codec, participants, link, target, Framing(self.key))
        codec.choose(name)  # type: ignore[attr-defined]

    def measure(self, codec: Codec, gathered: Gathered | None, residue: torch.Tensor | None, carried: bool,
                until_in_s: float, waited: float, round_compute_s: float) -> None:
        """After an exchange: the rate at which its rows came in, from its start to its end
        (`until_in_s`, then what followed the wait for them at `waited`: decoding, a second
        phase; so a rate too low rather than too high, and the inner steps that ran after the
        rows were in, with streaming's overlap, left out), and the round's compute seconds.
        Top-k's residue goes back to the codec unless this round carried it."""
        if residue is not None and not carried:
            codec.give_back(residue)  # type: ignore[attr-defined]
        if self.manager is None or self.manager.errored() is not None or gathered is None:
            return
        elapsed = until_in_s + time.perf_counter() - waited
        if gathered.received > 0 and elapsed > 0:
            self.link_bits_s = gathered.received * 8 / elapsed
        self.last_round_s = round_compute_s
