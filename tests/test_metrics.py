"""Tests for archipelago.metrics."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from archipelago.metrics import (
    MetricsLog,
    ProgressDisplay,
    TensorBoardLog,
    ThroughputMeter,
    peak_flops_per_s,
    read_metrics,
    write_json_atomic,
    write_report,
)
from archipelago.metrics import throughput as throughput_mod
from archipelago.metrics.progress import format_count, format_duration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -------------------------------------------------------------------- jsonl


def test_jsonl_round_trip_writes_non_finite_as_null(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLog(path) as mlog:
        mlog.log({"event": "start", "config": {"lr": 3e-4}})
        mlog.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
        mlog.log({"step": 2, "loss": torch.tensor(2.5), "tokens": torch.tensor(7)})
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert json.loads(lines[1]) == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3}
    history = read_metrics(path)
    assert history.events == [{"event": "start", "config": {"lr": 3e-4}}]
    assert history.steps == [
        {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3},
        {"step": 2, "loss": 2.5, "tokens": 7},
    ]


def test_read_metrics_keeps_last_record_per_step_after_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as mlog:
        for step in (1, 2, 3, 4):
            mlog.log({"step": step, "loss": 10.0 - step, "run": "first"})
        mlog.log({"event": "resume", "step": 2})
        for step in (3, 4, 5):
            mlog.log({"step": step, "loss": 5.0 - step, "run": "second"})
    with open(path, "a") as f:
        f.write('{"step": 6, "loss": 1.')  # line cut by a crash
    with caplog.at_level(logging.WARNING, logger="archipelago.metrics"):
        history = read_metrics(path)
    assert [r["step"] for r in history.steps] == [1, 2, 3, 4, 5]
    assert [r["run"] for r in history.steps] == ["first", "first", "second", "second", "second"]
    assert history.steps[2]["loss"] == 2.0
    assert history.events == [{"event": "resume", "step": 2}]
    assert "malformed" in caplog.text


def test_disabled_metrics_log_writes_nothing(tmp_path: Path) -> None:
    mlog = MetricsLog(tmp_path / "metrics.jsonl", enabled=False)
    mlog.log({"step": 1})
    mlog.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_write_json_atomic(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"steps": 3, "val_loss": float("nan")})
    write_json_atomic(path, {"steps": 4, "val_loss": 2.0})
    assert json.loads(path.read_text()) == {"steps": 4, "val_loss": 2.0}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# -------------------------------------------------------------- tensorboard


def test_tensorboard_log_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardLog(tmp_path / "tb", enabled=True) as tb:
        assert tb.active
        # A step record as the trainer writes it: per-rank lists and text beside the numbers.
        tb.log(1, {"loss": 3.0, "val_loss": None, "rank_idle": [0.25, 0.5], "device": "cpu", "tokens": 64})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "rank_idle/0", "rank_idle/1", "tokens"]
    assert [e.value for e in events.Scalars("rank_idle/1")] == [0.5]


def test_tensorboard_missing_warns_once_and_no_ops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    with caplog.at_level(logging.WARNING, logger="archipelago.metrics"):
        tb = TensorBoardLog(tmp_path / "tb", enabled=True)
        tb.log(1, {"loss": 1.0})
        tb.close()
    assert not tb.active
    assert caplog.text.count("pip install archipelago[tensorboard]") == 1


# ----------------------------------------------------------------- progress


def test_plain_progress_prints_one_line_per_update() -> None:
    out = io.StringIO()
    with ProgressDisplay(total_steps=300, start_step=0, mode="plain", file=out) as progress:
        progress.update(40, {"loss": 5.1234, "lr": 3e-4, "tokens_per_s": 12345.0,
                             "mfu": 0.031, "val_loss": 5.4})
        progress.message("saved checkpoint step-00000040")
        progress.update(50, {"loss": float("nan")})
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 40/300 | loss 5.123 | lr 3.0e-04 | 12.3k tok/s | mfu 3.1% | val 5.400"
    assert lines[1] == "saved checkpoint step-00000040"
    assert lines[2].startswith("step 50/300 | loss nan | eta ")
    assert len(lines) == 3


def test_eta_is_capped_by_the_time_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("archipelago.metrics.progress.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    progress = ProgressDisplay(total_steps=100000, mode="plain", file=out, time_limit_s=90)
    progress.update(1, {})
    clock[0] += 10  # 10 s per step: 99,998 steps to go would take 11+ days
    progress.update(2, {})
    assert out.getvalue().splitlines()[-1].endswith("eta 1m20s")  # what is left of the 90 s budget


def test_auto_mode_is_plain_for_non_tty_and_off_prints_nothing() -> None:
    out = io.StringIO()
    assert ProgressDisplay(10, mode="auto", file=out).mode == "plain"
    off = ProgressDisplay(10, mode="plain", enabled=False, file=out)
    off.update(1, {"loss": 1.0})
    off.message("hidden")
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="auto, rich, plain, off"):
        ProgressDisplay(10, mode="fancy")


def test_forced_rich_mode_does_not_crash_on_non_tty() -> None:
    out = io.StringIO()
    with ProgressDisplay(total_steps=20, start_step=5, mode="rich", file=out, title="t") as progress:
        assert progress.mode == "rich"
        for step in range(6, 21):
            progress.update(step, {"loss": 4.0 - step / 10, "lr": 1e-3, "tokens_per_s": 999.0})
        progress.message("hello from above the bar")
    assert "hello from above the bar" in out.getvalue()
    progress.close()  # idempotent


def test_progress_survives_closed_stream() -> None:
    out = io.StringIO()
    progress = ProgressDisplay(10, mode="plain", file=out)
    out.close()
    progress.update(1, {"loss": 1.0})  # must not raise
    assert progress.mode == "off"


def test_formatters() -> None:
    assert format_count(950) == "950" and format_count(12345) == "12.3k"
    assert format_count(2.5e6) == "2.5M"
    assert format_duration(45) == "45s" and format_duration(192) == "3m12s"
    assert format_duration(3725) == "1h02m"


# --------------------------------------------------------------- throughput


def test_throughput_meter_sliding_window_and_mfu() -> None:
    meter = ThroughputMeter(window=3)
    assert meter.tokens_per_s() == 0.0
    for tokens, seconds in [(100, 10.0), (1000, 1.0), (2000, 1.0), (3000, 2.0)]:
        meter.update(tokens, seconds)
    # Window holds the last 3 steps: (1000 + 2000 + 3000) / (1 + 1 + 2) = 1500.
    assert meter.tokens_per_s() == pytest.approx(1500.0)
    assert meter.total_tokens == 6100 and meter.total_seconds == pytest.approx(14.0)
    # 1500 tok/s * 6e9 FLOP/token = 9e12 FLOP/s of a 90e12 peak = 10%.
    assert meter.mfu(flops_per_token=6e9, peak=90e12) == pytest.approx(0.10)
    assert meter.mfu(6e9, 0.0) == 0.0
    with pytest.raises(ValueError):
        ThroughputMeter(window=0)


def test_peak_override_and_table_lookup() -> None:
    peak, source = peak_flops_per_s(torch.device("cpu"), torch.bfloat16, override_tflops=312)
    assert peak == 312e12 and "override" in source
    assert throughput_mod._table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == (989e12, "table: H100 bf16 dense")
    assert throughput_mod._table_peak("NVIDIA H100 PCIe", torch.bfloat16)[0] == 756e12
    assert throughput_mod._table_peak("NVIDIA H200", torch.float32)[0] == pytest.approx(494.5e12)
    assert throughput_mod._table_peak("AMD Instinct MI300X", torch.bfloat16)[0] == 1307e12
    assert throughput_mod._table_peak("Some Future GPU", torch.bfloat16) is None


def test_measured_peak_on_cpu_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throughput_mod, "_MEASURE_SECONDS", 0.05)
    monkeypatch.setattr(throughput_mod, "_measured_cache", {})
    peak, source = peak_flops_per_s(torch.device("cpu"), torch.float32)
    assert source == "measured matmul peak" and peak > 1e8
    again, _ = peak_flops_per_s(torch.device("cpu"), torch.float32)
    assert again == peak  # cached, not re-measured


# ------------------------------------------------------------------- report


def make_run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "tiny-run"
    with MetricsLog(run / "metrics.jsonl") as mlog:
        mlog.log({"event": "start"})
        for step in range(1, 31):
            record = {"step": step, "loss": 6.0 * math.exp(-step / 20), "lr": 1e-3}
            if step % 10 == 0:
                record["val_loss"] = 6.5 * math.exp(-step / 25)
            mlog.log(record)
        mlog.log({"event": "resume", "step": 20})
        mlog.log({"step": 30, "loss": 1.5, "val_loss": 1.2345})
    write_json_atomic(run / "summary.json", {
        "run_name": "tiny-run", "steps": 30, "tokens": 122880, "wall_s": 12.5,
        "final_loss": 1.5, "val_loss": 1.2345, "params": 1234567,
        "tokens_per_s": 9830.4, "mfu": 0.0312, "config": {"ignored": True},
    })
    return run


def test_report_writes_png_and_markdown(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path)
    png, md = write_report(run)
    assert png == run / "report" / "loss.png" and md == run / "report" / "report.md"
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    text = md.read_text()
    assert "# Run report: tiny-run" in text
    assert "![loss curve](loss.png)" in text
    assert "last 1.2345 (step 30)" in text
    assert "| mfu | 3.1% |" in text and "| params | 1,234,567 |" in text
    assert "| val_loss | 1.2345 |" in text
    assert "resumed 1x" in text
    assert "ignored" not in text


def test_report_without_summary_still_works(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    with MetricsLog(run / "metrics.jsonl") as mlog:
        mlog.log({"step": 1, "loss": float("nan")})
    png, md = write_report(run)
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "Validation loss: not logged." in md.read_text()


def test_report_missing_metrics_gives_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="expected metrics.jsonl"):
        write_report(tmp_path)


def _val_run(path: Path, val_losses: dict[int, float], tokens_per_step: int = 1024) -> Path:
    with MetricsLog(path / "metrics.jsonl") as mlog:
        mlog.log({"step": 0, "val_loss": 8.3, "tokens": 0})
        for step, val in val_losses.items():
            mlog.log({"step": step, "loss": val + 0.1, "val_loss": val, "tokens": step * tokens_per_step})
    return path


def test_report_puts_a_baseline_beside_a_federation(tmp_path: Path) -> None:
    fed = tmp_path / "fed"
    for island in (0, 1):  # both islands end on the same global weights
        _val_run(fed / f"island-{island}", {100: 5.2, 200: 4.8})
        with MetricsLog(fed / f"island-{island}" / "metrics.jsonl") as mlog:
            mlog.log({"event": "outer_step", "step": 200, "outer_step": 10, "committed": True,
                      "federation_tokens": 409600})
    base = _val_run(tmp_path / "alone", {100: 5.3, 200: 5.0})
    png, md = write_report(fed, baseline=base)
    text = md.read_text()
    assert "## Compared with a baseline" in text
    assert "| fed | federation of 2 | 4.8000 | 200 | 409,600 | 0.9600 |" in text
    assert "| alone | one island | 5.0000 | 200 | 204,800 | 1.0000 |" in text
    assert "4.0% lower (better)" in text


def test_report_baseline_without_validation_is_refused_by_the_cli(tmp_path: Path) -> None:
    run = _val_run(tmp_path / "run", {10: 5.0})
    bare = tmp_path / "bare"
    with MetricsLog(bare / "metrics.jsonl") as mlog:
        mlog.log({"step": 1, "loss": 6.0})
    from archipelago.launch.cli import main

    assert main(["report", str(run), "--baseline", str(bare)]) == 2
    assert main(["report", str(run), "--baseline", str(tmp_path / "missing")]) == 2


def test_mfu_above_a_measured_peak_is_shown_as_n_a_with_one_warning(caplog) -> None:
    from types import SimpleNamespace

    from archipelago.metrics.progress import format_metrics
    from archipelago.trainer import RunMetrics

    measured = SimpleNamespace(peak_source="measured matmul peak", peak=5e10, _mfu_warned=False)
    with caplog.at_level("WARNING"):
        assert RunMetrics.shown_mfu(measured, 0.4) == 0.4
        assert RunMetrics.shown_mfu(measured, 1.3) is None
        assert RunMetrics.shown_mfu(measured, 1.7) is None
    warnings = [r.getMessage() for r in caplog.records if "MFU shown as n/a" in r.getMessage()]
    assert len(warnings) == 1 and "--metrics.peak_tflops" in warnings[0] and "130%" in warnings[0]
    stated = SimpleNamespace(peak_source="override (0.05 TFLOP/s)", peak=5e10, _mfu_warned=False)
    assert RunMetrics.shown_mfu(stated, 1.3) == 1.3  # a peak the user stated is taken as given
    assert "mfu n/a" in format_metrics({"loss": 5.0, "mfu": None})


def test_a_token_budget_drives_the_progress_line_and_eta_not_the_step_count(monkeypatch) -> None:
    import io

    from archipelago.metrics import progress as progress_module
    from archipelago.metrics.progress import ProgressDisplay

    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    display = ProgressDisplay(400_000, mode="plain", file=out, budget_unit="tok")
    display.update(10, {"loss": 5.0}, position=100_000)
    display.update(20, {"loss": 4.9}, position=200_000)  # 100k tokens in 10 s: 200k left -> 20 s
    display.update(25, {"loss": 4.8}, position=300_000)  # 200k in 30 s: 100k left -> 15 s
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("step 20 | federation 200k/400k tok (50%)"), lines
    assert lines[1].endswith("eta 20s") and lines[2].endswith("eta 15s"), lines
    assert "/400" not in lines[2].split("|")[0]  # no step total: an island's steps do not end the run


def test_an_island_healed_in_the_last_round_ends_at_the_step_it_caught_up_to() -> None:
    from archipelago.metrics.islands import summarize_island

    # Killed after step 20 of 40, restarted, healed in the last round: it catches up to 40
    # and logs no training step after that (the federation's file said 20).
    records = ([{"step": s, "loss": 3.0} for s in range(1, 21)]
               + [{"event": "heal", "step": 20, "outer_step": 4, "to_step": 40},
                  {"event": "outer_step", "step": 20, "outer_step": 4, "committed": True}])
    assert summarize_island(records)["final_step"] == 40
    # A heal to a step it later trains past does not hold the figure back.
    records += [{"event": "heal", "step": 4, "outer_step": 1, "to_step": 10}, {"step": 44, "loss": 2.0}]
    assert summarize_island(records)["final_step"] == 44
    assert summarize_island([])["final_step"] is None
