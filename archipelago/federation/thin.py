"""A thin island behind the seam (`fault_tolerance.carrier`): trains on its own, and every
`carry_rounds` rounds (of `sync_steps` inner steps, or of `round_seconds` under time pacing)
uploads its progress to the member carrying it and downloads the global weights
(docs/rounds.md, "Thin links").

A thin island is no torchft replica: a replica that sat out a round's quorum while
heartbeating would make the members' next quorum wait for it. It talks to its carrier
only (carry_link.py: it connects, the carrier serves), and what it sends enters the
federation inside the carrier's row (`OuterCore.fold`). Its requests carry its carry token,
derived from its local key (carry.py): the carrier serves no other once it has seen it, so
the island must keep that key file across restarts (as it must to load its checkpoints).

The upload and the download travel on a thread while the island trains on, so a thin
link costs it no compute (only the carry's gather and scatter, and a wait if a carry is
still travelling when the next is due). When the download lands, the island's weights and
its base move by what the global weights moved since the row's base: its progress since
the upload stays its own, and its row in flight, not in those global weights yet (the
carrier folds it in at its next round end), is not taken back (as a decoupled member
continues from the global weights minus its own row in flight, `OuterCore.rebased`). An
upload that did not go through is not lost: its progress stays in the next row, trained
from the new download. Its checkpoint keeps its base and the tokens since its last upload,
so a restarted thin island moves its progress onto a fresh download instead of losing it
(a carry in flight at the save counts as sent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from archipelago.checkpoint.signing import CheckpointKeyError, default_key_path, load_or_create_key
from archipelago.config.errors import ConfigError
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarryRefused, derive_carry_token, use_carry_token
from archipelago.federation.carry_link import CarryClient, Download
from archipelago.federation.carrying import carry_codec
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outcome import FederationError
from archipelago.federation.policy import round_is_up
from archipelago.federation.seam import Alone, IslandHooks
from archipelago.federation.trust import FederationKey

log = logging.getLogger("archipelago.federation")


@dataclass(frozen=True)
class NotSent:
    """Why a row did not go in: the carrier refused it, or the island held it back (its
    download is of the outer step its last row taken was trained from, and the carrier
    takes one row a round, carry.py). Either way its progress goes with the next row."""

    reason: str
    refused: bool


@dataclass
class Sending:
    """A carry in flight: the row's base weights, the island's weights when it was sent,
    its tokens, the outer step its base was downloaded at, when it started."""

    base: torch.Tensor
    local: torch.Tensor
    tokens: int
    base_step: int  # the outer step of the download it trained from
    started: float


class ThinIsland(Alone):
    """A thin island's side of the seam (a `Federation`): see the module doc."""

    def __init__(self, ft: FaultToleranceConfig, steps: int, params: Sequence[torch.Tensor], rank: int,
                 world_size: int, key: FederationKey | None, hooks: IslandHooks,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(steps)
        if key is None:
            raise ConfigError("a thin island (fault_tolerance.carrier) needs a federation key: without one "
                              "nothing tells its carrier's weights from anyone's. Set "
                              "federation_security.key_file (`archipelago secret new` makes one)")
        self.ft, self.hooks, self.every = ft, hooks, ft.sync_steps * ft.carry_rounds
        # Time pacing: a carry every carry_rounds x round_seconds of inner steps, timed like
        # the members' rounds (policy.round_is_up), from the join and from each carry.
        self.time_paced = ft.round_pacing == "time"
        self.clock = self.last_step_end = time.monotonic()
        self.ranks, self.rank = IslandRanks(world_size, group), rank
        self.layout = FlatLayout(params, 1, rank, world_size, group)
        bridge = self.layout.is_bridge
        if bridge:
            _take_carry_token(key, ft.replica_id)
        self.client = (CarryClient(key, ft.replica_id, ft.carrier_island, ft.carrier, self.layout.numel,
                                   ft.quorum_timeout_ms / 1000) if bridge else None)
        self.codec = carry_codec(ft, self.layout.numel) if bridge else None
        self.download: Download | None = None  # the weights its next row is trained from (bridge rank)
        self.base: torch.Tensor | None = None  # its weights at that download (bridge rank)
        self.local_step, self.tokens, self.uploaded = 0, 0, 0
        # The carry in flight: the upload and download run on a thread while the island trains.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archipelago-carry")
        self.in_flight: Future[tuple[NotSent | None, Download | None]] | None = None
        self.taken_step: int | None = None  # the outer step the last row taken was trained from
        self.sending: Sending | None = None
        self.restored: dict[str, Any] | None = None  # from a checkpoint, until the join takes it

    @property
    def at_round_end(self) -> bool:
        return self.local_step == 0

    def join(self, step: int) -> None:
        """Download the global weights (waiting up to join_wait_ms for a carrier that has
        none yet) and continue from them."""
        self.hooks.event("join", step=step, island=self.ft.replica_id, carrier=self.ft.carrier)
        got = self._download(self.ft.join_wait_ms / 1000) if self.client is not None else None
        failed = self.ranks.max([float(self.client is not None and got is None)])[0] > 0
        if failed:
            raise FederationError(f"no global weights from the carrier at {self.ft.carrier} within "
                                  f"fault_tolerance.join_wait_ms ({self.ft.join_wait_ms} ms): is the carrier "
                                  f"island {self.ft.carrier_island} running with carries = {self.ft.replica_id}?")
        self.layout.scatter(self._resumed(got) if self.restored is not None else
                            got.weights if got is not None else None)
        if got is not None:
            self.download, self.base = got, got.weights.clone()
            log.info("thin island %d: took the global weights of outer step %d from island %d; uploads every %s",
                     self.ft.replica_id, got.step, self.ft.carrier_island, self._interval())
        self.clock = self.last_step_end = time.monotonic()

    def _resumed(self, got: Download | None) -> torch.Tensor | None:
        """After a restart (a collective over the island): the checkpointed weights moved by
        what the global weights moved since the checkpointed base, so the progress since the
        last upload goes with the next row; its tokens and its steps towards the next carry
        come back too."""
        restored, self.restored = self.restored, None
        assert restored is not None
        self.tokens, self.local_step = int(restored["tokens"]), int(restored["local_step"])
        local = self.layout.gather()
        base = restored.get(f"bridge{self.rank}")
        if got is None or local is None or base is None or not int(restored["has_base"]):
            return got.weights if got is not None else None
        log.info("thin island %d resumes: its progress since its last upload (%d tokens) moves onto the global "
                 "weights of outer step %d", self.ft.replica_id, self.tokens, got.step)
        return got.weights + (local.float() - base)

    # ---- checkpoint (DCP Stateful) -------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        return {"federation": self}

    def state_dict(self) -> dict[str, Any]:
        """The tokens and inner steps since the last carry on every rank; on the bridge rank
        the base its next row is measured from (zeros and has_base 0 before any download)."""
        state: dict[str, Any] = {"tokens": self.tokens, "local_step": self.local_step,
                                 "has_base": int(self.base is not None)}
        if self.layout.is_bridge:
            state[f"bridge{self.rank}"] = (self.base if self.base is not None
                                           else torch.zeros(self.layout.numel, dtype=torch.float32))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = dict(state)

    def after_step(self, step: int, tokens: int, compute_s: float) -> None:
        self.local_step += 1
        self.tokens += tokens
        # One agreement over the island's ranks per step: is a carry due, has one landed?
        due, landed = self.ranks.max([float(self._due()), float(self.in_flight is not None and self.in_flight.done())])
        if due > 0:
            self.local_step = 0
            self.carry(step)
            self.clock = time.monotonic()
        elif landed > 0:
            self.finish_carry(step)

    def _due(self) -> bool:
        """This rank's view: the inner steps (or, time-paced, the seconds) of `carry_rounds`
        rounds since the last carry are done."""
        now = time.monotonic()
        step_s, self.last_step_end = now - self.last_step_end, now
        if not self.time_paced:
            return self.local_step == self.every
        ft = self.ft
        return round_is_up(self.local_step, ft.min_inner_steps * ft.carry_rounds, ft.max_inner_steps * ft.carry_rounds,
                           now - self.clock, step_s, ft.round_seconds * ft.carry_rounds)

    def _interval(self) -> str:
        if self.time_paced:
            return f"{self.ft.round_seconds * self.ft.carry_rounds:g} s of inner steps"
        return f"{self.every} inner steps"

    def finish_rounds(self) -> None:
        """The carry in flight lands; the progress since the last upload goes up too (if
        the carrier still takes it)."""
        self.finish_carry(self.hooks.step)
        if self.tokens:
            local = self.layout.gather()
            if local is not None and self.base is not None:
                base_step = self._base_step
                outcome = self._upload(self.base - local.float(), self.tokens)
                self._report(outcome, None, self.hooks.step, 0.0, self.tokens, base_step)
        self.local_step = 0

    def leave(self) -> None:
        self.hooks.event("leave", step=self.hooks.step, island=self.ft.replica_id, uploads=self.uploaded)

    def shutdown(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    # ---- one carry: upload and download travel while the island trains ---------------

    @property
    def _base_step(self) -> int:
        """The outer step of the download its next row trains from (0: none)."""
        return self.download.step if self.download is not None else 0

    def carry(self, step: int) -> None:
        """Hand the progress since the last download to a thread that uploads it and
        downloads the newest global weights, and train on (a collective over the island).
        A carry still in flight from the last time is waited for first."""
        self.finish_carry(step)
        local = self.layout.gather()
        if local is None or self.base is None:
            return
        pseudo, tokens = self.base - local.float(), self.tokens
        self.sending = Sending(self.base, local.float().clone(), tokens, self._base_step, time.perf_counter())
        self.base, self.tokens = self.sending.local, 0  # its progress is in flight
        self.in_flight = self.worker.submit(self._travel, pseudo, tokens)

    def _travel(self, pseudo: torch.Tensor, tokens: int) -> tuple[NotSent | None, Download | None]:
        """On the thread: the upload (None, or why it was not taken), then the download."""
        outcome = self._upload(pseudo, tokens)
        return outcome, self._download(0.0)

    def finish_carry(self, step: int) -> None:
        """The carry in flight has landed (or is waited for): shift the island's weights by
        what the global weights moved since the row's base (its own progress since stays),
        or, if nothing came down, train on from its own."""
        blocked = time.perf_counter()
        landed = self.in_flight.result() if self.in_flight is not None else None
        pending = self.ranks.max([float(landed is not None)])[0] > 0
        if not pending:
            return
        local = self.layout.gather()
        new = None
        if landed is not None:
            sending = self.sending
            assert sending is not None and local is not None
            outcome, got = landed
            self.in_flight, self.sending = None, None
            sent = outcome is None
            if got is not None:
                shift = got.weights - sending.base
                new = local.float() + shift
                self.base = sending.local + shift if sent else got.weights.clone()
                self.download = got
            elif not sent:
                self.base = sending.base
            if not sent:
                self.tokens += sending.tokens
            self._report(outcome, sending, step, time.perf_counter() - blocked)
        if self.ranks.max([float(new is not None)])[0] > 0:
            self.layout.scatter(new)

    def _report(self, outcome: NotSent | None, sending: Sending | None, step: int, blocked_s: float,
                tokens: int = 0, base_step: int = 0) -> None:
        if outcome is not None and outcome.refused:
            log.warning("thin island %d: upload not taken (%s); its progress goes with the next",
                        self.ft.replica_id, outcome.reason)
            self.hooks.event("refused", step=step, island=self.ft.replica_id, by="carrier", reason=outcome.reason)
        elif outcome is not None:
            log.info("thin island %d: upload held back (%s); its progress goes with the next",
                     self.ft.replica_id, outcome.reason)
        else:
            self.uploaded += 1
            if sending is not None:
                tokens, base_step = sending.tokens, sending.base_step
            self.hooks.event("upload", step=step, island=self.ft.replica_id, tokens=tokens, base_step=base_step)
        if sending is not None:  # the seconds it did not train: waiting for the carry, taking its result
            self.hooks.event("carry", step=step, island=self.ft.replica_id, uploaded=outcome is None,
                             held=outcome is not None and not outcome.refused, uploads=self.uploaded,
                             tokens=sending.tokens, travel_s=round(time.perf_counter() - sending.started, 3),
                             carry_s=round(blocked_s, 3))

    def _upload(self, pseudo: torch.Tensor, tokens: int) -> NotSent | None:
        """Send `pseudo`, trained from the last download; None when the carrier took it,
        else why not. A row trained from the outer step the last row taken was trained from
        is held back, not sent: the carrier takes one row a round and would refuse it (the
        carrier's rounds are slower than this island's carries, or it did not commit)."""
        assert self.client is not None and self.codec is not None
        if self.download is None:
            return NotSent("no download to train from (the last one failed)", refused=True)
        if self.taken_step is not None and self.download.step <= self.taken_step:
            return NotSent(f"the carrier has committed no round since outer step {self.download.step}, the one "
                           "its last row taken was trained from (one row a round)", refused=False)
        download, self.download = self.download, None  # each download carries one row
        try:
            self.client.upload(download, tokens, self.codec, pseudo)
        except (CarryRefused, ConnectionError) as exc:
            return NotSent(str(exc), refused=True)
        self.taken_step = download.step
        return None

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


def _take_carry_token(key: FederationKey, island: int) -> None:
    """Ask the carrier with the carry token this machine's local key gives (the same after a
    restart): the carrier serves no other once it has seen it (carry.py)."""
    path = default_key_path()
    try:
        local_key, _ = load_or_create_key(path)
    except CheckpointKeyError as exc:
        raise ConfigError(f"a thin island derives its carry token from its local key: {exc}") from exc
    token = derive_carry_token(local_key, key, island)
    use_carry_token(key, island, token)
    log.info("thin island %d: carry token %s... (from the local key %s: keep that file, the carrier serves no "
             "other token)", island, token[:4], path)
