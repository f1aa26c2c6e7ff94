"""A member carrying a thin island (`fault_tolerance.carries`): its carry server, the global
weights it publishes after every outer step, the uploads it folds into its own next row.

The thin island's rows enter the federation inside this member's (`OuterCore.fold`): every
receiver weighs the folded row as any row and adds exactly both islands' shares, each
discounted by its own staleness, and both token counts. So the member declares the carried
tokens at the join (`declared_tokens_per_step`): receivers bound each island's claims by
its declaration of one upload's tokens, so a row carries at most one upload (with two,
every receiver would refuse the whole row): the carrier takes at most one upload per outer
step the thin island downloaded at (`CarrierBook`), and folds one a row; a second waiting
(one that came while the round carrying the one before it failed) goes in the next row. A
round that fails after folding puts the uploads back (`after_round`): the next row carries
them, one step staler.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch

from archipelago.config.errors import ConfigError
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarrierBook, Upload
from archipelago.federation.carry_link import CarryServer
from archipelago.federation.codecs import Codec, build_codec
from archipelago.federation.outer_core import Carried, OuterCore
from archipelago.federation.policy import Allowance, norm_allowance, steps_between_exchanges
from archipelago.federation.trust import FederationKey

log = logging.getLogger("archipelago.federation")


def carry_codec(ft: FaultToleranceConfig, numel: int) -> Codec:
    """The codec of a thin island's uploads (`carry_codec`, else `codec`): the thin island
    encodes with it, its carrier decodes with it."""
    return build_codec(replace(ft, codec=ft.carry_codec or ft.codec), numel)


def declared_tokens_per_step(ft: FaultToleranceConfig, tokens_per_step: int) -> int:
    """What a member declares at the join: its own tokens per inner step, plus, when it
    carries a thin island, the most tokens one upload claims spread over its exchange's
    inner steps (a folded row claims both)."""
    if ft.carries < 0:
        return tokens_per_step
    steps = steps_between_exchanges(ft.round_pacing, ft.sync_steps, ft.max_inner_steps, 1)
    return tokens_per_step + math.ceil(ft.carried_tokens / steps)


class Carrying:
    """The carrier's side on its bridge rank (see the module doc)."""

    def __init__(self, ft: FaultToleranceConfig, key: FederationKey | None, numel: int, tokens_per_step: int,
                 inner_lr: float) -> None:
        if key is None:
            raise ConfigError("fault_tolerance.carries needs a federation key: without one nothing tells the thin "
                             "island's rows from anyone's. Set federation_security.key_file (`archipelago secret "
                             "new` makes one)")
        self.ft, self.numel, self.inner_lr = ft, numel, inner_lr
        # The inner steps one upload may span, from its token bound and this island's batch.
        self.upload_steps = max(1, math.ceil(ft.carried_tokens / max(tokens_per_step, 1)))
        book = CarrierBook(key, ft.replica_id, {ft.carries})
        self.server = CarryServer(book, carry_codec(ft, numel), Allowance(ft.carried_tokens, math.inf),
                                  request_timeout=ft.quorum_timeout_ms / 1000, port=ft.carry_port)
        log.info("island %d carries thin island %d at %s (fault_tolerance.carrier there)", ft.replica_id,
                 ft.carries, self.server.address())

    def publish(self, step: int, weights: torch.Tensor) -> None:
        """The global weights after outer step `step`, for the thin island's next download."""
        bound = norm_allowance(self.ft.outer_norm_limit, self.upload_steps, self.inner_lr, self.numel,
                               float(weights.detach().double().norm()))
        self.server.publish(step, weights, Allowance(self.ft.carried_tokens, bound))

    def fold(self, core: OuterCore, own: torch.Tensor, own_tokens: float, staleness: int,
             outer_step: int) -> tuple[torch.Tensor, float, list[Upload]]:
        """This member's row with the uploads that arrived folded in: (values, tokens, the
        uploads carried). An upload is `outer_step - base_step` steps stale now, plus the
        row's own `staleness` when it enters."""
        uploads = self.server.take_uploads()
        if not uploads:
            return own, own_tokens, []
        uploads, later = uploads[:1], uploads[1:]  # one upload a row: the carrier declared one upload's tokens
        if later:
            log.info("outer step %d: %d more row(s) of thin island %d wait for the next row (one a row)",
                     outer_step + 1, len(later), self.ft.carries)
            self.server.restage(later)
        carried = [Carried(u.values, u.tokens, outer_step - u.base_step + staleness) for u in uploads]
        values, tokens = core.fold(own, own_tokens, staleness, carried)
        log.info("outer step %d: folded %d row(s) of thin island %d into this island's (%g of %g tokens)",
                 outer_step + 1, len(uploads), self.ft.carries, tokens - own_tokens, tokens)
        return values, tokens, uploads

    def after_round(self, uploads: list[Upload], committed: bool, step: int, weights: torch.Tensor) -> None:
        """A round ended: publish the global weights after it (outer step `step`); if it did
        not commit, the `uploads` it carried go in the next row."""
        if committed:
            self.publish(step, weights)
        elif uploads:
            log.warning("the round carrying %d row(s) of thin island %d failed: they go in the next row",
                        len(uploads), self.ft.carries)
            self.server.restage(uploads)

    def close(self) -> None:
        self.server.close(wait=False)
