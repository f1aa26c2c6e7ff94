"""Starting and finishing one bridge chunk's exchange across islands.

With the `fp32` codec the islands' weighted pseudo-gradients are summed by one all-reduce
of `[w*g ..., tokens, w]` (diloco.py). With any other codec the sum cannot happen on
encoded values, so each island all-gathers `[tokens, w | encoded g]` payloads and every
island decodes all of them and sums `w_k * decode(payload_k)` in fp32, in the same order
(replica rank), which leaves every island with bit-identical results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from archipelago.federation.codecs import Codec

HEADER_BYTES = 8  # [tokens, weight] as two fp32 values


@dataclass
class Gathered:
    """An all-gather in flight: the work to wait on and where the payloads land."""

    work: Any
    outputs: list[torch.Tensor] = field(default_factory=list)
    encode_s: float = 0.0


class _Done:
    """Stands in for a collective that was skipped (the manager already saw an error)."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def start_gather(manager: Any, codec: Codec, pseudo_gradient: torch.Tensor, tokens: int,
                 weight: float) -> Gathered:
    """Encode this island's chunk and start the all-gather (through torchft's process group).

    An island with weight 0 sends zeros and leaves its codec state (error feedback) alone:
    nothing of it enters the average, so nothing of it counts as sent.
    """
    began = time.perf_counter()
    if weight:
        body = codec.encode(pseudo_gradient)
    else:
        body = torch.zeros(codec.payload_bytes(), dtype=torch.uint8, device=pseudo_gradient.device)
    header = torch.tensor([float(tokens), weight], dtype=torch.float32, device=body.device)
    payload = torch.cat([header.view(torch.uint8), body])
    encode_s = time.perf_counter() - began
    outputs = [torch.zeros_like(payload) for _ in range(max(manager.num_participants(), 1))]
    if manager.errored() is not None:  # the round is lost already; do not touch the network
        return Gathered(_Done(), outputs, encode_s)
    from torch.distributed.distributed_c10d import AllgatherOptions
    # torchft's Manager offers only an all-reduce; its process group (the one Manager.allreduce
    # uses) all-gathers, and _ManagedWork gives the same error handling: a failure is reported
    # to the manager (the round will not commit) instead of raising here.
    from torchft.manager import _ManagedWork

    try:
        work = manager._pg.allgather([outputs], [payload], AllgatherOptions())
        return Gathered(_ManagedWork(manager, work, outputs), outputs, encode_s)
    except Exception as exc:  # noqa: BLE001 - any transport failure only loses this round
        manager.report_error(exc)
        return Gathered(_Done(), outputs, encode_s)


def finish_gather(gathered: Gathered, codec: Codec, into: torch.Tensor) -> float:
    """Wait, then write `[sum w_k*g_k ..., sum tokens_k, sum w_k]` into `into`; returns
    the decode seconds."""
    gathered.work.wait()
    began = time.perf_counter()
    total = torch.zeros(into.numel() - 2, dtype=torch.float32, device=into.device)
    tokens, weights = 0.0, 0.0
    for payload in gathered.outputs:  # replica-rank order: the same sum on every island
        head = payload[:HEADER_BYTES].view(torch.float32)
        tokens += float(head[0])
        weight = float(head[1])
        if weight:
            weights += weight
            total += weight * codec.decode(payload[HEADER_BYTES:]).to(into.device)
    into[:-2] = total
    into[-2], into[-1] = tokens, weights
    return time.perf_counter() - began
