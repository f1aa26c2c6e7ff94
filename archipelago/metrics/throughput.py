"""Tokens/s over a sliding window, and model FLOPs utilization (MFU).

MFU = achieved model FLOP/s / peak hardware FLOP/s. The peak comes from a
datasheet table for known accelerators, an explicit override, or (for CPUs
and unknown GPUs) a quick matmul benchmark.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

log = logging.getLogger("archipelago.metrics")

# Dense peak FLOP/s for 16-bit (bf16/fp16) tensor-core matmuls, from vendor
# datasheets, WITHOUT 2:4 structured sparsity (marketing numbers that include
# sparsity are 2x these). First case-insensitive substring match of
# torch.cuda.get_device_name() wins, so more specific names come first.
_BF16_DENSE_PEAK: list[tuple[str, float]] = [
    ("H200", 989e12),  # H200 SXM, same tensor cores as H100 SXM
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # H100 SXM5 (reported as "NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]

# fp32 matmuls on NVIDIA tensor cores run as TF32 at half the bf16 rate
# (e.g. H100 SXM 494.5 TFLOP/s) - only when TF32 is enabled, e.g.
# torch.set_float32_matmul_precision("high"); true-FP32 peaks are far lower.
# For AMD this halving is an approximation.
_FP32_FACTOR = 0.5

_MEASURE_SECONDS = 0.3
_measured_cache: dict[tuple[str, torch.dtype], float] = {}


def peak_flops_per_s(
    device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0
) -> tuple[float, str]:
    """Peak FLOP/s of `device` for `dtype` matmuls and how it was obtained.

    Order: `override_tflops` (> 0, in TFLOP/s) -> datasheet table for known
    GPUs -> measured matmul throughput (cached per device type and dtype;
    the first call costs ~0.5 s).
    """
    if override_tflops > 0:
        return override_tflops * 1e12, f"override ({override_tflops:g} TFLOP/s)"
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        table = _table_peak(name, dtype)
        if table is not None:
            return table
        log.info("no datasheet peak for %r; measuring a matmul benchmark "
                 "(set an explicit peak TFLOP/s override for exact MFU)", name)
    return measured_peak_flops_per_s(device, dtype), "measured matmul peak"


def _table_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    lowered = device_name.lower()
    for key, bf16_peak in _BF16_DENSE_PEAK:
        if key.lower() in lowered:
            if dtype == torch.float32:
                return bf16_peak * _FP32_FACTOR, f"table: {key} tf32 dense"
            return bf16_peak, f"table: {key} bf16 dense"
    return None


def measured_peak_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    """Achieved FLOP/s of square matmuls on `device` (cached in-process)."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _measured_cache:
        _measured_cache[key] = _benchmark_matmul(device, dtype)
    return _measured_cache[key]


def _benchmark_matmul(device: torch.device, dtype: torch.dtype) -> float:
    # 1024^2 keeps the CPU benchmark short; GPUs need bigger tiles to saturate.
    n = 4096 if device.type == "cuda" else 1024
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
    except (RuntimeError, TypeError):
        dtype = torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: thread pools, kernel selection, clocks
        a @ b
    _sync(device)
    # The fastest of several short timings, not the mean: a peak measured while other
    # processes share the cores (islands starting beside this one) would come out low and
    # put MFU above 100% once they settle. GPUs time batches of 4 to cover launch latency.
    batch = 4 if device.type == "cuda" else 1
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < _MEASURE_SECONDS:
        t0 = time.perf_counter()
        for _ in range(batch):
            a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 * batch / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ThroughputMeter:
    """Tokens/s over the last `window` steps, plus running totals.

    A sliding window follows speed changes (e.g. after a slow first step with
    compilation) without the noise of a single step.
    """

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"ThroughputMeter window must be >= 1, got {window}")
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)
        self.total_tokens = 0.0
        self.total_seconds = 0.0

    def update(self, tokens: float, seconds: float) -> None:
        """Record one step that processed `tokens` in `seconds` (wall time)."""
        self._recent.append((float(tokens), float(seconds)))
        self.total_tokens += tokens
        self.total_seconds += seconds

    def tokens_per_s(self) -> float:
        """Windowed tokens/s (total tokens / total seconds of the window); 0 if unknown."""
        seconds = sum(s for _, s in self._recent)
        return sum(t for t, _ in self._recent) / seconds if seconds > 0 else 0.0

    def mfu(self, flops_per_token: float, peak: float) -> float:
        """Model FLOPs utilization as a fraction (0.42 = 42%) of `peak` FLOP/s.

        `flops_per_token` is the model's training FLOPs per token (about
        6 x params + attention) and `peak` is for the same set of devices the
        tokens were processed on.
        """
        if peak <= 0:
            return 0.0
        return self.tokens_per_s() * flops_per_token / peak
