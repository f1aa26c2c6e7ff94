"""Codecs for pseudo-gradients: round trips within the stated bounds, top-k error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.codecs import (
    Bf16Codec,
    Int8Codec,
    TopKCodec,
    _pack,
    _unpack,
    build_codec,
    effective_codec,
    schedule_round,
)


def _signal(numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, like a pseudo-gradient: most values small, a few large.
    return torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4


@pytest.mark.parametrize("codec", [Bf16Codec(1000), Int8Codec(1000, 64), Int8Codec(1000, 1000)],
                         ids=["bf16", "int8-block64", "int8-one-block"])
def test_round_trip_is_within_the_stated_bound(codec):
    x = _signal(1000)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes()
    error = (codec.decode(payload) - x).abs().max().item()
    bound = codec.error_bound(x)
    assert 0 < error <= bound, (error, bound)
    # An independent reference for bf16: torch's own rounding.
    if isinstance(codec, Bf16Codec):
        assert torch.equal(codec.decode(payload), x.to(torch.bfloat16).float())


def _worst_for_norm(codec, numel: int) -> list[torch.Tensor]:
    """Chunks whose round trip grows the norm most: per block one value at 127 steps and
    the rest just above a half step (int8: each rounds up; the bound's worst case is near
    7.5 steps for blocks of 256, 15.5 for 64), or just above the midpoint between two bf16
    numbers (each rounds up); and the same, tiny, and negated."""
    if isinstance(codec, Int8Codec):
        chunks = []
        for steps in (0.5, 1.5, 7.5, 15.5, 32.5):
            x = torch.full((numel,), steps + 1e-3)
            x[::codec.block] = 127.0
            chunks.append(x)
        return [*chunks, chunks[0] * 1e-38, -chunks[2]]
    x = torch.full((numel,), 1 + 2.0 ** -8 + 2.0 ** -20)  # rounds up to 1 + 2^-7
    return [x, x * 2.0 ** -130, -x]


@pytest.mark.parametrize("codec", [Bf16Codec(1000), Int8Codec(1000, 64), Int8Codec(1024, 256),
                                   Int8Codec(100_000, 100_000)],
                         ids=["bf16", "int8-block64", "int8-block256", "int8-one-large-block"])
def test_norm_bound_holds_for_the_round_trips_worst_chunks(codec):
    # The exchange checks a summed segment, encoded a second time, against norm_bound of
    # what the segments' norms allow (sums.check_sum): it must hold for any chunk, and
    # for the usual blocks the worst chunks grow the norm by at least 98% of what it allows (tight).
    numel = codec.numel
    growths = []
    for x in [_signal(numel, seed) for seed in range(5)] + _worst_for_norm(codec, numel) + [torch.zeros(numel)]:
        norm = float(x.double().norm())
        grown = float(codec.decode(codec.encode(x)).double().norm())
        assert grown <= codec.norm_bound(norm), (grown, norm, codec.norm_bound(norm))
        growths.append(grown / norm if norm else 1.0)
    if not isinstance(codec, Int8Codec) or codec.block <= 256:
        assert max(growths) > 1 + 0.98 * (codec.norm_bound(1.0) - 1), (max(growths), codec.norm_bound(1.0))
    if isinstance(codec, Int8Codec) and codec.block == 256:
        assert codec.norm_bound(1.0) < 1.032


def test_int8_scales_each_block_by_its_own_largest_value():
    x = torch.cat([torch.full((64,), 1e-3), torch.full((64,), 10.0)])
    x[0], x[64] = 2e-3, 20.0
    decoded = Int8Codec(128, 64).decode(Int8Codec(128, 64).encode(x))
    # With one scale for both blocks, 1e-3 would round to 0 (20/127 per step).
    assert (decoded[:64] - x[:64]).abs().max() <= 2e-3 / 254 * 1.001


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 7, 1001, 4096])
def test_whole_codes_per_byte_pack_as_the_bit_stream_does(bits, count):
    # The fast path (codes that fill a byte exactly) against the one-bit-at-a-time stream,
    # and against numpy's own bit packing (little-endian bit order, the lowest bit first).
    import numpy as np

    from archipelago.federation.codecs import _pack_bits, _unpack_bits

    codes = torch.randint(0, 2 ** bits, (count,), dtype=torch.int32)
    packed = _pack(codes, bits)
    assert torch.equal(packed, _pack_bits(codes, bits))
    lanes = ((codes.numpy()[:, None] >> np.arange(bits)) & 1).astype(np.uint8).ravel()
    assert np.array_equal(packed.numpy(), np.packbits(lanes, bitorder="little"))
    assert torch.equal(_unpack(packed, bits, count), _unpack_bits(packed, bits, count))
    assert torch.equal(_unpack(packed, bits, count), codes)
    with pytest.raises(RuntimeError):  # too few bytes for `count` codes
        _unpack(packed[:-1], bits, count)


def test_payload_size_depends_only_on_the_length():
    for codec in (Bf16Codec(777), Int8Codec(777, 100), TopKCodec(777, 0.05, 2)):
        assert codec.encode(_signal(777, 1)).numel() == codec.encode(_signal(777, 2) * 1e6).numel()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8, 12, 16])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 2 ** bits, (1001,), dtype=torch.int32)
    packed = _pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(_unpack(packed, bits, 1001), codes)
    if bits == 8:  # an independent reference: 8-bit codes are the bytes themselves
        assert torch.equal(packed, codes.to(torch.uint8))


def _bits(payload: torch.Tensor, start_byte: int, count: int) -> list[int]:
    """`count` bits of `payload` from `start_byte`, lowest bit of each byte first (by hand)."""
    data = payload.tolist()
    return [(data[start_byte + i // 8] >> (i % 8)) & 1 for i in range(count)]


def test_topk_payload_is_scales_indices_and_codes():
    # 1000 values in chunks of 256: 4 chunks, 13 of 256 sent per chunk (5%). Fixed-width
    # indices would be 8 bits each (104 a chunk); Elias-Fano: the low floor(log2(256 / 13)) = 4
    # bits of each, then a bitmap of 13 + 256 / 16 = 29 bits a chunk where index i of the chunk
    # sets bit (index >> 4) + i (81 bits a chunk).
    codec = TopKCodec(1000, 0.05, 2, chunk=256)
    assert (codec.chunks, codec.k, codec.index_bits, codec.elias_fano) == (4, 13, 8, True)
    assert codec.payload_bytes() == 4 * 4 + -(-4 * 13 * 4 // 8) + -(-4 * 29 // 8) + -(-4 * 13 * 2 // 8)
    x = _signal(1000, 4)
    payload = codec.encode(x)
    lows = _bits(payload, 16, 4 * 13 * 4)
    bitmap = _bits(payload, 16 + 26, 4 * 29)
    padded = torch.cat([x, torch.zeros(24)]).view(4, 256)
    for c in range(4):
        ones = [b for b in range(29) if bitmap[c * 29 + b]]
        assert len(ones) == 13
        index = [((one - i) << 4) | sum(lows[(c * 13 + i) * 4 + j] << j for j in range(4))
                 for i, one in enumerate(ones)]
        # Canonical: ascending in each chunk, and exactly the chunk's 13 largest magnitudes.
        assert index == sorted(padded[c].abs().topk(13).indices.tolist()), f"chunk {c}"


def test_topk_indices_take_the_shorter_of_the_two_codes():
    # Elias-Fano from about one value a chunk up to all of them; below that, fixed width.
    for chunk, fraction, fixed_bits in [(256, 0.004, 8), (1024, 0.001, 10)]:  # k = 1: 10 and 12 bits EF
        codec = TopKCodec(4 * chunk, fraction, 2, chunk)
        assert codec.k == 1 and not codec.elias_fano
        assert codec.payload_bytes() == 4 * 4 + -(-4 * fixed_bits // 8) + 1
    for chunk, fraction, k, low, high in [(256, 0.2, 51, 2, 51 + 64), (1024, 0.01, 10, 6, 10 + 16),
                                          (64, 1.0, 64, 0, 64 + 64), (200, 0.1, 20, 3, 20 + 25)]:
        codec = TopKCodec(3 * chunk, fraction, 2, chunk)
        assert (codec.k, codec.elias_fano, codec.low_bits, codec.high_bits) == (k, True, low, high)
        x = _signal(3 * chunk, 6).view(3, chunk)
        sent = codec.decode(codec.encode(x.flatten())).view(3, chunk) != 0
        largest = torch.zeros_like(sent).scatter_(1, x.abs().topk(k, dim=1).indices, True)
        assert torch.equal(sent, largest), (chunk, fraction)  # the indices arrive whole


def test_topk_early_rounds_send_what_a_codec_of_the_early_fraction_sends_then_the_configs():
    # The schedule's rounds against codecs built at each fraction (the reference): the same
    # payload byte for byte, the same residue, the same decoded values; the round after the
    # early ones sends the config's fraction again, carrying the residue the early round left.
    ft = FaultToleranceConfig(codec="topk", topk_fraction=0.01, topk_chunk_size=1024, topk_error_decay=0.9,
                              topk_early_fraction=0.02, topk_early_rounds=2)
    scheduled, early, late = build_codec(ft, 3000), TopKCodec(3000, 0.02, 2, 1024, decay=0.9), \
        TopKCodec(3000, 0.01, 2, 1024, decay=0.9)
    assert (scheduled.k, early.k, late.k) == (10, 20, 10)
    for step, reference in ((0, early), (2, early), (3, late)):
        x = _signal(3000, step)
        schedule_round(scheduled, ft, step)
        if step == 3:  # the late codec continues from the residue the early rounds left
            late.error = early.error.clone()
        payload = scheduled.encode(x)
        assert payload.numel() == scheduled.payload_bytes() == reference.payload_bytes()
        assert torch.equal(payload, reference.encode(x)), step
        assert torch.equal(scheduled.error, reference.error)
        assert torch.equal(scheduled.decode(payload), reference.decode(payload))
        # A reduce-scatter's segment (two of the three chunks) decodes as the round sends.
        piece, segment = scheduled.for_length(2048), scheduled.encode_segments(x, [(0, 2048)])[0]
        assert torch.equal(segment, reference.encode_segments(x, [(0, 2048)])[0])
        assert segment.numel() == piece.payload_bytes() == reference.for_length(2048).payload_bytes()
        assert torch.equal(piece.decode(segment), reference.for_length(2048).decode(segment))
    assert early.payload_bytes() > late.payload_bytes()  # the comparison can fail
    off = FaultToleranceConfig(codec="topk", topk_fraction=0.01, topk_chunk_size=1024)
    plain = build_codec(off, 3000)
    schedule_round(plain, off, 0)
    assert plain.k == 10  # no schedule: the config's fraction from the first round


def test_topk_sends_the_largest_values_of_every_chunk():
    x = _signal(800, 5)
    x[:400] *= 1e-3  # a quiet first half still sends its own largest values
    codec = TopKCodec(800, 0.1, 8, chunk=200)
    sent = codec.decode(codec.encode(x)).view(4, 200)
    for c in range(4):
        expected = set(torch.sort(x.view(4, 200)[c].abs(), descending=True).indices[:codec.k].tolist())
        assert set(torch.nonzero(sent[c]).flatten().tolist()) == expected, f"chunk {c}"
    picked = sent != 0
    assert torch.equal(torch.sign(sent[picked]), torch.sign(x.view(4, 200)[picked]))


def test_topk_magnitudes_stay_between_the_chunk_scales():
    x = _signal(4096, 6)
    codec = TopKCodec(4096, 0.05, 2, chunk=1024)
    decoded = codec.decode(codec.encode(x)).view(4, 1024)
    original = x.view(4, 1024)
    for c in range(4):
        sent = decoded[c] != 0
        low, high = original[c][sent].abs().min(), original[c][sent].abs().max()
        magnitudes = decoded[c][sent].abs()
        # Two levels at 2 bits (one sign bit): the chunk's smallest and largest sent magnitude (bf16).
        assert set(magnitudes.tolist()) <= {low.to(torch.bfloat16).item(), high.to(torch.bfloat16).item()}
    signs = TopKCodec(4096, 0.05, 1, chunk=1024)  # 1 bit: the sign, times the chunk's mean sent magnitude
    # 51 of 1,024: 4 low bits each and a 51 + 64-bit bitmap a chunk, 1-bit codes, one scale.
    assert signs.payload_bytes() == 4 * 2 + -(-4 * 51 * 4 // 8) + -(-4 * 115 // 8) + -(-4 * 51 // 8)
    decoded = signs.decode(signs.encode(x)).view(4, 1024)
    for c in range(4):
        sent = decoded[c] != 0
        mean = original[c][sent].abs().mean().to(torch.bfloat16).item()
        assert torch.equal(decoded[c][sent], torch.sign(original[c][sent]) * mean)


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_topk_with_error_feedback_sends_the_whole_signal_over_rounds(bits):
    numel, rounds = 2000, 300
    sender, receiver = TopKCodec(numel, 0.02, bits, 512), TopKCodec(numel, 0.02, bits, 512)
    inputs, sent = torch.zeros(numel), torch.zeros(numel)
    for r in range(rounds):
        x = _signal(numel, seed=r)
        inputs += x
        sent += receiver.decode(sender.encode(x))
        # What is missing is exactly what the sender still holds back.
        torch.testing.assert_close(inputs - sent, sender.error, rtol=0, atol=1e-3)
    # The residue stays bounded while the sums grow: the relative gap shrinks with rounds.
    assert (inputs - sent).norm() / inputs.norm() < 0.25
    assert sender.payload_bytes() < 0.03 * 4 * numel  # a few % of the values at 2-14 bits each


def test_topk_error_feedback_survives_a_state_round_trip():
    a = TopKCodec(500, 0.1, 2)
    a.encode(_signal(500))
    b = TopKCodec(500, 0.1, 2)
    b.load_state_dict(a.state_dict())
    x = _signal(500, 3)
    assert torch.equal(a.encode(x), b.encode(x))


def test_should_quantize_means_int8():
    assert effective_codec(FaultToleranceConfig(should_quantize=True)) == "int8"
    assert isinstance(build_codec(FaultToleranceConfig(codec="topk"), 10), TopKCodec)
    assert build_codec(FaultToleranceConfig(), 10).name == "fp32"


class _FakeManager:
    """Just what OuterLoop needs of a manager outside a round (state functions, step)."""

    def register_state_dict_fn(self, *args: object) -> None:
        pass

    def current_step(self) -> int:
        return 4

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _outer_loop(codec: str):
    from torch import nn

    from archipelago.federation.diloco import OuterLoop
    from archipelago.federation.membership import fingerprint

    torch.manual_seed(0)
    model = nn.Linear(40, 10)
    ft = FaultToleranceConfig(enable=True, codec=codec, topk_fraction=0.05)
    fp = fingerprint("linear", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1)
    return OuterLoop(ft, [list(model.parameters())], 0, 1, _FakeManager(), fp)


def test_checkpoints_carry_the_error_feedback_and_healing_keeps_the_islands_own():
    peer, restarted = _outer_loop("topk"), _outer_loop("topk")
    peer.codecs[0].encode(_signal(peer.codecs[0].numel, 7))  # leaves a residue behind
    assert peer.codecs[0].error.abs().sum() > 0
    resumed = _outer_loop("topk")
    resumed.load_state_dict(peer.state_dict())  # what a checkpoint holds: the island's own residue
    assert torch.equal(resumed.codecs[0].error, peer.codecs[0].error)
    # Healing from a peer takes its weights and outer state, not its residue: the peer still
    # sends that itself, and a copy would enter the average twice.
    restarted.codecs[0].encode(_signal(restarted.codecs[0].numel, 8))
    own = restarted.codecs[0].error.clone()
    restarted.healing.load(peer.healing.state())  # what torchft's transport carries: held until vouched for
    restarted.healing.apply(restarted.healing.offer)  # what the members' claims then allow
    assert torch.equal(restarted.codecs[0].error, own)
    assert torch.equal(restarted.globals[0].detach(), peer.globals[0].detach())
    assert "codec" not in _outer_loop("int8").state_dict()["bridge0"]["fragment0"]  # stateless


@pytest.mark.parametrize("codec,parts", [(Int8Codec(1000, 64), 3), (Int8Codec(100, 64), 4), (Bf16Codec(10), 3)])
def test_segments_cover_the_chunk_at_block_boundaries_and_encode_alone(codec, parts):
    segments = codec.segments(parts)
    assert len(segments) == parts and segments[0][0] == 0 and segments[-1][1] == codec.numel
    assert all(a[1] == b[0] for a, b in zip(segments, segments[1:]))
    assert all(start % codec.align == 0 for start, _ in segments)
    x = _signal(codec.numel, 8)
    whole = codec.decode(codec.encode(x))
    pieces = [codec.for_length(end - start) for start, end in segments]
    stitched = torch.cat([p.decode(p.encode(x[start:end])) for p, (start, end) in zip(pieces, segments)])
    assert torch.equal(stitched, whole)  # cut at block boundaries, a segment encodes as in the whole


def test_a_topk_payload_with_forged_indices_is_refused_not_a_crash():
    from archipelago.federation.codecs import PayloadError, TopKCodec, _pack

    # 10 of each chunk of 100: 3 low bits, a 23-bit bitmap whose last ones can name 104..111.
    codec = TopKCodec(1000, 0.1, 2, chunk=100)
    assert (codec.k, codec.low_bits, codec.high_bits) == (10, 3, 23)
    payload = codec.encode(_signal(1000, 3))
    assert torch.isfinite(codec.decode(payload)).all()
    head, index_bytes, _ = codec._sizes()
    low_bytes = -(-codec.chunks * codec.k * 3 // 8)

    def forged(lows: list[int], bitmap: list[int]) -> torch.Tensor:
        bad = payload.clone()
        bad[head:head + low_bytes] = _pack(torch.tensor(lows * codec.chunks, dtype=torch.int32), 3)
        bad[head + low_bytes:head + index_bytes] = _pack(torch.tensor(bitmap * codec.chunks, dtype=torch.int32), 1)
        return bad

    cases = [([7] * 10, [0] * 13 + [1] * 10, "indices"),      # highs 13: indices 111, outside the chunk
             ([0] * 10, [1] * 10 + [0] * 13, "indices"),      # ten times index 0: out of order
             ([0] * 10, [1] * 11 + [0] * 12, "bitmap"),       # eleven ones: not ten indices a chunk
             ([0] * 10, [1] * 9 + [0] * 14, "bitmap")]
    for lows, bitmap, match in cases:
        with pytest.raises(PayloadError, match=match):
            codec.decode(forged(lows, bitmap))
    fixed = TopKCodec(1000, 0.001, 2, chunk=1000)  # one index of 10 bits: fixed width can name 1000..1023
    payload = fixed.encode(_signal(1000, 3))
    head, index_bytes, _ = fixed._sizes()
    payload[head:head + index_bytes] = _pack(torch.tensor([1020], dtype=torch.int32), fixed.index_bits)
    with pytest.raises(PayloadError, match="indices"):
        fixed.decode(payload)


@pytest.mark.parametrize("numel,chunk,parts", [(1000, 64, 3), (1000, 64, 4), (300, 256, 3), (100, 8, 8)],
                         ids=["3-parts", "4-parts", "short-last-chunk", "8-parts"])
def test_topk_segments_decode_to_their_part_of_the_whole_with_the_same_error_feedback(numel, chunk, parts):
    # Two codecs fed the same rounds: one encodes the whole chunk, the other its segments.
    whole, split = TopKCodec(numel, 0.1, 2, chunk), TopKCodec(numel, 0.1, 2, chunk)
    segments = split.segments(parts)
    assert all(start % chunk == 0 for start, _ in segments) and segments[-1][1] == numel
    for round_ in range(3):
        x = _signal(numel, round_)
        reference = whole.decode(whole.encode(x))
        payloads = split.encode_segments(x, segments)
        pieces = [split.for_length(end - start) for start, end in segments]
        assert [p.numel() for p in payloads] == [piece.payload_bytes() for piece in pieces]
        stitched = torch.cat([piece.decode(p) for piece, p in zip(pieces, payloads)])
        assert torch.equal(stitched, reference), f"round {round_}"
        assert torch.equal(split.error, whole.error)


def test_an_exact_sum_round_trips_bit_for_bit_and_forged_ones_are_refused():
    from archipelago.federation.codecs import PayloadError, pack_sum, sum_bytes_bound, unpack_sum

    total = torch.zeros(37)
    total[[0, 5, 8, 36]] = torch.tensor([1.5, -2.25e-30, -0.0, 3.0])  # -0.0: a trimmed mean can make one
    payload = pack_sum(total)
    assert payload.numel() == 5 + 4 * 4  # a 37-bit bitmap in 5 bytes, then 4 fp32 values
    assert torch.equal(unpack_sum(payload, 37).view(torch.int32), total.view(torch.int32))  # every bit, +-0.0 too
    dense = torch.arange(1.0, 38.0)
    assert pack_sum(dense).numel() == sum_bytes_bound(37)
    for forged, reason in [(payload[:-4], "bytes"), (payload[:3], "bitmap"),
                           (torch.cat([payload[:4], torch.tensor([0xFF], dtype=torch.uint8), payload[5:]]), "past"),
                           (torch.cat([payload[:-4], torch.zeros(4, dtype=torch.uint8)]), "zero"),
                           (torch.cat([payload[:-4], torch.tensor([float("nan")]).view(torch.uint8)]), "finite")]:
        with pytest.raises(PayloadError, match=reason):
            unpack_sum(forged, 37)


def test_auto_takes_the_topk_reduce_scatter_from_the_island_count_where_its_bound_is_smaller():
    from archipelago.federation.exchange import sparse_two_phase

    numel = 2 ** 20  # 4,096 chunks of 256; 51 values sent per chunk at 20%
    codec = TopKCodec(numel, 0.2, 2, 256)
    # Per chunk: two bf16 scales, 2-bit codes, the indices' 2 low bits each and a 51 + 64-bit bitmap.
    payload = 4096 * 2 * 2 + 4096 * 51 * (2 + 2) // 8 + 4096 * 115 // 8
    assert codec.payload_bytes() == payload
    # Receiving per island: the all-gather (G - 1) payloads; the reduce-scatter (G - 1) times a
    # segment payload (payload / G) and a summed segment of n / G values, all nonzero once
    # G x 51 >= 256: a bitmap and fp32 values. Cheaper once G > 1 + (n/8 + 4n) / payload.
    threshold = math.floor(1 + (numel / 8 + 4 * numel) / payload) + 1
    assert threshold == 26
    assert [g for g in range(2, 40) if sparse_two_phase(codec, g)] == list(range(threshold, 40))
    for exchange, chosen in [("all_gather", []), ("reduce_scatter", list(range(2, 40)))]:
        forced = TopKCodec(numel, 0.2, 2, 256, exchange)
        assert [g for g in range(2, 40) if sparse_two_phase(forced, g)] == chosen


def test_auto_chooses_the_densest_codec_whose_exchange_fits_the_target():
    from archipelago.federation.auto_codec import choose_codec
    from archipelago.federation.codecs import AutoCodec
    from archipelago.federation.exchange import Framing

    numel = 10_000
    auto = AutoCodec(numel, FaultToleranceConfig(codec="auto", codec_block_size=256))
    # By hand, what one island receives from one other island (2 islands: all-gather rows of a
    # 16-byte header, rounded up to 8 bytes): fp32 4 bytes a value, bf16 2, int8 1 and a 4-byte
    # scale per block of 256 (40 blocks), top-k 20% of each chunk of 256 (51 values) at 2 bits and
    # two bf16 scales, the indices Elias-Fano coded: 2 low bits each and a 51 + 64-bit bitmap a chunk.
    rows = {"fp32": 16 + 40_000, "bf16": 16 + 20_000, "int8": 16 + 40 * 4 + 40 * 256,
            "topk": 16 + 40 * 4 + -(-40 * 51 * 2 // 8) + -(-40 * 115 // 8) + -(-40 * 51 * 2 // 8)}
    rows = {name: -(-size // 8) * 8 for name, size in rows.items()}
    link = 8e6  # 1 MB/s: an exchange of B bytes takes B / 1e6 seconds
    for target, want in [(0.041, "fp32"), (0.039, "bf16"), (0.020, "int8"), (0.010, "topk")]:
        assert choose_codec(auto, 2, link, target, Framing()) == want
        assert rows[want] / 1e6 <= target or want == "topk"
    assert choose_codec(auto, 2, link, 1e-9, Framing()) == min(rows, key=rows.get)  # nothing fits: fewest bytes


def test_auto_lets_the_averaged_moments_ride_only_with_a_codec_they_fit_beside():
    from archipelago.federation.auto_codec import choose_round
    from archipelago.federation.codecs import AutoCodec
    from archipelago.federation.exchange import Framing

    numel = 10_000
    auto = AutoCodec(numel, FaultToleranceConfig(codec="auto", codec_block_size=256))
    # By hand, as above (two islands, one row in each): the codecs' rows, and AdamW's two
    # fp32 moments as one more row of 8 bytes a value with its 16-byte header.
    rows = {"fp32": 40_016, "bf16": 20_016, "int8": 10_416, "topk": 1_776}
    moments = 16 + 8 * numel
    link = 8e6  # 1 MB/s
    for target, want in [(1.0, ("fp32", True)), (0.110, ("bf16", True)), (0.095, ("int8", True)),
                         (0.085, ("topk", True)),   # any codec with the moments before none
                         (0.080, ("fp32", False)),  # nothing fits beside them: the densest alone
                         (0.015, ("int8", False))]:
        assert choose_round(auto, 2, link, target, Framing(), 8 * numel) == want, target
        name, carried = want
        assert (rows[name] + moments * carried) / 1e6 <= target
    assert choose_round(auto, 2, link, 1.0, Framing()) == ("fp32", False)  # no moments averaged


def test_auto_prices_each_codec_by_its_cpu_seconds_beside_its_bytes():
    from archipelago.federation.auto_codec import choose_round
    from archipelago.federation.codecs import AutoCodec
    from archipelago.federation.exchange import Framing

    numel = 10_000
    auto = AutoCodec(numel, FaultToleranceConfig(codec="auto", codec_block_size=256))
    rows = {"fp32": 40_016, "bf16": 20_016, "int8": 10_416, "topk": 1_776}  # as above: two islands
    link = 8e6  # 1 MB/s: B bytes take B / 1e6 s
    # By its bytes top-k's 1.8 kB fit a 0.010 s target, but its decoding measured 0.02 s. Then
    # no codec fits, and the quickest is taken: int8's 10.4 kB with 0.001 s of CPU (0.0114 s).
    cpu = {"fp32": 0.001, "bf16": 0.001, "int8": 0.001, "topk": 0.02}
    assert choose_round(auto, 2, link, 0.010, Framing()) == ("topk", False)
    assert choose_round(auto, 2, link, 0.010, Framing(), cpu_s=cpu) == ("int8", False)
    assert rows["int8"] / 1e6 + cpu["int8"] < rows["topk"] / 1e6 + cpu["topk"]
    assert choose_round(auto, 2, link, 0.015, Framing(), cpu_s=cpu) == ("int8", False)  # which fits a wider target
    # fp32's 40 kB take 0.04 s; with 0.03 s more of CPU they miss a 0.05 s target that bf16 meets.
    assert choose_round(auto, 2, link, 0.05, Framing(), cpu_s={**cpu, "fp32": 0.03}) == ("bf16", False)
    # The moments' rows (80 kB) ride with fp32 by bytes (0.12 s), not once that round's own
    # CPU seconds (its moments checked too) are 0.05 s; until those are measured, fp32's own stand.
    moments = 8 * numel
    assert choose_round(auto, 2, link, 0.13, Framing(), moments, cpu) == ("fp32", True)
    assert choose_round(auto, 2, link, 0.13, Framing(), moments, {**cpu, "fp32+moments": 0.05}) == ("bf16", True)
    assert choose_round(auto, 2, link, 0.13, Framing(), moments, {**cpu, "fp32": 0.05}) == ("bf16", True)


def test_auto_agrees_on_the_lower_median_of_each_codecs_cpu_seconds(monkeypatch):
    from archipelago.federation import auto_codec

    claims = [[8e6, 10.0, 0.1, 0, 0.3, 2.0, 0, 0, 0, 0],         # an island that measured fp32, int8, top-k
              [4e6, 12.0, 0.2, 0, 0.1, 1.0, 0, 0, 0.5, 0],       # ... and int8 with the moments
              [9e6, 11.0, math.inf, 0, 0.2, 99.0, 0, 0, 0, 0]]   # a liar's fp32 and top-k

    class Done:
        def wait(self) -> None:
            pass

    def allgather(manager, values, count):
        assert values.numel() == 2 + 2 * 4 and count == len(claims)  # link, round, fp32..topk alone, with moments
        return Done(), [torch.tensor(row, dtype=torch.float64) for row in claims]

    monkeypatch.setattr(auto_codec, "allgather", allgather)
    manager = type("M", (), {"errored": lambda self: None})()
    agreed = auto_codec.agree_on_link(manager, 8e6, 10.0, 3, torch.device("cpu"), {"fp32": 0.1, "topk": 2.0})
    assert agreed is not None
    assert (agreed.link_bits_s, agreed.round_s) == (4e6, 11.0)  # the slowest link, the median round
    # Codec by codec, the lower median of what was measured (inf and 0: not measured): one
    # liar moves each by one place at most.
    assert agreed.cpu_s == {"fp32": 0.1, "int8": 0.2, "topk": 2.0, "int8+moments": 0.5}
    claims[:] = claims[1:]  # two islands, one of them lying: the lower claim, the honest one's here
    agreed = auto_codec.agree_on_link(manager, 8e6, 10.0, 2, torch.device("cpu"))
    assert agreed is not None and agreed.cpu_s == {"fp32": 0.2, "int8": 0.1, "topk": 1.0, "int8+moments": 0.5}
    claims[:] = [[0, 10.0, *[0.1] * 8]] * 2  # no link measured yet: nothing agreed
    assert auto_codec.agree_on_link(manager, 0.0, 10.0, 2, torch.device("cpu")) is None


@pytest.mark.parametrize("settings,want", [
    (dict(), 0.05 * 12.0),                                              # a twentieth of the round
    (dict(num_fragments=4, fragment_sync_delay=2), 0.5 * 2 / 5 * 12.0),  # half of 2 of each fragment's 5 steps
    (dict(num_fragments=10, fragment_sync_delay=1), 0.5 * 1 / 2 * 12.0),  # half of 1 of each fragment's 2 steps
    (dict(num_fragments=4, fragment_sync_delay=0), 0.05 * 12.0),        # streaming without an overlap
    (dict(fragment_sync_delay=1), 0.05 * 12.0),                          # half of 1 of 20 steps: under 5%
    (dict(num_fragments=4, fragment_sync_delay=2, target_exchange_s=0.3), 0.3),  # the user's target wins
    (dict(round_pacing="time"), 0.05 * 12.0),
], ids=["plain", "streaming-overlap", "ten-fragments", "streaming-no-overlap", "short-overlap", "explicit",
        "time-paced"])
def test_auto_target_counts_the_inner_steps_an_overlapped_exchange_hides_behind(settings, want):
    from archipelago.federation.auto_codec import auto_target_s

    ft = FaultToleranceConfig(codec="auto", sync_steps=20, **settings)
    assert auto_target_s(ft, 12.0) == pytest.approx(want)


def test_auto_measures_the_link_without_the_inner_steps_that_ran_after_the_rows_came_in():
    # Streaming: the rows of 1 MB came in 0.1 s after the exchange started, then inner
    # steps ran for 1.9 s before perform waited. The link is 1 MB over about 0.1 s (80
    # Mbit/s), not over 2 s (4 Mbit/s), else codec = "auto" would pick ever sparser codecs.
    import time

    from archipelago.federation.attempts import Pending
    from archipelago.federation.exchange import Framing, Gathered

    loop = _outer_loop("auto")
    loop.manager.errored = lambda: None  # type: ignore[attr-defined]
    waited = time.perf_counter()
    started = waited - 2.0
    pending = Pending(0, gathered=Gathered(None, Framing(), received=1_000_000, done_at=[started + 0.1]),
                       started=started, waited=waited)
    loop.attempts.measure_link(pending, carried=True)
    assert loop.auto.link_bits_s == pytest.approx(80e6)  # the rows' own 0.1 s: nothing after the wait counts
    pending.gathered.done_at = []  # a transport without completion times: the time the wait returned
    pending.waited = time.perf_counter()
    pending.started = pending.waited - 2.0
    loop.attempts.measure_link(pending, carried=True)
    assert 3.9e6 < loop.auto.link_bits_s <= 4e6
    # The exchange's own start counts (handed to the transport 1 s before the island's later
    # bookkeeping), and a stamp can never put the rows in before it. Here the rows count as
    # in when a reduce-scatter started, so only the 0.5 s after the wait (its second phase)
    # remain: 16 Mbit/s (without the clamp the time would be negative and nothing measured).
    pending.waited = time.perf_counter() - 0.5
    pending.gathered.started, pending.started = pending.waited - 1.0, pending.waited - 0.5
    pending.gathered.done_at = [pending.waited - 3.0]
    pending.gathered.segments = [(0, 1), (1, 2)]
    loop.attempts.measure_link(pending, carried=True)
    assert 14e6 < loop.auto.link_bits_s <= 16e6


def test_auto_measures_an_all_gather_without_the_decoding_that_followed_its_rows():
    # Top-k's 1 MB of rows came in 0.1 s after the exchange started; opening and decoding
    # them took 1.5 s more on the island's CPU. The link is 80 Mbit/s, not 1 MB over 1.6 s
    # (5 Mbit/s): counted as link time, decoding made top-k measure a thin link and choose
    # itself round after round. A reduce-scatter's seconds after the wait are its second
    # phase's transfer, and still count.
    import time

    from archipelago.federation.attempts import Pending
    from archipelago.federation.exchange import Framing, Gathered

    loop = _outer_loop("auto")
    loop.manager.errored = lambda: None  # type: ignore[attr-defined]
    waited = time.perf_counter() - 1.5
    started = waited - 0.1
    gathered = Gathered(None, Framing(), received=1_000_000, done_at=[started + 0.1], started=started)
    loop.attempts.measure_link(Pending(0, gathered=gathered, started=started, waited=waited), carried=True)
    assert loop.auto.link_bits_s == pytest.approx(80e6)
    gathered.segments = [(0, 1), (1, 2)]
    loop.attempts.measure_link(Pending(0, gathered=gathered, started=started, waited=waited), carried=True)
    assert 4.5e6 < loop.auto.link_bits_s <= 5e6


def test_auto_measures_each_codecs_cpu_seconds_apart_from_the_link():
    # A one-phase exchange: encoding (0.2 s) and opening, judging and decoding its rows
    # (1.5 s) are the island's CPU, timed for the codec the round took (here int8, auto's
    # first) and, apart, for it with the moments. A reduce-scatter's seconds after the wait
    # include its second phase's transfer, which the link's rate already holds: only its
    # encoding counts.
    import time

    from archipelago.federation.attempts import Pending
    from archipelago.federation.exchange import Framing, Gathered

    loop = _outer_loop("auto")
    loop.manager.errored = lambda: None  # type: ignore[attr-defined]
    waited = time.perf_counter() - 1.5
    started = waited - 0.1
    gathered = Gathered(None, Framing(), encode_s=0.2, received=1_000_000, done_at=[started + 0.1], started=started)
    loop.auto.carries_moments = False
    loop.attempts.measure_link(Pending(0, gathered=gathered, started=started, waited=waited), True, decode_s=1.5)
    assert loop.auto.cpu_s == {"int8": pytest.approx(1.7)}
    loop.auto.carries_moments = True
    gathered.segments = [(0, 1), (1, 2)]
    loop.attempts.measure_link(Pending(0, gathered=gathered, started=started, waited=waited), True, decode_s=1.5)
    assert loop.auto.cpu_s == {"int8": pytest.approx(1.7), "int8+moments": pytest.approx(0.2)}
    gathered.received, gathered.segments, loop.auto.carries_moments = 0, None, False  # alone: nothing decoded
    loop.attempts.measure_link(Pending(0, gathered=gathered, started=started, waited=waited), True, decode_s=0.01)
    assert loop.auto.cpu_s["int8"] == pytest.approx(1.7)


def test_only_a_cpu_wire_stamps_completion_times():
    # NCCL's future completes when the collective is enqueued (torch's Work.get_future), not
    # when the rows are in: a GPU wire takes the wait's return instead.
    from archipelago.federation.exchange import completion_stamps

    assert completion_stamps(torch.device("cpu")) == []
    assert completion_stamps(torch.device("cuda", 0)) is None


def test_gloo_work_reports_its_completion_time():
    # codec = "auto" stamps when the rows came in through the work's future; torchft's
    # process groups hand back torch's gloo work, which has one.
    import time

    import torch.distributed as dist

    from archipelago.federation.exchange import stamp_completion

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    outputs, done_at = [torch.zeros(4)], []
    before = time.perf_counter()
    work = pg.allgather([outputs], [torch.arange(4.0)])
    stamp_completion(work, done_at)
    work.wait()
    deadline = time.monotonic() + 10
    while not done_at and time.monotonic() < deadline:  # the callback runs on gloo's thread
        time.sleep(0.01)
    assert len(done_at) == 1 and before <= done_at[0] <= time.perf_counter()
    assert torch.equal(outputs[0], torch.arange(4.0))
    stamp_completion(object(), done_at)  # no future: nothing stamped, nothing raised
    assert len(done_at) == 1


def test_auto_sends_what_topk_held_back_with_the_next_dense_round():
    from archipelago.federation.codecs import AutoCodec

    auto = AutoCodec(1000, FaultToleranceConfig(codec="auto", topk_fraction=0.05))
    inputs = [_signal(1000, seed) for seed in range(4)]
    sent = torch.zeros(1000)
    for k, x in enumerate(inputs):
        auto.choose("topk" if k < 3 else "fp32")
        residue = auto.take_residue()
        assert (residue is None) == (k < 3)
        payload = auto.encode(x + (residue if residue is not None else 0))
        sent += auto.decode(payload)
    # Error feedback then one fp32 round: everything the islands' inputs held has been sent.
    torch.testing.assert_close(sent, sum(inputs), rtol=0, atol=1e-5)
    assert not auto.options["topk"].error.any()


@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_topk_error_decay_scales_the_residue_before_it_rejoins(decay):
    decayed = TopKCodec(512, 0.1, 2, 64, decay=decay)
    x0, x1 = _signal(512, 1), _signal(512, 2)
    decayed.encode(x0)
    residue = decayed.error.clone()
    assert residue.any()
    # Reference: a fresh codec (no residue) given the input with the decayed residue added by hand.
    reference = TopKCodec(512, 0.1, 2, 64)
    want = reference.decode(reference.encode(x1 + decay * residue))
    got = decayed.decode(decayed.encode(x1))
    assert torch.equal(got, want) and torch.equal(decayed.error, reference.error)
