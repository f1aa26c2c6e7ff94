"""Codecs: how a pseudo-gradient chunk is encoded before it crosses islands.

Chosen by `[fault_tolerance] codec` (DESIGN: pure PyTorch, so CPU and GPU islands alike):

* `fp32`: no encoding; islands sum their weighted pseudo-gradients in one all-reduce.
* `bf16`: each value rounded to bfloat16 (2 bytes).
* `int8`: blockwise: per block of `codec_block_size` values, one fp32 scale (the block's
  largest magnitude / 127) and one int8 per value; decoded and summed in fp32.
* `topk`: the `topk_fraction` largest-magnitude values of the chunk, each quantized to
  `topk_bits` bits against one fp32 scale, sent with their int32 indices. What is not
  sent (or lost to quantization) stays in an error-feedback buffer on the island and is
  added to the next round's pseudo-gradient, so over rounds the whole signal is sent.

Every encoded payload is a flat uint8 tensor whose size depends only on the chunk's
length, so islands can all-gather payloads; every island then decodes every payload and
sums them in the same order in fp32, which keeps all islands bit-identical.
"""

from __future__ import annotations

import math

import torch

from archipelago.config.schema import FaultToleranceConfig

CODECS = ("fp32", "bf16", "int8", "topk")


class Codec:
    """Encodes one chunk of `numel` fp32 values into a fixed-size uint8 payload."""

    name = "fp32"

    def __init__(self, numel: int) -> None:
        self.numel = numel

    def payload_bytes(self) -> int:
        return 4 * self.numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of `x` (fp32, `numel` values); stateful codecs update their state."""
        return x.detach().float().contiguous().view(torch.uint8).clone()

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """fp32 values (`numel`) of a payload made by `encode` on any island."""
        return payload.view(torch.float32).clone()

    def error_bound(self, x: torch.Tensor) -> float:
        """Largest |decode(encode(x)) - x| this codec promises for `x` (stateless codecs)."""
        return 0.0

    # Error feedback (topk); stateless codecs have none.
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class Bf16Codec(Codec):
    name = "bf16"

    def payload_bytes(self) -> int:
        return 2 * self.numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(torch.bfloat16).contiguous().view(torch.uint8).clone()

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.view(torch.bfloat16).float()

    def error_bound(self, x: torch.Tensor) -> float:
        # Round-to-nearest with an 8-bit significand: half a unit in the last place.
        return float(x.abs().max()) * 2.0 ** -8 if x.numel() else 0.0


class Int8Codec(Codec):
    """Blockwise absmax int8: per block an fp32 scale, then one int8 per value."""

    name = "int8"

    def __init__(self, numel: int, block_size: int) -> None:
        super().__init__(numel)
        self.block = block_size
        self.blocks = max(1, math.ceil(numel / block_size))

    def payload_bytes(self) -> int:
        return 4 * self.blocks + self.blocks * self.block

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(self.blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:self.numel] = x.detach().float()
        return padded.view(self.blocks, self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self._blocks(x)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.contiguous().view(torch.uint8), q.flatten().view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        head = 4 * self.blocks
        scale = payload[:head].view(torch.float32)
        q = payload[head:].view(torch.int8).view(self.blocks, self.block).float()
        return (q * scale[:, None]).flatten()[:self.numel]

    def error_bound(self, x: torch.Tensor) -> float:
        # Rounding to the nearest of 255 levels: half a step, the block's absmax / 254.
        return float(self._blocks(x).abs().amax(dim=1).max()) / 254.0 * (1 + 1e-6)


class TopKCodec(Codec):
    """The k largest magnitudes, `bits`-bit values against one scale, with error feedback."""

    name = "topk"

    def __init__(self, numel: int, fraction: float, bits: int) -> None:
        super().__init__(numel)
        self.k = max(1, min(numel, math.ceil(fraction * numel)))
        self.bits = bits
        self.levels = 2 ** bits - 1  # steps between -scale and +scale
        self.error = torch.zeros(numel, dtype=torch.float32)  # what was not sent yet

    def payload_bytes(self) -> int:
        return 4 + 4 * self.k + math.ceil(self.k * self.bits / 8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.error = self.error.to(x.device)
        signal = x.detach().float() + self.error
        index = signal.abs().topk(self.k, sorted=False).indices.sort().values
        values = signal[index]
        scale = values.abs().max().reshape(1) if self.k else torch.zeros(1, device=x.device)
        codes = self._quantize(values, scale)
        payload = torch.cat([scale.view(torch.uint8), index.to(torch.int32).view(torch.uint8),
                             _pack(codes, self.bits)])
        self.error = signal
        self.error[index] -= self._dequantize(codes, scale)  # keep what quantization lost too
        return payload

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        scale = payload[:4].view(torch.float32)
        index = payload[4:4 + 4 * self.k].view(torch.int32).long()
        codes = _unpack(payload[4 + 4 * self.k:], self.bits, self.k)
        out = torch.zeros(self.numel, dtype=torch.float32, device=payload.device)
        out[index] = self._dequantize(codes, scale)
        return out

    def _quantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.levels == 0 or float(scale) == 0.0:
            return torch.zeros_like(values, dtype=torch.uint8)
        unit = (values / scale + 1) / 2 * self.levels  # -scale .. +scale -> 0 .. levels
        return torch.round(unit).clamp_(0, self.levels).to(torch.uint8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (codes.float() / self.levels * 2 - 1) * scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"error": self.error.detach().cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "error" in state:  # absent: a checkpoint from another codec; start with no residue
            self.error = state["error"].detach().float().clone().to(self.error.device)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits each (bits divides 8), packed little-end first."""
    per_byte = 8 // bits
    padded = torch.zeros(math.ceil(codes.numel() / per_byte) * per_byte, dtype=torch.uint8, device=codes.device)
    padded[:codes.numel()] = codes
    lanes = padded.view(-1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (lanes << shifts).sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    lanes = (packed.to(torch.int32)[:, None] >> shifts) & (2 ** bits - 1)
    return lanes.flatten()[:count].to(torch.uint8)


def build_codec(ft: FaultToleranceConfig, numel: int) -> Codec:
    """The codec for one chunk of `numel` values."""
    name = effective_codec(ft)
    if name == "bf16":
        return Bf16Codec(numel)
    if name == "int8":
        return Int8Codec(numel, ft.codec_block_size)
    if name == "topk":
        return TopKCodec(numel, ft.topk_fraction, ft.topk_bits)
    return Codec(numel)


def effective_codec(ft: FaultToleranceConfig) -> str:
    """`codec`, with the reference platform's `should_quantize = true` meaning int8."""
    return "int8" if ft.should_quantize and ft.codec == "fp32" else ft.codec
