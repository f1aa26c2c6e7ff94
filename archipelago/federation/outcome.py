"""A round's outcome, once its exchange is agreed: torchft's vote combined over the island's
ranks, the outer step on the global weights, the island's weights that follow, the
federation's step and token counts, and the round's record.

The outer loop (diloco.OuterLoop, the `OutcomeHost` here) runs the exchange
(attempts.py) and hands its agreed sum to `RoundOutcome.close`; the counters it owns
(`step`, `federation_tokens`, ...) are read by healing and by the trainer, so they stay
on the host and are set from here.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.attempts import ExchangeAttempts, Pending, Tried
from archipelago.federation.codecs import Codec
from archipelago.federation.decoupled import Handoffs
from archipelago.federation.decoupled_rounds import DecoupledRounds
from archipelago.federation.global_weights import GlobalWeights
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outer_core import OuterCore
from archipelago.federation.policy import RoundResult, applies_outer_step, merges_local
from archipelago.federation.round_book import OuterReport, RoundBook

# Hash the global weights after every round below this size (cheap); larger models
# hash them only at the end of the run (sha256 reads every byte once).
HASH_EVERY_ROUND_MAX_NUMEL = 1 << 26


class FederationError(RuntimeError):
    """The federation cannot go on (e.g. too many rounds in a row failed to commit)."""


class OutcomeHost(Protocol):
    """What a round's outcome reads of the outer loop, and sets on it."""

    ft: FaultToleranceConfig
    ranks: IslandRanks
    manager: Any
    layouts: list[FlatLayout]
    attempts: ExchangeAttempts
    book: RoundBook
    decoupled: DecoupledRounds | None
    handoffs: Handoffs | None
    codec_name: str
    numel: int
    healed: bool
    outer_step: int
    established: bool
    last_committed: bool
    federation_tokens: int
    tokens_ratio: float
    weights: GlobalWeights
    scaled_optimizer: torch.optim.Optimizer | None

    @property
    def core(self) -> OuterCore | None: ...

    @property
    def codecs(self) -> list[Codec]: ...


    def global_hash(self) -> str: ...



class RoundOutcome:
    """What follows an agreed exchange on one rank of an island (see module doc)."""

    def __init__(self, host: OutcomeHost) -> None:
        self.host = host

    def vote(self, p: Pending) -> tuple[RoundResult, bool]:
        """torchft's vote on this bridge rank, combined over the island's ranks: the round's
        result, and whether the averaged moments had any island's weight."""
        h = self.host
        mine = RoundResult()
        if h.manager is not None and p.buffer is not None:
            mine = RoundResult(self._should_commit(), h.manager.num_participants(),
                               float(p.buffer[-1]), int(float(p.buffer[-2])))
        state_weight = sum(p.state.weights) if p.state is not None else 0.0
        values = h.ranks.max([*mine.to_values(), state_weight])
        return RoundResult.from_values(values[:-1]), values[-1] > 0

    def apply(self, p: Pending, own: torch.Tensor | None, result: RoundResult) -> None:
        """The outer step on the global weights (when the round applies one), and the
        island's weights that follow: the global ones (merged with its own, with
        fragment_update_alpha), or under decoupled rounds its own, moved on."""
        h = self.host
        merge = merges_local(result, p.reset, h.ft.fragment_update_alpha)
        local = h.layouts[p.fragment].gather() if merge and not p.overlapped else None
        if p.buffer is not None and applies_outer_step(result):  # bridge ranks
            self._outer_step(p.fragment, p.buffer, result.total_weight)
        if h.decoupled is not None and p.exchanged:
            h.decoupled.settle(p, applies_outer_step(result))
        if h.decoupled is not None and p.overlapped:  # the island trained on: its weights are not the global ones
            h.decoupled.after_overlapped(p, own, result.committed)
            return
        held = (h.codecs[p.fragment].release_residue()  # type: ignore[attr-defined]
                if h.ft.topk_keep_residue and h.core is not None else None)
        new = h.core.island_weights(p.fragment, local, held) if h.core is not None else None  # bridge ranks
        h.layouts[p.fragment].scatter(new)
        if h.handoffs is not None and new is not None:
            h.handoffs.rebase(p.fragment, new)

    def count(self, p: Pending, result: RoundResult) -> None:
        """The federation's step and token counts after the round."""
        h = self.host
        h.last_committed = result.committed
        if not result.committed:
            return
        h.outer_step += 1
        h.established = True
        h.federation_tokens += result.federation_tokens
        if p.tokens - p.carried_tokens:  # federation tokens per own token (a carrier's row claims more)
            h.tokens_ratio = result.federation_tokens / (p.tokens - p.carried_tokens)
            self.scale_inner_batch()

    def report(self, p: Pending, inner_step: int, result: RoundResult, tried: Tried,
               blocked_since: float) -> OuterReport:
        """The round's record; the round's counters start again."""
        h = self.host
        sent, received = h.attempts.exchange_bytes(p)
        report = h.book.close(step=inner_step, outer_step=h.outer_step, committed=result.committed,
                              participants=result.participants, contributors=result.total_weight,
                              fragment=p.fragment, healed=h.healed, bytes_sent=sent,
                              sync_s=p.prepare_s + p.midway_s + time.perf_counter() - blocked_since,
                              tokens=p.tokens - p.carried_tokens, weight=p.weight,
                              federation_tokens=h.federation_tokens,
                              carried=len(p.carried) if result.committed else 0,
                              norm=p.norm, own_refused=p.own_refused, refused=tried.refused,
                              codec=self._codec_label(p), bytes_received=received,
                              encode_s=p.gathered.encode_s if p.gathered else 0.0, decode_s=tried.decode_s,
                              overlap_s=blocked_since - p.started, exposed_s=tried.exposed_s,
                              retries=tried.retries, retry_s=tried.retry_s, repaired=tried.repaired)
        if h.numel <= HASH_EVERY_ROUND_MAX_NUMEL:
            report.global_hash = h.global_hash()
        return report

    def scale_inner_batch(self) -> None:
        """adam_federation_batch: the inner AdamW's batch ratio is the federation's tokens per
        own token (the same on every rank of the island; 1 when it trains alone)."""
        h = self.host
        if h.scaled_optimizer is not None:
            h.scaled_optimizer.batch_ratio = max(1.0, h.tokens_ratio)  # type: ignore[attr-defined]

    def _outer_step(self, fragment: int, buffer: torch.Tensor, total: float) -> None:
        """The core's outer step on the agreed sum (from a GPU buffer: a device-to-host copy)."""
        h = self.host
        assert h.core is not None, "only bridge ranks hold the global weights"
        h.core.apply(fragment, buffer[:-2], total)
        h.weights.forget_digest(fragment)  # its weights and outer state changed, no other fragment's

    def _should_commit(self) -> bool:
        try:
            return bool(self.host.manager.should_commit())
        except RuntimeError as exc:  # torchft raises after max_retries failures in a row
            raise FederationError(f"{exc}; the federation is not making progress: check that the other "
                                  "islands are alive and reachable (fault_tolerance.max_retries)") from exc

    def _codec_label(self, p: Pending) -> str:
        """The codec's name for the record; with `auto`, the round's choice (`auto:int8`,
        `auto:fp32+moments` when the averaged moments rode with it)."""
        h = self.host
        if h.codec_name == "auto" and h.codecs:
            moments = "+moments" if p.state is not None else ""
            return f"auto:{h.codecs[p.fragment].current}{moments}"  # type: ignore[attr-defined]
        return h.codec_name
