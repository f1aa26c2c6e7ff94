"""A thin island carried by a member: the messages between them, signed and judged.

An island whose link cannot carry a round's exchange stays out of the members' exchange
(docs/rounds.md, "Thin links"): it downloads the global weights from one member, its
carrier, trains several rounds, and uploads its pseudo-gradient to the carrier, which folds
it into its own row (`OuterCore.fold`). This module is what crosses between the two, and
what each side checks of the other's bytes (the other island belongs to another owner):

* `CARRY_REQUEST`: the thin island asks for the global weights, signed, with a fresh nonce
  (the carrier answers each nonce once: a recorded request fetches nothing) and its carry
  token (below).
* `GLOBAL_WEIGHTS`: the carrier's global weights (bf16) at outer step n, signed by the
  carrier, bound to that nonce (no recorded answer is taken twice) and to the thin island
  it was served to.
* `CARRIED_ROW`: the thin island's encoded pseudo-gradient, signed by it, naming the
  download it trained from by that nonce. The carrier accepts it only for a download it
  served to that island (`CarrierBook`): the staleness discount follows the step the
  carrier knows it served, never a step the thin island claims; each download carries at
  most one row in, one row a round (of the downloads served at one outer step, one row:
  a carrier row with two would claim more tokens than the carrier declared, and every
  receiver would refuse it whole), and rows are judged as any receiver judges one (claims
  against the island's allowance, a decodable payload, finite values, the norm bound).

Every member holds the federation secret, so a signature under the thin island's key
proves only that the signer is some member. What binds a carry to the one thin island is
its carry token: 16 bytes the thin island derives from its local key (the one that signs
its checkpoints, checkpoint/signing.py, which never leaves its machine), the same across
its restarts. The carrier serves the first token it is asked with and no other for as long
as it runs (`CarrierBook`), and keeps one download outstanding per thin island, the last
one that token made: a member asking in the thin island's name, without that token, gets
nothing, and cannot push the thin island's download out of the book. The token crosses
the network in the clear (as member tokens do), so a member on the path can copy it.

The legs over the network are federation/carry_link.py (the thin island downloads and
uploads; the carrier only serves). Both sides need a federation key: without one nothing
could tell the carrier's weights from anyone's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass

import torch

from archipelago.federation.codecs import Codec, PayloadError
from archipelago.federation.policy import Allowance, Contribution, judge_contributions
from archipelago.federation.trust import FederationKey, FrameHeader, FrameRefused, open_frame, seal

CARRIED_ROW = 10     # frame kind: a thin island's encoded pseudo-gradient, uploaded to its carrier
GLOBAL_WEIGHTS = 11  # frame kind: the carrier's global weights, downloaded by a thin island
CARRY_REQUEST = 12   # frame kind: a thin island's request for them (payload: its carry token)
NONCE_LIMIT = 2 ** 63  # a nonce travels in the frame's quorum field (unsigned 64 bits)
CARRY_TOKEN_BYTES = 16  # a carry token: 32 hex characters in a request's payload
_CARRY_TOKEN = re.compile(rb"[0-9a-f]{%d}" % (2 * CARRY_TOKEN_BYTES))

log = logging.getLogger("archipelago.federation")


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


# This process's carry token per (federation, thin island), what `pack_request` sends: the
# thin island sets the one its local key gives (`use_carry_token`); any other process that
# asks gets a random one of its own. Keyed by process id too: a forked child makes its own.
_TOKENS: dict[tuple[int, bytes, int], str] = {}
_TOKENS_LOCK = threading.Lock()


def derive_carry_token(local_key: bytes, key: FederationKey, island: int) -> str:
    """Thin `island`'s carry token in `key`'s federation: an HMAC under the island's local
    key (checkpoint/signing.py), which no other member holds; the same at every restart on
    the machine that keeps that key."""
    message = b"archipelago carry token\n" + key.federation_id + b"\n%d" % island
    return hmac.new(local_key, message, hashlib.sha256).digest()[:CARRY_TOKEN_BYTES].hex()


def use_carry_token(key: FederationKey, island: int, token: str) -> None:
    """Send `token` in this process's requests as thin `island` (`derive_carry_token`)."""
    if _CARRY_TOKEN.fullmatch(token.encode("ascii", "replace")) is None:
        raise ValueError(f"a carry token is {2 * CARRY_TOKEN_BYTES} lowercase hex characters (derive_carry_token)")
    with _TOKENS_LOCK:
        _TOKENS[(os.getpid(), key.federation_id, island)] = token


def carry_token(key: FederationKey, island: int) -> str:
    """The carry token this process asks with as thin `island` (random unless set)."""
    with _TOKENS_LOCK:
        return _TOKENS.setdefault((os.getpid(), key.federation_id, island), secrets.token_hex(CARRY_TOKEN_BYTES))


def pack_request(key: FederationKey, island: int, nonce: int, token: str | None = None) -> bytes:
    """Thin `island`'s signed request for the global weights, for the fresh `nonce`, with its
    carry `token` (this process's, `carry_token`, unless given)."""
    token = carry_token(key, island) if token is None else token
    return seal(key, FrameHeader(_nonce(nonce), 0, 0, island, CARRY_REQUEST), token.encode("ascii"))


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
    """The carrier's side, per thin island it carries: the carry token it serves (the first
    one it was asked with), the one download outstanding (the last that token made: nonce
    and outer step), and the outer step the last row it took was trained from (one row a
    round)."""

    def __init__(self, key: FederationKey, carrier: int, thin: set[int]) -> None:
        self.key, self.carrier, self.thin = key, carrier, set(thin)
        self.tokens: dict[int, str] = {}  # thin island -> the carry token served
        self.outstanding: dict[int, tuple[int, int]] = {}  # thin island -> (nonce, outer step)
        self.carried_step: dict[int, int] = {}  # thin island -> base step of the last row taken
        self.answered: dict[int, set[int]] = {}  # every nonce answered, per island (8 bytes each)

    def answer(self, request: bytes, step: int, weights: torch.Tensor) -> bytes:
        """The signed answer to a thin island's request (`pack_request`): the global weights
        at outer `step`; CarryRefused for a request not signed by a thin island this member
        carries, without the carry token it serves that island, or whose nonce it answered
        before (a recorded request)."""
        try:
            header, payload = open_frame(self.key, request, FrameHeader(0, 0, 0, 0, CARRY_REQUEST),
                                         any_island=True, any_quorum=True)
        except FrameRefused as exc:
            raise CarryRefused(f"request refused: {exc}") from exc
        island = header.island
        if island not in self.thin:
            raise CarryRefused(f"island {island} is not a thin island this member carries")
        token = self._holder(island, payload)
        if header.quorum in self.answered.get(island, ()):
            raise CarryRefused(f"request of island {island} refused: its nonce was answered before (a replay)")
        if island not in self.tokens:
            self.tokens[island] = token
            log.info("carry: island %d carries thin island %d for carry token %s... (the first it was asked "
                     "with): no other is served while this island runs", self.carrier, island, token[:4])
        return self.serve(island, header.quorum, step, weights)

    def _holder(self, island: int, payload: bytes) -> str:
        """The carry token of a request: the one this member serves `island`, else CarryRefused."""
        if _CARRY_TOKEN.fullmatch(payload) is None:
            raise CarryRefused(f"request of island {island} refused: it holds no carry token (a thin island of "
                               "an older archipelago: run the same version on both islands)")
        token, held = payload.decode("ascii"), self.tokens.get(island)
        if held is not None and not hmac.compare_digest(held, token):
            raise CarryRefused(
                f"request of island {island} refused: this member carries thin island {island} for another carry "
                f"token ({held[:4]}..., the first it was asked with). A thin island derives its token from its "
                "local key ($ARCHIPELAGO_CHECKPOINT_KEY_FILE, else ~/.config/archipelago/checkpoint.key): run it "
                "with the key file it first ran with, or restart the carrier island to take another; if the thin "
                "island did not change, another member is asking in its name")
        return token

    def serve(self, island: int, nonce: int, step: int, weights: torch.Tensor) -> bytes:
        """The signed answer to `island`'s download request `nonce` (already checked), now the
        download its next row must name (the one before is forgotten: the thin island trains
        from the last download it got)."""
        if island not in self.thin:
            raise CarryRefused(f"island {island} is not a thin island this member carries")
        self.answered.setdefault(island, set()).add(_nonce(nonce))
        self.outstanding[island] = (nonce, step)
        return pack_weights(self.key, self.carrier, island, nonce, step, weights)

    def receive(self, frame: bytes, codec: Codec, allowance: Allowance, weighting: str = "tokens") -> Upload:
        """An upload, opened and judged; CarryRefused (naming why) for a frame not signed by
        a thin island this member carries, not for the download it has outstanding for that
        island, a malformed payload, claims and values a receiver would refuse, or a second
        row trained from the weights of one outer step."""
        try:
            header, payload = open_frame(self.key, frame, FrameHeader(0, 0, 0, 0, CARRIED_ROW),
                                         any_island=True, any_quorum=True)
        except FrameRefused as exc:
            raise CarryRefused(f"upload refused: {exc}") from exc
        island = header.island
        if island not in self.thin:
            raise CarryRefused(f"upload refused: island {island} is not a thin island this member carries")
        served = self.outstanding.get(island)
        if served is None or served[0] != header.quorum:
            raise CarryRefused(f"upload of island {island} refused: it names no download this member has "
                               "outstanding for it (unknown, already used, or followed by a later download)")
        del self.outstanding[island]  # used, whatever comes of it
        base_step = served[1]
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
        self._one_a_round(island, base_step)
        return Upload(island, base_step, float(header.tokens), values)

    def _one_a_round(self, island: int, base_step: int) -> None:
        """Take one row a round: one trained from a later download than the last row taken.
        Two in one carrier row would claim more tokens than the carrier declared (it declares
        one upload's), and every receiver would refuse that row whole."""
        last = self.carried_step.get(island)
        if last is not None and base_step <= last:
            raise CarryRefused(f"upload of island {island} refused: trained from the weights of outer step "
                               f"{base_step}, and this member took its row trained from step {last} already (one "
                               "row a round: its progress stays on the thin island and goes with its next upload)")
        self.carried_step[island] = base_step


# What a refused token claim means on a carrier: its allowance is `carried_tokens`.
CARRIED_TOKENS_FIX = ("; a carrier allows one upload fault_tolerance.carried_tokens: if the thin island trains that "
                      "many in carry_rounds rounds (time-paced: up to its tokens per step x max_inner_steps x "
                      "carry_rounds), raise carried_tokens on the carrier")


def _nonce(nonce: int) -> int:
    if not 0 <= nonce < NONCE_LIMIT:
        raise ValueError(f"nonce {nonce} outside [0, 2^63)")
    return nonce
