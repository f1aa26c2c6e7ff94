"""Codecs: how a pseudo-gradient chunk is encoded before it crosses islands.

Chosen by `[fault_tolerance] codec`; pure PyTorch, so CPU and GPU islands encode alike:

* `fp32`: no encoding (4 bytes per value).
* `bf16`: each value rounded to bfloat16 (2 bytes).
* `int8`: blockwise: per block of `codec_block_size` values, one fp32 scale (the block's
  largest magnitude / 127) and one int8 per value; decoded and summed in fp32.
* `topk`: per chunk of `topk_chunk_size` values, the `topk_fraction` largest magnitudes,
  each sent as its index in the chunk (log2 of the chunk size in bits) and a `topk_bits`
  code (its sign and a magnitude level between bf16 scales of the chunk). What is not
  sent (or lost to quantization) stays in an error-feedback buffer on the island and is
  added to the next round's pseudo-gradient, so over rounds the whole signal is sent.

Every encoded payload is a flat uint8 tensor whose size depends only on the chunk's
length, so islands can all-gather payloads; every island then decodes every payload and
sums them in the same order in fp32, which keeps all islands bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from archipelago.config.schema import FaultToleranceConfig

# What rounding below fp32's and bf16's normal range can add to each value of a chunk, at
# most (their subnormal steps are 2^-149 and 2^-133): a bound on it, far below any real value.
SUBNORMAL_SLACK = 2.0 ** -120


class PayloadError(ValueError):
    """A payload no encoder of ours makes (e.g. top-k indices out of order or out of the chunk)."""


class Codec:
    """Encodes one chunk of `numel` fp32 values into a fixed-size uint8 payload."""

    name = "fp32"
    align = 0  # > 0: any run of whole blocks of `align` values encodes on its own (for_length)
    sparse = False  # True: payloads hold some of the values (the exchange sums them exactly, exchange.py)

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

    def norm_bound(self, norm: float) -> float:
        """Largest ||decode(encode(x))|| for any finite `x` of norm at most `norm`
        (stateless codecs): what the exchange allows a summed segment, encoded again, to
        grow by (sums.check_sum). fp32 is exact."""
        return norm

    def for_length(self, numel: int) -> Codec:
        """The same encoding for `numel` values (a segment of this chunk)."""
        return type(self)(numel)

    def segments(self, parts: int) -> list[tuple[int, int]]:
        """`parts` (start, end) ranges covering the chunk, cut at multiples of `align`."""
        blocks = math.ceil(self.numel / self.align)
        cuts = [min(self.numel, (blocks * j // parts) * self.align) for j in range(parts + 1)]
        return list(zip(cuts, cuts[1:]))

    # Error feedback (topk); stateless codecs have none.
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class Bf16Codec(Codec):
    name = "bf16"
    align = 1

    def payload_bytes(self) -> int:
        return 2 * self.numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(torch.bfloat16).contiguous().view(torch.uint8).clone()

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.view(torch.bfloat16).float()

    def error_bound(self, x: torch.Tensor) -> float:
        # Round-to-nearest with an 8-bit significand: half a unit in the last place.
        return float(x.abs().max()) * 2.0 ** -8 if x.numel() else 0.0

    def norm_bound(self, norm: float) -> float:
        # Each value moves by at most 2^-8 of itself (an 8-bit significand, rounded to
        # nearest), so the norm by at most 2^-8 of it; below bf16's normal range by at most
        # half its subnormal step, 2^-134 a value (SUBNORMAL_SLACK covers it).
        return norm * (1 + 2.0 ** -8) + math.sqrt(self.numel) * SUBNORMAL_SLACK


class Int8Codec(Codec):
    """Blockwise absmax int8: per block an fp32 scale, then one int8 per value."""

    name = "int8"

    def __init__(self, numel: int, block_size: int) -> None:
        super().__init__(numel)
        self.block = self.align = block_size
        self.blocks = max(1, math.ceil(numel / block_size))

    def for_length(self, numel: int) -> Codec:
        return Int8Codec(numel, self.block)

    def payload_bytes(self) -> int:
        return 4 * self.blocks + self.blocks * self.block

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(self.blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:self.numel] = x.detach().float()
        return padded.view(self.blocks, self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self._blocks(x)
        # Divide by a tensor on x's device, not a Python float: CUDA turns division by a
        # host scalar into multiplication by its reciprocal, which rounds differently from
        # the CPU's true division, and islands on both devices must encode the same bytes.
        scale = blocks.abs().amax(dim=1) / torch.full((), 127.0, device=x.device)
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

    def norm_bound(self, norm: float) -> float:
        # In steps of its block (s = absmax/127), a value t >= 1/2 rounds to at most
        # t + 1/2, so its square grows by at most t + 1/4 (a value below 1/2 becomes 0); the
        # block's largest value stays. Over the other m = n - 1 values of a block, of squares
        # Q in all, that is at most sqrt(m Q) + m/4 (Cauchy-Schwarz), against a block's
        # square of 127^2 + Q: the ratio is largest at sqrt(Q) = q, the positive root of
        # q^2 + q sqrt(m)/2 - 127^2, and blocks add up. No value more than doubles either.
        # Blocks of 256 values: at most 3.19% (values of 7.5 steps, rounded up, reach it;
        # tests/test_codecs.py), 64: 1.58%. The scale's, quotient's and product's fp32
        # roundings add a few 2^-24 (2^-20 covers them), a subnormal scale 2^-148 a value.
        m, c = min(self.block, self.numel) - 1, 127.0 ** 2
        q = (-math.sqrt(m) / 2 + math.sqrt(m / 4 + 4 * c)) / 2
        growth = min(2.0, math.sqrt(1 + (math.sqrt(m) * q + m / 4) / (c + q * q)))
        return norm * growth * (1 + 2.0 ** -20) + math.sqrt(self.numel) * SUBNORMAL_SLACK


class TopKCodec(Codec):
    """Per chunk of `chunk` values, its `fraction` largest magnitudes, with error feedback.

    Each sent value costs `bits` bits: its sign and `bits - 1` bits choosing one of
    2**(bits-1) magnitudes spaced evenly between the chunk's smallest and largest sent
    magnitude (two bf16 scales per chunk). With `bits = 1` a value is its sign times the
    chunk's mean sent magnitude (one bf16 scale). A chunk's k ascending indices cost
    log2(chunk) bits each, or, where fewer (every density between about 1/chunk and 1),
    their Elias-Fano code: the low `low_bits` bits of each index as they are, the rest as
    a bitmap of k + chunk / 2**low_bits bits in which index i sets bit (index >> low_bits)
    + i (at 5% of 256: 81 bits for 13 indices, not 104). Both are fixed sizes, so every
    payload of one codec has the same length. Chunks spread what is sent over the whole
    tensor and keep the indices short. What is not sent, or lost to quantization, stays in
    `error` and is added to the next round's input.
    """

    name = "topk"
    sparse = True

    def __init__(self, numel: int, fraction: float, bits: int, chunk: int = 256, exchange: str = "auto",
                 decay: float = 1.0, feedback: bool = True) -> None:
        super().__init__(numel)
        self.fraction, self.exchange, self.decay = fraction, exchange, decay
        self.chunk = self.align = max(1, min(chunk, numel))
        self.chunks = max(1, math.ceil(numel / self.chunk))
        self.bits = bits
        self.send_fraction(fraction)  # k, the values sent per chunk
        self.magnitudes = 2 ** (bits - 1)
        self.n_scales = 1 if self.magnitudes == 1 else 2  # bf16 per chunk: mean, or smallest and largest
        # What was not sent yet; none for a segment's codec (`for_length`), which decodes.
        self.error = torch.zeros(numel if feedback else 0, dtype=torch.float32)

    def for_length(self, numel: int) -> Codec:
        """The encoding of a segment of whole chunks of this codec (the last one may be
        partial, as this codec's own last chunk): chunks as wide as this codec's, whatever
        the segment's length, so the segment decodes to exactly its part of the chunk. It
        holds no error feedback (the exchange builds these every round: no model-sized
        buffers), so it encodes only an empty segment."""
        piece = TopKCodec(numel, self.fraction, self.bits, self.chunk, self.exchange, self.decay, feedback=False)
        piece.chunks = max(1, math.ceil(numel / self.chunk))
        piece.chunk = piece.align = self.chunk
        piece.send_per_chunk(self.k)
        return piece

    def send_fraction(self, fraction: float) -> None:
        """`send_per_chunk` the nearest whole count of `fraction` of a chunk."""
        self.send_per_chunk(round(fraction * self.chunk))

    def send_per_chunk(self, k: int) -> None:
        """Send `k` values of each chunk (1 to the chunk's) from the next encode on, their
        indices coded to suit; every payload of the round must share it (the receivers'
        codecs decode with theirs). The error feedback is model-sized: it stays."""
        self.k = max(1, min(self.chunk, k))
        self._index_coding()

    def _index_coding(self) -> None:
        """Fixed-width indices (`index_bits` each) or Elias-Fano (`low_bits` each plus a
        bitmap of `high_bits` a chunk), whichever is shorter for this chunk and k."""
        self.index_bits = max(1, (self.chunk - 1).bit_length())
        self.low_bits = max(0, (self.chunk // self.k).bit_length() - 1)  # floor(log2(chunk / k))
        self.high_bits = self.k + ((self.chunk - 1) >> self.low_bits) + 1
        self.elias_fano = self.k * self.low_bits + self.high_bits < self.k * self.index_bits

    def sum_nonzeros(self, contributors: int) -> int:
        """The most nonzero values a sum of `contributors` payloads can have: each sends
        `k` values per chunk."""
        return min(self.numel, self.chunks * min(self.chunk, contributors * self.k))

    def _sizes(self) -> tuple[int, int, int]:
        """Payload bytes of the scales, the indices and the codes."""
        sent = self.chunks * self.k
        scales, codes = 2 * self.chunks * self.n_scales, math.ceil(sent * self.bits / 8)
        if self.elias_fano:
            return scales, math.ceil(sent * self.low_bits / 8) + math.ceil(self.chunks * self.high_bits / 8), codes
        return scales, math.ceil(sent * self.index_bits / 8), codes

    def payload_bytes(self) -> int:
        return sum(self._sizes())

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._payload(*self._select(x))

    def encode_segments(self, x: torch.Tensor, segments: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One payload per (start, end) segment of whole chunks (`segments()`), each what
        `for_length(end - start)` decodes to exactly `decode(encode(x))[start:end]`: the
        chunks are chosen once, over the whole chunk, so the error feedback is the same as
        `encode`'s."""
        scales, index, codes = self._select(x)
        rows = [(start // self.chunk, -(-end // self.chunk) if end > start else start // self.chunk)
                for start, end in segments]
        return [self._payload(scales[a:b], index[a:b], codes[a:b]) if b > a else
                self.for_length(0).encode(x[:0]) for a, b in rows]

    def _select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each chunk's sent values as (bf16 scales, ascending indices, codes); what is not
        sent, or lost to quantization, becomes the error feedback."""
        self.error = self.error.to(x.device)
        chunks = torch.zeros(self.chunks * self.chunk, dtype=torch.float32, device=x.device)
        # SparseLoCo's decay: an old residue counts less each round it waits (1: not at all).
        chunks[:self.numel] = x.detach().float() + (self.error if self.decay == 1 else self.decay * self.error)
        chunks = chunks.view(self.chunks, self.chunk)
        index = self._choose(chunks)
        values = chunks.gather(1, index)
        magnitude = values.abs()
        if self.n_scales == 1:  # sign only: the mean magnitude is the least-squares scale
            scales = magnitude.mean(dim=1, keepdim=True).to(torch.bfloat16)
        else:
            scales = torch.stack([magnitude.amin(dim=1), magnitude.amax(dim=1)], dim=1).to(torch.bfloat16)
        codes = self._quantize(values, scales.float())
        # Keep what was not sent, including what quantization lost of what was.
        chunks.scatter_(1, index, values - self._dequantize(codes, scales.float()))
        self.error = chunks.flatten()[:self.numel].clone()
        return scales, index, codes

    def _choose(self, chunks: torch.Tensor) -> torch.Tensor:
        """The (chunks, k) ascending indices each chunk sends: its k largest magnitudes
        (ascending: one canonical payload whatever order the device's topk returns them in)."""
        return chunks.abs().topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values

    def _payload(self, scales: torch.Tensor, index: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return torch.cat([scales.flatten().view(torch.uint8), self._pack_index(index), _pack(codes, self.bits)])

    def _pack_index(self, index: torch.Tensor) -> torch.Tensor:
        if not self.elias_fano:
            return _pack(index, self.index_bits)
        rows = index.shape[0]
        low = index & ((1 << self.low_bits) - 1)
        ones = (index >> self.low_bits) + torch.arange(self.k, device=index.device)  # strictly ascending
        bitmap = torch.zeros(rows, self.high_bits, dtype=torch.int32, device=index.device).scatter_(1, ones, 1)
        lows = _pack(low, self.low_bits) if self.low_bits else index.new_zeros(0, dtype=torch.uint8)
        return torch.cat([lows, _pack(bitmap, 1)])

    def _unpack_index(self, packed: torch.Tensor) -> torch.Tensor:
        """The (chunks, k) indices of `_pack_index`; a bitmap without exactly k ones in some
        chunk is a forged payload."""
        sent = self.chunks * self.k
        if not self.elias_fano:
            return _unpack(packed, self.index_bits, sent).long().view(self.chunks, self.k)
        low_bytes = math.ceil(sent * self.low_bits / 8)
        low = _unpack(packed[:low_bytes], self.low_bits, sent).long() if self.low_bits else \
            torch.zeros(sent, dtype=torch.long, device=packed.device)
        bitmap = _unpack(packed[low_bytes:], 1, self.chunks * self.high_bits).view(self.chunks, self.high_bits)
        if bool((bitmap.sum(dim=1) != self.k).any()):  # a device sync
            raise PayloadError(f"a top-k payload whose index bitmap does not hold {self.k} ones in every chunk")
        ones = bitmap.nonzero()[:, 1].view(self.chunks, self.k)  # row by row, ascending
        high = ones - torch.arange(self.k, device=packed.device)
        return (high << self.low_bits) | low.view(self.chunks, self.k)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        sent = self.chunks * self.k
        head, index_bytes, _ = self._sizes()
        scales = payload[:head].view(torch.bfloat16).float().view(self.chunks, self.n_scales)
        index = self._unpack_index(payload[head:head + index_bytes])
        # encode sends each chunk's indices ascending, each once, inside the chunk: anything
        # else is a forged payload (scatter would raise, or let one value land twice).
        if bool((index >= self.chunk).any()) or bool((index[:, 1:] <= index[:, :-1]).any()):  # a device sync
            raise PayloadError("a top-k payload with indices out of order or outside the chunk")
        codes = _unpack(payload[head + index_bytes:], self.bits, sent).view(self.chunks, self.k)
        out = torch.zeros(self.chunks, self.chunk, dtype=torch.float32, device=payload.device)
        out.scatter_(1, index, self._dequantize(codes, scales))
        return out.flatten()[:self.numel]

    def _quantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Code = magnitude level << 1 | sign; `scales` is (chunks, 2): low, high (1 bit: the mean)."""
        sign = (values < 0).to(torch.int32)
        if self.magnitudes == 1:
            return sign
        low = scales[:, :1]
        span = (scales[:, 1:] - low).clamp_min(torch.finfo(torch.float32).tiny)
        level = torch.round((values.abs() - low) / span * (self.magnitudes - 1)).clamp_(0, self.magnitudes - 1)
        return level.to(torch.int32) << 1 | sign

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        codes = codes.to(torch.int32)
        if self.magnitudes == 1:
            magnitude = scales[:, :1]
        else:
            low, high = scales[:, :1], scales[:, 1:]
            magnitude = low + (high - low) * ((codes >> 1).float() / (self.magnitudes - 1))
        return torch.where(codes & 1 == 1, -magnitude, magnitude)

    def release_residue(self) -> torch.Tensor:
        """`topk_keep_residue`: the unsent values times the decay, cleared. The island
        continues from the global weights minus them, so its next pseudo-gradient (global
        minus its weights after training) carries them as the residue would have."""
        residue, self.error = self.error * self.decay, torch.zeros_like(self.error)
        return residue

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"error": self.error.detach().cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "error" in state:  # absent: a checkpoint from another codec; start with no residue
            self.error = state["error"].detach().float().clone().to(self.error.device)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below 2**bits, `bits` bits each, packed lowest bit first."""
    if 8 % bits:
        return _pack_bits(codes, bits)
    # Whole codes per byte (1, 2, 4 or 8 bits: top-k's codes, indices in chunks of 256): the
    # same bytes as the bit stream, on a CPU about 65x faster for 8-bit codes and 5x for
    # 2-bit ones than one int32 per bit (bench/codec_speed.py).
    per = 8 // bits
    flat = torch.nn.functional.pad(codes.flatten().to(torch.int32), (0, -codes.numel() % per))
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.int32)
    return (flat.view(-1, per) << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`_pack` for any width: one bit at a time."""
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((codes.flatten().to(torch.int32)[:, None] >> shifts) & 1).to(torch.uint8).flatten()
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8))
    weights = 2 ** torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` integers of `_pack`, as int32."""
    if 8 % bits:
        return _unpack_bits(packed, bits, count)
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    codes = (packed.to(torch.int32)[:, None] >> shifts) & (2 ** bits - 1)
    return codes.flatten()[:count].view(count)  # too few bytes: an error, as in the bit stream


def _unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """`_unpack` for any width: one bit at a time."""
    stream = (packed.to(torch.int32)[:, None] >> torch.arange(8, device=packed.device, dtype=torch.int32)) & 1
    lanes = stream.flatten()[:count * bits].view(count, bits)
    return (lanes << torch.arange(bits, device=packed.device, dtype=torch.int32)).sum(dim=1, dtype=torch.int32)


def pack_sum(total: torch.Tensor) -> torch.Tensor:
    """An exact, sparse form of a sum of sparse payloads: a bitmap of the values whose bits
    are not all zero (one bit per value, lowest bit first; -0.0, which a trimmed mean can
    make, counts as set), then those values as fp32 in index order. Unpacking gives back
    the same bits."""
    total = total.float().contiguous()
    nonzero = total.view(torch.int32) != 0
    return torch.cat([_pack(nonzero.to(torch.int32), 1), total[nonzero].view(torch.uint8)])


def unpack_sum(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """The `numel` fp32 values of `pack_sum`'s payload; anything else is a PayloadError."""
    head = math.ceil(numel / 8)
    if payload.numel() < head:
        raise PayloadError("a summed segment shorter than its bitmap")
    bits = _unpack(payload[:head], 1, head * 8)
    if bool(bits[numel:].any()):  # a device sync
        raise PayloadError("a summed segment with bits set past its values")
    nonzero = bits[:numel].bool()
    count = int(nonzero.sum())
    if payload.numel() != head + 4 * count:
        raise PayloadError(f"a summed segment of {payload.numel()} bytes where its bitmap says {head + 4 * count}")
    values = payload[head:].clone().view(torch.float32)
    if bool((values.view(torch.int32) == 0).any()):  # a device sync
        raise PayloadError("a summed segment that lists a zero as a nonzero value")
    if not bool(torch.isfinite(values).all()):
        raise PayloadError("a summed segment with values that are not finite")
    out = torch.zeros(numel, dtype=torch.float32, device=payload.device)
    out[nonzero] = values
    return out


def sum_bytes_bound(numel: int, nonzeros: int | None = None) -> int:
    """The most bytes `pack_sum` makes of `numel` values with at most `nonzeros` of them
    nonzero (default: all)."""
    return math.ceil(numel / 8) + 4 * (numel if nonzeros is None else min(numel, nonzeros))


LADDER = ("fp32", "bf16", "int8", "topk")  # codec = "auto" chooses among these, densest first
AUTO_FIRST = "int8"  # auto's choice until a round has measured the link


class AutoCodec(Codec):
    """codec = "auto": one of LADDER per round, chosen by the exchange (`choose`); each
    codec is built once, so top-k's error feedback survives rounds of other codecs. What
    it holds back is sent by the next dense round (`take_residue`)."""

    name = "auto"

    def __init__(self, numel: int, ft: FaultToleranceConfig) -> None:
        super().__init__(numel)
        self.options = {name: build_codec(replace(ft, codec=name), numel)  # type: ignore[arg-type]
                        for name in LADDER}
        self.current = AUTO_FIRST

    @property
    def chosen(self) -> Codec:
        return self.options[self.current]

    @property
    def align(self) -> int:  # type: ignore[override]
        return self.chosen.align

    @property
    def sparse(self) -> bool:  # type: ignore[override]
        return self.chosen.sparse

    def __getattr__(self, name: str):  # top-k's own (k, chunk, exchange, encode_segments, ...)
        if name in ("options", "current"):
            raise AttributeError(name)
        return getattr(self.chosen, name)

    def choose(self, name: str) -> None:
        if name not in self.options:
            raise ValueError(f"codec {name!r} is not one of {LADDER}")
        self.current = name

    def take_residue(self) -> torch.Tensor | None:
        """Top-k's unsent values (times its decay), cleared, when this round is dense: they
        travel with it. `give_back` returns them when the round does not carry them."""
        topk = self.options["topk"]
        if self.current == "topk" or not isinstance(topk, TopKCodec) or not bool(topk.error.any()):
            return None
        residue, topk.error = topk.error * topk.decay, torch.zeros_like(topk.error)
        return residue

    def give_back(self, residue: torch.Tensor) -> None:
        """A residue `take_residue` gave out that no committed round carried."""
        topk = self.options["topk"]
        assert isinstance(topk, TopKCodec)
        topk.error = topk.error + residue.to(topk.error.device)

    def payload_bytes(self) -> int:
        return self.chosen.payload_bytes()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.chosen.encode(x)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return self.chosen.decode(payload)

    def error_bound(self, x: torch.Tensor) -> float:
        return self.chosen.error_bound(x)

    def norm_bound(self, norm: float) -> float:
        return self.chosen.norm_bound(norm)

    def for_length(self, numel: int) -> Codec:
        return self.chosen.for_length(numel)

    def segments(self, parts: int) -> list[tuple[int, int]]:
        return self.chosen.segments(parts)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.options["topk"].state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.options["topk"].load_state_dict(state)


def build_codec(ft: FaultToleranceConfig, numel: int) -> Codec:
    """The codec for one chunk of `numel` values."""
    name = effective_codec(ft)
    if name == "auto":
        return AutoCodec(numel, ft)
    if name == "bf16":
        return Bf16Codec(numel)
    if name == "int8":
        return Int8Codec(numel, ft.codec_block_size)
    if name == "topk":
        return TopKCodec(numel, ft.topk_fraction, ft.topk_bits, ft.topk_chunk_size, ft.topk_exchange,
                         ft.topk_error_decay)
    return Codec(numel)


def round_fraction(ft: FaultToleranceConfig, outer_step: int) -> float:
    """The fraction of a chunk the members' top-k sends in the round that starts after
    `outer_step` applied outer steps: `topk_early_fraction` while at most `topk_early_rounds`
    were applied (the join round and the first rounds of training), `topk_fraction` after."""
    early = 0 < ft.topk_early_rounds and outer_step <= ft.topk_early_rounds
    return ft.topk_early_fraction if early else ft.topk_fraction


def schedule_round(codec: Codec, ft: FaultToleranceConfig, outer_step: int) -> None:
    """Set what the members' top-k `codec` sends in the round after `outer_step` applied
    outer steps (`round_fraction`). The outer step is the quorum's, so every member's
    payloads have one length."""
    if ft.topk_early_rounds and isinstance(codec, TopKCodec):
        codec.send_fraction(round_fraction(ft, outer_step))


def effective_codec(ft: FaultToleranceConfig) -> str:
    """`codec`, with the reference platform's `should_quantize = true` meaning int8."""
    return "int8" if ft.should_quantize and ft.codec == "fp32" else ft.codec
