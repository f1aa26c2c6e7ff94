"""A bridge rank's global state: its chunks of the global weights with their outer
optimizers (`OuterCore`), the codec that carries each fragment's rows (its error feedback
outlives a reset of the weights), the digest of the chunks, and all of it as checkpoint
state. Only bridge ranks hold one; the outer loop (diloco.OuterLoop) asks it for the
global hash and its checkpoint, and healing (healing.py) for the weights and optimizers
a peer takes.
"""

from __future__ import annotations

import hashlib
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
        self._digest: str | None = None     # `chunk_digest()`'s, until the global weights change

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
        """SHA-256 of the global chunks, computed once per change of them: the round's
        global hash and the next round's state claim hash the same bytes."""
        if self._digest is None:
            self._digest = digest(self.globals)
        return self._digest

    def forget_digest(self) -> None:
        """The global chunks changed: hash them again when asked."""
        self._digest = None

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


def digest(tensors: Any) -> str:
    """SHA-256 over tensors' bytes in order: a bridge rank's global chunks, or a peer's."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()
