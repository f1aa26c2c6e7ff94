"""Metrics: JSONL log, TensorBoard, console progress, throughput/MFU, reports."""

from archipelago.metrics.jsonl import MetricsHistory, MetricsLog, read_metrics, to_jsonable
from archipelago.metrics.progress import ProgressDisplay, format_metrics
from archipelago.metrics.report import write_report
from archipelago.metrics.summary import write_json_atomic
from archipelago.metrics.tensorboard import TensorBoardLog
from archipelago.metrics.throughput import (
    ThroughputMeter,
    measured_peak_flops_per_s,
    peak_flops_per_s,
)

__all__ = [
    "MetricsHistory",
    "MetricsLog",
    "ProgressDisplay",
    "TensorBoardLog",
    "ThroughputMeter",
    "format_metrics",
    "measured_peak_flops_per_s",
    "peak_flops_per_s",
    "read_metrics",
    "to_jsonable",
    "write_json_atomic",
    "write_report",
]
