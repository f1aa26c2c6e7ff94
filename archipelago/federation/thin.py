"""A thin island behind the seam (`fault_tolerance.carrier`): trains on its own, and every
`carry_rounds` rounds uploads its progress to the member carrying it and downloads the
global weights (docs/rounds.md, "Thin links").

A thin island is no torchft replica: a replica that sat out a round's quorum while
heartbeating would make the members' next quorum wait for it. It talks to its carrier
only (carry_link.py: it connects, the carrier serves), and what it sends enters the
federation inside the carrier's row (`OuterCore.fold`).

Its weights after a download are the global weights minus its own progress not in them
yet (the row just uploaded, which the carrier folds in at its next round end), as a
decoupled member continues from the global weights minus its own row in flight
(`OuterCore.rebased`). An upload that did not go through is not lost: its progress stays
in the next row, trained from the new download.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarryRefused
from archipelago.federation.carry_link import CarryClient, Download
from archipelago.federation.codecs import build_codec
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outcome import FederationError
from archipelago.federation.seam import Alone, IslandHooks
from archipelago.federation.trust import FederationKey

log = logging.getLogger("archipelago.federation")


class ThinIsland(Alone):
    """A thin island's side of the seam (a `Federation`): see the module doc."""

    def __init__(self, ft: FaultToleranceConfig, steps: int, params: Sequence[torch.Tensor], rank: int,
                 world_size: int, key: FederationKey | None, hooks: IslandHooks,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(steps)
        if key is None:
            raise FederationError("a thin island (fault_tolerance.carrier) needs a federation key: without one "
                                  "nothing tells its carrier's weights from anyone's. Set "
                                  "federation_security.key_file (archipelago keygen)")
        self.ft, self.hooks, self.every = ft, hooks, ft.sync_steps * ft.carry_rounds
        self.ranks = IslandRanks(world_size, group)
        self.layout = FlatLayout(params, 1, rank, world_size, group)
        bridge = self.layout.is_bridge
        self.client = (CarryClient(key, ft.replica_id, ft.carrier_island, ft.carrier, self.layout.numel,
                                   ft.quorum_timeout_ms / 1000) if bridge else None)
        self.codec = build_codec(ft, self.layout.numel) if bridge else None
        self.download: Download | None = None  # the weights its next row is trained from (bridge rank)
        self.base: torch.Tensor | None = None  # its weights at that download (bridge rank)
        self.local_step, self.tokens, self.uploaded = 0, 0, 0

    @property
    def at_round_end(self) -> bool:
        return self.local_step == 0

    def join(self, step: int) -> None:
        """Download the global weights (waiting up to join_wait_ms for a carrier that has
        none yet) and continue from them."""
        self.hooks.event("join", step=step, island=self.ft.replica_id, carrier=self.ft.carrier)
        if step > 0:
            log.warning("a thin island resumes from its carrier's weights: the progress since its last upload "
                        "before the restart is not sent")
        got = self._download(self.ft.join_wait_ms / 1000) if self.client is not None else None
        failed = self.ranks.max([float(self.client is not None and got is None)])[0] > 0
        if failed:
            raise FederationError(f"no global weights from the carrier at {self.ft.carrier} within "
                                  f"fault_tolerance.join_wait_ms ({self.ft.join_wait_ms} ms): is the carrier "
                                  f"island {self.ft.carrier_island} running with carries = {self.ft.replica_id}?")
        self.layout.scatter(got.weights if got is not None else None)
        if got is not None:
            self.download, self.base = got, got.weights.clone()
            log.info("thin island %d: took the global weights of outer step %d from island %d; uploads every %d "
                     "inner steps", self.ft.replica_id, got.step, self.ft.carrier_island, self.every)

    def after_step(self, step: int, tokens: int, compute_s: float) -> None:
        self.local_step += 1
        self.tokens += tokens
        if self.local_step == self.every:
            self.local_step = 0
            self.carry(step)

    def finish_rounds(self) -> None:
        """The progress since the last upload goes up too (if the carrier still takes it)."""
        if self.tokens:
            self.carry(self.hooks.step, last=True)
        self.local_step = 0

    def leave(self) -> None:
        self.hooks.event("leave", step=self.hooks.step, island=self.ft.replica_id, uploads=self.uploaded)

    # ---- one carry: upload, download, continue --------------------------------------

    def carry(self, step: int, last: bool = False) -> None:
        """Upload the progress since the last download, take the newest global weights
        minus that progress (a collective over the island)."""
        local = self.layout.gather()
        began = time.perf_counter()
        new = self._exchange(local, step, last) if local is not None else None
        if local is not None:  # the seconds this island did not train (upload and download)
            self.hooks.event("carry", step=step, island=self.ft.replica_id, uploads=self.uploaded,
                             carry_s=round(time.perf_counter() - began, 3))
        if not last:
            changed = self.ranks.max([float(new is not None)])[0] > 0
            if changed:
                self.layout.scatter(new)

    def _exchange(self, local: torch.Tensor, step: int, last: bool) -> torch.Tensor | None:
        """The bridge rank's part: the upload, then (unless `last`) the download; the
        island's new weights, or None to train on from its own."""
        assert self.client is not None and self.codec is not None and self.base is not None
        pseudo = self.base - local.float()
        sent = self._upload(pseudo, step)
        if last:
            return None
        got = self._download(0.0)
        if got is None:  # train on from its own weights; the next row holds what this one did not send
            if sent:
                self.base = local.float().clone()
            return None
        self.download = got
        new = got.weights - pseudo  # its own progress is not in the global weights yet
        self.base = new.clone() if sent else got.weights.clone()
        return new

    def _upload(self, pseudo: torch.Tensor, step: int) -> bool:
        assert self.client is not None and self.codec is not None
        if self.download is None:
            return False
        try:
            self.client.upload(self.download, self.tokens, self.codec, pseudo)
        except (CarryRefused, ConnectionError) as exc:
            log.warning("thin island %d: upload at inner step %d not taken (%s); its progress goes with the next",
                        self.ft.replica_id, step, exc)
            self.hooks.event("refused", step=step, island=self.ft.replica_id, by="carrier", reason=str(exc))
            return False
        self.hooks.event("upload", step=step, island=self.ft.replica_id, tokens=self.tokens,
                         base_step=self.download.step, norm=float(pseudo.norm()))
        self.uploaded += 1
        self.tokens, self.download = 0, None
        return True

    def _download(self, wait_s: float) -> Download | None:
        """The carrier's global weights, retried for up to `wait_s` while it cannot be
        reached or has none yet; None if they could not be had. A refusal (another key,
        another carrier, another model) is a configuration error: FederationError."""
        assert self.client is not None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.client.download()
            except CarryRefused as exc:
                raise FederationError(f"thin island {self.ft.replica_id}: {exc}. Check fault_tolerance.carrier, "
                                      "carrier_island and the federation key on both islands") from exc
            except ConnectionError as exc:
                if time.monotonic() >= deadline:
                    log.warning("thin island %d: no download (%s); trains on from its own weights",
                                self.ft.replica_id, exc)
                    return None
            time.sleep(1.0)
