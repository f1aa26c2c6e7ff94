"""A thin island carried by a member: the messages between them, signed and judged.

An island whose link cannot carry a round's exchange stays out of the members' exchange
(docs/rounds.md, "Thin links"): it downloads the global weights from one member, its
carrier, trains several rounds, and uploads its pseudo-gradient to the carrier, which folds
it into its own row (`OuterCore.fold`). This module is what crosses between the two, and
what each side checks of the other's bytes (the other island belongs to another owner):

* `CARRY_REQUEST`: the thin island asks for the global weights, signed, with a fresh nonce
  (the carrier answers each nonce once: a recorded request fetches nothing).
* `GLOBAL_WEIGHTS`: the carrier's global weights (bf16) at outer step n, signed by the
  carrier, bound to that nonce (no recorded answer is taken twice) and to the thin island
  it was served to.
* `CARRIED_ROW`: the thin island's encoded pseudo-gradient, signed by it, naming the
  download it trained from by that nonce. The carrier accepts it only for a download it
  served to that island (`CarrierBook`): the staleness discount follows the step the
  carrier knows it served, never a step the thin island claims; each download carries at
  most one row in, and rows are judged as any receiver judges one (claims against the
  island's allowance, a decodable payload, finite values, the norm bound).

The legs over the network are federation/carry_link.py (the thin island downloads and
uploads; the carrier only serves). Both sides need a federation key: without one nothing
could tell the carrier's weights from anyone's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from archipelago.federation.codecs import Codec, PayloadError
from archipelago.federation.policy import Allowance, Contribution, judge_contributions
from archipelago.federation.trust import FederationKey, FrameHeader, FrameRefused, open_frame, seal

CARRIED_ROW = 10     # frame kind: a thin island's encoded pseudo-gradient, uploaded to its carrier
GLOBAL_WEIGHTS = 11  # frame kind: the carrier's global weights, downloaded by a thin island
CARRY_REQUEST = 12   # frame kind: a thin island's request for them (empty payload)
NONCE_LIMIT = 2 ** 63  # a nonce travels in the frame's quorum field (unsigned 64 bits)


class CarryRefused(ValueError):
    """An upload or download that the receiving side does not take (the reason is the message)."""


@dataclass(frozen=True)
class Upload:
    """A thin island's row as its carrier accepted it: the step of the global weights it
    trained from (as the carrier served them), its tokens, its decoded values."""

    island: int
    base_step: int
    tokens: float
    values: torch.Tensor


def pack_request(key: FederationKey, island: int, nonce: int) -> bytes:
    """Thin `island`'s signed request for the global weights, for the fresh `nonce`."""
    return seal(key, FrameHeader(_nonce(nonce), 0, 0, island, CARRY_REQUEST), b"")


def pack_weights(key: FederationKey, carrier: int, island: int, nonce: int, step: int,
                 weights: torch.Tensor) -> bytes:
    """The carrier's answer to a download: `weights` in bf16 at outer `step`, for thin
    `island`'s request `nonce`, signed by the carrier. (The island rides in the fragment
    field, so an answer to one thin island is no answer to another.)"""
    body = weights.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    return seal(key, FrameHeader(_nonce(nonce), step, island, carrier, GLOBAL_WEIGHTS), body)


def open_weights(key: FederationKey, carrier: int, island: int, nonce: int, numel: int,
                 frame: bytes) -> tuple[int, torch.Tensor]:
    """(outer step, fp32 weights) of the carrier's answer to this island's request `nonce`;
    CarryRefused for anything else: another signer, request or island, a wrong size,
    values that are not finite."""
    try:
        header, body = open_frame(key, frame, FrameHeader(_nonce(nonce), 0, island, carrier, GLOBAL_WEIGHTS),
                                  any_step=True)
    except FrameRefused as exc:
        raise CarryRefused(f"global weights refused: {exc}") from exc
    if len(body) != 2 * numel:
        raise CarryRefused(f"global weights of {len(body)} bytes, expected {2 * numel} ({numel} bf16 values)")
    weights = torch.frombuffer(bytearray(body), dtype=torch.bfloat16).float()
    if not bool(torch.isfinite(weights).all()):
        raise CarryRefused("global weights with values that are not finite")
    return header.step, weights


def pack_row(key: FederationKey, island: int, nonce: int, tokens: float, codec: Codec,
             values: torch.Tensor) -> bytes:
    """Thin `island`'s upload: `values` (its pseudo-gradient) encoded with `codec`, for the
    download `nonce` it trained from, claiming `tokens`."""
    payload = codec.encode(values.detach().float()).cpu().numpy().tobytes()
    return seal(key, FrameHeader(_nonce(nonce), 0, 0, island, CARRIED_ROW, int(tokens), float(tokens)), payload)


class CarrierBook:
    """The carrier's side: the downloads it served (thin island, nonce -> outer step), at
    most `remember` per island, each good for one upload."""

    def __init__(self, key: FederationKey, carrier: int, thin: set[int], remember: int = 8) -> None:
        self.key, self.carrier, self.thin, self.remember = key, carrier, set(thin), remember
        self.served: dict[int, OrderedDict[int, int]] = {island: OrderedDict() for island in self.thin}
        self.answered: dict[int, set[int]] = {}  # every nonce answered, per island (8 bytes each)

    def answer(self, request: bytes, step: int, weights: torch.Tensor) -> bytes:
        """The signed answer to a thin island's request (`pack_request`): the global weights
        at outer `step`; CarryRefused for a request not signed by a thin island this member
        carries, or one whose nonce it answered before (a recorded request)."""
        try:
            header, _ = open_frame(self.key, request, FrameHeader(0, 0, 0, 0, CARRY_REQUEST),
                                   any_island=True, any_quorum=True)
        except FrameRefused as exc:
            raise CarryRefused(f"request refused: {exc}") from exc
        if header.quorum in self.answered.get(header.island, ()):
            raise CarryRefused(f"request of island {header.island} refused: its nonce was answered before (a replay)")
        return self.serve(header.island, header.quorum, step, weights)

    def serve(self, island: int, nonce: int, step: int, weights: torch.Tensor) -> bytes:
        """The signed answer to `island`'s download request `nonce` (already checked), remembered."""
        if island not in self.thin:
            raise CarryRefused(f"island {island} is not a thin island this member carries")
        self.answered.setdefault(island, set()).add(_nonce(nonce))
        book = self.served[island]
        book[nonce] = step
        while len(book) > self.remember:
            book.popitem(last=False)
        return pack_weights(self.key, self.carrier, island, nonce, step, weights)

    def receive(self, frame: bytes, codec: Codec, allowance: Allowance, weighting: str = "tokens") -> Upload:
        """An upload, opened and judged; CarryRefused (naming why) for a frame not signed by
        a thin island this member carries, not for a download it served that island (or one
        already used), a malformed payload, or claims and values a receiver would refuse."""
        try:
            header, payload = open_frame(self.key, frame, FrameHeader(0, 0, 0, 0, CARRIED_ROW),
                                         any_island=True, any_quorum=True)
        except FrameRefused as exc:
            raise CarryRefused(f"upload refused: {exc}") from exc
        island = header.island
        if island not in self.thin:
            raise CarryRefused(f"upload refused: island {island} is not a thin island this member carries")
        base_step = self.served[island].pop(header.quorum, None)
        if base_step is None:
            raise CarryRefused(f"upload of island {island} refused: it names no download this member served it "
                               "(unknown, forgotten or already used)")
        try:
            values = codec.decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        except (PayloadError, RuntimeError, ValueError) as exc:
            raise CarryRefused(f"upload of island {island} refused: its payload is malformed ({exc})") from exc
        if not bool(torch.isfinite(values).all()):  # also under a claimed weight of 0, which judging lets pass
            raise CarryRefused(f"upload of island {island} refused: non-finite values")
        row = Contribution(float(header.tokens), header.weight, norm=float(values.double().norm()))
        verdict = judge_contributions([row], [allowance], weighting, 0.0)[0]
        if not verdict.accepted:
            raise CarryRefused(f"upload of island {island} refused: {verdict.reason}"
                               + (CARRIED_TOKENS_FIX if row.tokens > allowance.max_tokens else ""))
        return Upload(island, base_step, float(header.tokens), values)


# What a refused token claim means on a carrier: its allowance is `carried_tokens`.
CARRIED_TOKENS_FIX = ("; a carrier allows one upload fault_tolerance.carried_tokens: if the thin island trains that "
                      "many in carry_rounds rounds (time-paced: up to its tokens per step x max_inner_steps x "
                      "carry_rounds), raise carried_tokens on the carrier")


def _nonce(nonce: int) -> int:
    if not 0 <= nonce < NONCE_LIMIT:
        raise ValueError(f"nonce {nonce} outside [0, 2^63)")
    return nonce
