"""A bridge rank's global state: its chunks of the global weights with their outer
optimizers (`OuterCore`), the codec that carries each fragment's rows (its error feedback
outlives a reset of the weights), the digests of the chunks and of the state a healing
peer takes, and all of it as checkpoint state. Only bridge ranks hold one; the outer loop
(diloco.OuterLoop) asks it for the global hash and its checkpoint, and healing
(healing.py) for the weights and optimizers a peer takes and the digest it claims of them.

Digests are compared across machines, so they hash canonical bytes: each tensor's values
in row-major order, little-endian, at its own dtype, in a fixed order (fragments in
order, an optimizer's tensors by name). Each fragment's are computed once per change of
that fragment (its outer step, a heal, a checkpoint load): a round of streaming DiLoCo
hashes the one fragment it stepped, its weights and its outer optimizer state (SGD's
momentum: twice the weights' bytes; AdamW's two moments: three times).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.codecs import Codec, build_codec
from archipelago.federation.fragments import load_tensor_state, tensor_state
from archipelago.federation.outer_core import OuterCore


class GlobalWeights:
    """One bridge rank's global chunks, their outer optimizers, codecs and digest."""

    def __init__(self, ft: FaultToleranceConfig) -> None:
        self.ft = ft
        self.core: OuterCore | None = None  # the global weights and outer optimizers (after `take`)
        self.codecs: list[Codec] = []       # one per fragment chunk
        self._weights: list[str | None] = []  # per fragment: its chunk's digest, until it changes
        self._outer: list[str | None] = []    # per fragment: its outer optimizer state's, likewise

    @property
    def globals(self) -> list[nn.Parameter]:
        return self.core.globals if self.core is not None else []

    @property
    def outer(self) -> list[torch.optim.Optimizer]:
        return self.core.outer if self.core is not None else []

    def take(self, chunks: Sequence[torch.Tensor]) -> None:
        """`chunks` (this rank's, one per fragment) become the global weights, with fresh
        outer optimizers; the codecs are kept when the fragments are the same."""
        self.core = OuterCore(self.ft, chunks, pin=torch.cuda.is_available())
        self.forget_digest()
        if len(self.codecs) != len(self.globals):  # codec state (error feedback) outlives a reset
            self.codecs = [build_codec(self.ft, g.numel()) for g in self.globals]

    def chunk_digest(self) -> str:
        """SHA-256 of the global chunks' digests (each hashed once per change of it): the
        round's global hash."""
        return weights_digest(self._weight_digests())

    def state_digest(self, stale: int | None) -> str:
        """What this rank claims of its state (policy.StateClaim.digest): a digest of all
        a healing peer takes of it, the global chunks, their outer optimizer state and under
        decoupled rounds `stale` (None otherwise); `offer_digest` of `Healing.state()`."""
        outer = self._outer
        for i, (g, o) in enumerate(zip(self.globals, self.outer)):
            if outer[i] is None:
                outer[i] = outer_digest(tensor_state(o, g))
        return state_digest(self._weight_digests(), [d for d in outer if d is not None], stale)

    def _weight_digests(self) -> list[str]:
        for i, g in enumerate(self.globals):
            if self._weights[i] is None:
                self._weights[i] = tensor_digest(g)
        return [d for d in self._weights if d is not None]

    def forget_digest(self, fragment: int | None = None) -> None:
        """The global chunk and outer optimizer state of `fragment` (None: of every one)
        changed: hash them again when asked."""
        count = len(self.globals)
        if fragment is None or len(self._weights) != count:
            self._weights, self._outer = [None] * count, [None] * count
        else:
            self._weights[fragment] = self._outer[fragment] = None

    def state(self) -> dict[str, Any]:
        """Checkpoint state: per fragment, the global chunk, its outer optimizer and codec."""
        return {f"fragment{i}": {"global": g.detach(), "outer": tensor_state(o, g), **_codec_state(c)}
                for i, (g, o, c) in enumerate(zip(self.globals, self.outer, self.codecs))}

    def load(self, saved: dict[str, Any]) -> None:
        """Back to a checkpoint's `state()`."""
        for i, (g, o, c) in enumerate(zip(self.globals, self.outer, self.codecs)):
            fragment = saved[f"fragment{i}"]
            load_tensor_state(o, g, fragment)
            c.load_state_dict(fragment.get("codec", {}))
        self.forget_digest()


def _codec_state(codec: Codec) -> dict[str, Any]:
    """The codec's state for a checkpoint, under "codec" (nothing for stateless codecs)."""
    state = codec.state_dict()
    return {"codec": state} if state else {}


# Integer types of each width: a big-endian host swaps a tensor's bytes through one of them.
_SAME_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's values: row-major, little-endian, at its own dtype (the same
    bytes on every machine). A contiguous CPU tensor is hashed in place, without a copy."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if sys.byteorder == "little" or flat.element_size() == 1:
        data = flat.view(torch.uint8).numpy()
    else:
        data = flat.view(_SAME_WIDTH[flat.element_size()]).numpy().byteswap()
    return hashlib.sha256(data.data).hexdigest()  # the array's buffer, in place


def weights_digest(fragments: Sequence[str]) -> str:
    """SHA-256 of the per-fragment `tensor_digest`s of the global chunks, in order."""
    return hashlib.sha256("".join(fragments).encode()).hexdigest()


def outer_digest(outer: dict[str, torch.Tensor]) -> str:
    """SHA-256 of one fragment's outer optimizer state (`fragments.tensor_state`: SGD's
    momentum, AdamW's step and moments, nothing without momentum): by name, each tensor's
    dtype, shape and `tensor_digest`."""
    parts = {k: [str(v.dtype), list(v.shape), tensor_digest(v)] for k, v in outer.items()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def state_digest(weights: Sequence[str], outer: Sequence[str], stale: int | None) -> str:
    """The digest of a state a healing island takes, from its fragments' weight and outer
    digests and, under decoupled rounds, its `stale` flag (as served, a whole number)."""
    doc: dict[str, Any] = {"weights": list(weights), "outer": list(outer)}
    if stale is not None:
        doc["stale"] = int(stale)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def offer_digest(state: dict[str, Any]) -> str:
    """`state_digest` of a peer's healing state (`Healing.state()`, shape-checked): what its
    supporters must claim. Hashes every tensor it holds that the island takes (~3 ms per
    million values), once per offer."""
    fragments = state["fragments"]
    stale = state.get("stale")
    return state_digest([tensor_digest(f["global"]) for f in fragments],
                        [outer_digest(f["outer"]) for f in fragments], None if stale is None else int(stale))
