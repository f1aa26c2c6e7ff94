"""Post-run report: a loss plot and a short Markdown summary of a run directory."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from archipelago.metrics.jsonl import MetricsHistory, read_metrics

log = logging.getLogger("archipelago.metrics")

# Summary fields shown first, in this order; other scalar fields follow.
_PREFERRED_FIELDS = (
    "steps", "tokens", "wall_s", "final_loss", "val_loss", "params", "tokens_per_s", "mfu",
)


def write_report(run_dir: Path) -> tuple[Path, Path]:
    """Write run_dir/report/loss.png and run_dir/report/report.md.

    Reads run_dir/metrics.jsonl (required) and run_dir/summary.json
    (optional). Returns (png_path, markdown_path).
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"is {run_dir} a run directory? expected metrics.jsonl at {metrics_path}"
        )
    history = read_metrics(metrics_path)
    summary = _read_summary(run_dir / "summary.json")
    name = str(summary.get("run_name") or summary.get("name") or run_dir.resolve().name)
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    png = _plot_loss(history, name, out_dir / "loss.png")
    md = out_dir / "report.md"
    md.write_text(_markdown(name, history, summary, png.name), encoding="utf-8")
    log.info("wrote report %s", md)
    return png, md


def _read_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s (%s)", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _series(history: MetricsHistory, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the step records whose `key` is a finite number."""
    xs, ys = [], []
    for record in history.steps:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(record["step"])
            ys.append(float(value))
    return xs, ys


def _plot_loss(history: MetricsHistory, name: str, path: Path) -> Path:
    # Figure + Agg canvas directly instead of pyplot: no global backend
    # switch, no GUI, safe in threads and headless servers.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    train_x, train_y = _series(history, "loss")
    val_x, val_y = _series(history, "val_loss")
    if train_x:
        ax.plot(train_x, train_y, linewidth=1.0, label="train loss")
    if val_x:
        ax.plot(val_x, val_y, marker="o", linewidth=1.5, label="val loss")
    if not (train_x or val_x):
        ax.text(0.5, 0.5, "no loss values logged", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{name}: loss")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _markdown(name: str, history: MetricsHistory, summary: dict[str, Any], png_name: str) -> str:
    lines = [f"# Run report: {name}", "", f"![loss curve]({png_name})", ""]
    rows = _summary_rows(summary)
    if rows:
        lines += ["| field | value |", "| --- | --- |"]
        lines += [f"| {key} | {value} |" for key, value in rows]
        lines.append("")
    val_x, val_y = _series(history, "val_loss")
    if val_x:
        lines.append(
            f"Validation loss: first {val_y[0]:.4f} (step {val_x[0]}), "
            f"last {val_y[-1]:.4f} (step {val_x[-1]})."
        )
    else:
        lines.append("Validation loss: not logged.")
    resumes = sum(1 for e in history.events if e.get("event") == "resume")
    lines.append("")
    lines.append(f"Step records: {len(history.steps)}; events: {len(history.events)}"
                 + (f" (resumed {resumes}x)." if resumes else "."))
    return "\n".join(lines) + "\n"


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    keys = [k for k in _PREFERRED_FIELDS if k in summary]
    keys += [k for k in summary if k not in keys and k not in ("run_name", "name")]  # name is the title
    rows = []
    for key in keys:
        value = summary[key]
        if value is None or isinstance(value, (bool, int, float, str)):
            rows.append((key, _format_value(key, value)))
    return rows


def _format_value(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value).replace("|", "\\|")
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key == "wall_s":
        return f"{value:,.1f} s" + (f" ({value / 3600:.2f} h)" if value >= 3600 else "")
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.5g}"
