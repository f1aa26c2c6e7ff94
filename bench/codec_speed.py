"""Seconds each codec takes to encode and decode one island's pseudo-gradient.

The exchange's own cost beside its bytes: `codec = "auto"` counts only bytes, so a codec
whose encode or decode takes a visible share of a round lowers utilisation by that much
(docs/codecs.md). Also compares top-k's bit packing (whole codes per byte) with the
one-bit-at-a-time stream it replaced, on the same codes, and top-k's Elias-Fano index
coding with the fixed-width indices it replaced, on the same chosen indices, in the same run.

    python bench/codec_speed.py                       # llama3 debug's 7.2M values, 1 thread
    python bench/codec_speed.py --numel 124000000 --threads 8 --device cuda --out FILE

Prints a table (ratio first) and, with --out, writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import where_measured  # noqa: E402

from archipelago.config.schema import FaultToleranceConfig  # noqa: E402
from archipelago.federation.codecs import _pack, _pack_bits, _unpack, _unpack_bits, build_codec  # noqa: E402


def timed(device: torch.device, repeats: int, fn: Callable[..., object], *args: object) -> float:
    """Median seconds of `repeats` calls of fn(*args) after one warm-up (synchronised on a GPU)."""
    fn(*args)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def codec_rows(numel: int, device: torch.device, repeats: int) -> list[dict]:
    x = torch.randn(numel, device=device)
    rows = []
    for name in ("fp32", "bf16", "int8", "topk"):
        codec = build_codec(FaultToleranceConfig(codec=name), numel)
        payload = codec.encode(x)
        encode_s = timed(device, repeats, codec.encode, x)
        decode_s = timed(device, repeats, codec.decode, payload)
        rows.append({"codec": name, "bytes": payload.numel() * payload.element_size(),
                     "encode_s": encode_s, "decode_s": decode_s})
    return rows


def packing_rows(numel: int, device: torch.device, repeats: int) -> list[dict]:
    """Top-k's default payload: 20% of each chunk of 256, 8-bit indices and 2-bit codes."""
    sent = numel // 5
    rows = []
    for bits in (8, 2):
        codes = torch.randint(0, 2 ** bits, (sent,), dtype=torch.int32, device=device)
        packed = _pack(codes, bits)
        assert torch.equal(packed, _pack_bits(codes, bits))  # the same bytes, or the comparison is void
        rows.append({"bits": bits, "values": sent,
                     "pack_s": timed(device, repeats, _pack, codes, bits),
                     "pack_bits_s": timed(device, repeats, _pack_bits, codes, bits),
                     "unpack_s": timed(device, repeats, _unpack, packed, bits, sent),
                     "unpack_bits_s": timed(device, repeats, _unpack_bits, packed, bits, sent)})
    return rows


def index_rows(numel: int, device: torch.device, repeats: int) -> list[dict]:
    """Top-k's indices at 20% (the default) and 5% of each chunk of 256: Elias-Fano against
    fixed width, the same indices (each codec's own choice of x's largest values)."""
    x = torch.randn(numel, device=device)
    rows = []
    for fraction in (0.2, 0.05):
        codec = build_codec(FaultToleranceConfig(codec="topk", topk_fraction=fraction), numel)
        _, index, _ = codec._select(x)
        row: dict = {"fraction": fraction, "k": codec.k, "chunk": codec.chunk}
        for name, elias_fano in (("elias_fano", True), ("fixed", False)):
            codec.elias_fano = elias_fano
            packed = codec._pack_index(index)
            assert torch.equal(codec._unpack_index(packed), index)  # lossless, or the comparison is void
            row[name] = {"index_bytes": packed.numel(), "payload_bytes": codec.payload_bytes(),
                         "pack_s": timed(device, repeats, codec._pack_index, index),
                         "unpack_s": timed(device, repeats, codec._unpack_index, packed)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=7_200_000, help="values per island (default: llama3 debug)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a 1-rank CPU island's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.numel < 256 or args.repeats < 1:
        p.error("--numel must be at least 256 and --repeats at least 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    codecs, packing = codec_rows(args.numel, device, args.repeats), packing_rows(args.numel, device, args.repeats)
    indices = index_rows(args.numel, device, args.repeats)
    print(f"{args.numel:,} values on {device} ({args.threads} thread(s)), median of {args.repeats}\n")
    print("| encode + decode / fp32's | codec | payload MB | encode s | decode s |")
    print("|---:|---|---:|---:|---:|")
    base = codecs[0]["encode_s"] + codecs[0]["decode_s"]
    for r in codecs:
        print(f"| {(r['encode_s'] + r['decode_s']) / base:.1f} | {r['codec']} | {r['bytes'] / 1e6:.2f} "
              f"| {r['encode_s']:.4f} | {r['decode_s']:.4f} |")
    print("\n| bit stream / whole codes per byte (pack) | (unpack) | bits | values | pack s | unpack s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in packing:
        print(f"| {r['pack_bits_s'] / r['pack_s']:.1f} | {r['unpack_bits_s'] / r['unpack_s']:.1f} | {r['bits']} "
              f"| {r['values']:,} | {r['pack_s']:.4f} | {r['unpack_s']:.4f} |")
    print("\n| payload bytes Elias-Fano / fixed | index bytes EF / fixed | top-k | pack s EF / fixed "
          "| unpack s EF / fixed |")
    print("|---:|---:|---|---:|---:|")
    for r in indices:
        ef, fixed = r["elias_fano"], r["fixed"]
        print(f"| {ef['payload_bytes'] / fixed['payload_bytes']:.3f} | {ef['index_bytes'] / fixed['index_bytes']:.3f} "
              f"| {r['fraction']:.0%} of {r['chunk']} ({r['k']}) | {ef['pack_s']:.4f} / {fixed['pack_s']:.4f} "
              f"| {ef['unpack_s']:.4f} / {fixed['unpack_s']:.4f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"numel": args.numel, "measured": where_measured(device=str(device)),
                                        "threads": args.threads, "codecs": codecs, "packing": packing,
                                        "indices": indices}, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
