"""Post-run report: a loss plot and a short Markdown summary of a run directory.

A run directory is either one island's (metrics.jsonl, summary.json) or a local
federation's (federation.json and island-K/metrics.jsonl per island); the latter gets
loss against wall-clock time per island, kill/restart markers and the outer-step table.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from archipelago.metrics.islands import finite, is_federation_dir, is_step_record, island_records, load_federation
from archipelago.metrics.jsonl import MetricsHistory, read_metrics

log = logging.getLogger("archipelago.metrics")

# Summary fields shown first, in this order; other scalar fields follow.
_PREFERRED_FIELDS = (
    "steps", "tokens", "wall_s", "final_loss", "val_loss", "params", "tokens_per_s", "mfu",
)


def write_report(run_dir: Path, baseline: Path | None = None) -> tuple[Path, Path]:
    """Write run_dir/report/loss.png and run_dir/report/report.md.

    Reads run_dir/metrics.jsonl (required) and run_dir/summary.json
    (optional); for a federation run directory (no metrics.jsonl of its own,
    federation.json or island-K/metrics.jsonl instead) see write_federation_report.
    With `baseline` (another run directory, e.g. one island trained alone), the report
    ends with both runs' final validation loss side by side.
    Returns (png_path, markdown_path).
    """
    run_dir = Path(run_dir)
    compared = compare_with_baseline(run_dir, Path(baseline)) if baseline is not None else []
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file() and is_federation_dir(run_dir):
        png, md = write_federation_report(run_dir)
        if compared:
            md.write_text(md.read_text(encoding="utf-8") + "\n" + "\n".join(compared) + "\n", encoding="utf-8")
        return png, md
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"is {run_dir} a run directory? expected metrics.jsonl at {metrics_path} "
            "(or island-K/metrics.jsonl for a federation run)"
        )
    history = read_metrics(metrics_path)
    summary = _read_summary(run_dir / "summary.json")
    name = str(summary.get("run_name") or summary.get("name") or run_dir.resolve().name)
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    png = _plot_loss(history, name, out_dir / "loss.png")
    md = out_dir / "report.md"
    text = _markdown(name, history, summary, png.name)
    md.write_text(text + ("\n" + "\n".join(compared) + "\n" if compared else ""), encoding="utf-8")
    log.info("wrote report %s", md)
    return png, md


def final_validation(run_dir: Path) -> dict[str, Any]:
    """The last validation of a run: `val_loss`, the inner `step` it came after, and the
    `tokens` trained by then (a federation: by all its islands, from its last outer step).

    Raises FileNotFoundError when `run_dir` holds no run, ValueError when it logged no
    validation loss.
    """
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").is_file():
        islands = {0: read_metrics(run_dir / "metrics.jsonl").steps}
        federation = False
    elif is_federation_dir(run_dir):
        islands = {i["id"]: island_records(run_dir / f"island-{i['id']}") for i in load_federation(run_dir)["islands"]}
        federation = True
    else:
        raise FileNotFoundError(f"{run_dir} is not a run directory: expected metrics.jsonl or island-K/metrics.jsonl")
    last = None
    for records in islands.values():
        for r in records:
            if is_step_record(r) and finite(r.get("val_loss")) and (last is None or r["step"] >= last["step"]):
                last = r
    if last is None:
        raise ValueError(f"{run_dir} logged no validation loss; train with --training.val_every > 0")
    tokens = last.get("tokens") or 0
    if federation:  # every island's tokens, as the federation counted them at its last outer step
        outer = [r.get("federation_tokens") or 0 for rs in islands.values() for r in rs
                 if r.get("event") == "outer_step" and r.get("committed")]
        tokens = max(outer, default=tokens)
    return {"val_loss": float(last["val_loss"]), "step": int(last["step"]), "tokens": int(tokens),
            "kind": "federation" if federation else "one island", "islands": len(islands)}


def compare_with_baseline(run_dir: Path, baseline: Path) -> list[str]:
    """Markdown lines: the run's final validation loss beside a baseline run's."""
    run, base = final_validation(run_dir), final_validation(baseline)
    ratio = run["val_loss"] / base["val_loss"]
    change = (ratio - 1.0) * 100
    verdict = "lower (better)" if change < 0 else "higher (worse)"
    lines = ["## Compared with a baseline", "",
             "| run | kind | final val loss | inner steps | tokens | val loss / baseline's |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for path, v, r in ((run_dir, run, ratio), (baseline, base, 1.0)):
        kind = f"federation of {v['islands']}" if v["kind"] == "federation" else v["kind"]
        lines.append(f"| {Path(path).name} | {kind} | {v['val_loss']:.4f} | {v['step']} | "
                     f"{v['tokens']:,} | {r:.4f} |")
    lines += ["", f"Final validation loss {run['val_loss']:.4f} vs {base['val_loss']:.4f} for the baseline: "
              f"{abs(change):.1f}% {verdict}."]
    if run["step"] != base["step"]:
        lines.append(f"Note: the runs ended at different inner steps ({run['step']} and {base['step']}).")
    return lines


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


def _new_axes(width: float, height: float) -> Any:
    # Figure + Agg canvas directly instead of pyplot: no global backend
    # switch, no GUI, safe in threads and headless servers.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig.add_subplot(1, 1, 1)


def _save_loss_plot(ax: Any, drawn: bool, xlabel: str, title: str, path: Path) -> Path:
    """Legend (or a 'nothing logged' note), labels and grid; writes the figure to `path`."""
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no loss values logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    return path


def _plot_loss(history: MetricsHistory, name: str, path: Path) -> Path:
    ax = _new_axes(7.0, 4.5)
    train_x, train_y = _series(history, "loss")
    val_x, val_y = _series(history, "val_loss")
    if train_x:
        ax.plot(train_x, train_y, linewidth=1.0, label="train loss")
    if val_x:
        ax.plot(val_x, val_y, marker="o", linewidth=1.5, label="val loss")
    return _save_loss_plot(ax, bool(train_x or val_x), "step", f"{name}: loss", path)


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


# --------------------------------------------------------------- federation

# Launcher events drawn as vertical lines: (colour, line style).
_MARKERS = {"kill": ("tab:red", "--"), "restart": ("tab:green", ":")}
_EVENT_ROWS_MAX = 200  # quorum events can be one per outer step: keep the table readable


def write_federation_report(run_dir: Path) -> tuple[Path, Path]:
    """report/loss.png (loss per island against wall-clock time) and report/report.md.

    Uses federation.json when the launcher wrote one, else rebuilds the same summary
    from island-K/metrics.jsonl (without ranks, exit codes and kill/restart events).
    """
    run_dir = Path(run_dir)
    federation = load_federation(run_dir)
    records = {i["id"]: island_records(run_dir / f"island-{i['id']}") for i in federation["islands"]}
    t0 = _start_time(federation, records)
    name = run_dir.resolve().name
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    png = _plot_federation(records, federation, t0, name, out_dir / "loss.png")
    md = out_dir / "report.md"
    md.write_text(_federation_markdown(name, federation, t0, png.name), encoding="utf-8")
    log.info("wrote report %s", md)
    return png, md


def _start_time(federation: dict[str, Any], records: dict[int, list[dict[str, Any]]]) -> float:
    """Time zero of the plot: the launcher's start, else the earliest record."""
    times = [r["time"] for rs in records.values() for r in rs if finite(r.get("time"))]
    times += [e["time"] for e in federation.get("events", []) if finite(e.get("time"))]
    if finite(federation.get("start_time")):
        times.append(federation["start_time"])
    return min(times, default=0.0)


def _timed(records: list[dict[str, Any]], key: str, t0: float) -> tuple[list[float], list[float]]:
    """(seconds since t0, value) of the step records with a finite `key` and a time."""
    points = [(r["time"] - t0, float(r[key])) for r in records
              if is_step_record(r) and finite(r.get(key)) and finite(r.get("time"))]
    return [p[0] for p in points], [p[1] for p in points]


def _plot_federation(records: dict[int, list[dict[str, Any]]], federation: dict[str, Any],
                     t0: float, name: str, path: Path) -> Path:
    ax = _new_axes(8.0, 4.8)
    drawn = False
    for index, (island, island_records_) in enumerate(records.items()):
        colour = f"C{index % 10}"
        xs, ys = _break_at(*_timed(island_records_, "loss", t0), _gaps(island, island_records_, federation, t0))
        vx, vy = _timed(island_records_, "val_loss", t0)
        if xs:
            ax.plot(xs, ys, color=colour, linewidth=1.0, label=f"island {island} train")
        if vx:
            ax.plot(vx, vy, color=colour, marker="o", linestyle="none", label=f"island {island} val")
        drawn = drawn or bool(xs or vx)
    _draw_markers(ax, federation.get("events", []), t0)
    return _save_loss_plot(ax, drawn, "wall-clock time since start (s)", f"{name}: loss per island", path)


def _gaps(island: int, records: list[dict[str, Any]], federation: dict[str, Any], t0: float) -> list[float]:
    """Times at which the island was down (kills, resumes): its curve is not joined across them."""
    events = [e for e in federation.get("events", []) if e.get("island") == island and e.get("event") == "kill"]
    events += [r for r in records if r.get("event") == "resume"]
    return sorted(e["time"] - t0 for e in events if finite(e.get("time")))


def _break_at(xs: list[float], ys: list[float], cuts: list[float]) -> tuple[list[float], list[float]]:
    """Insert a NaN (matplotlib leaves a gap there) between points that a cut falls between."""
    out_x: list[float] = []
    out_y: list[float] = []
    for x, y in zip(xs, ys):
        if out_x and any(out_x[-1] < cut <= x for cut in cuts):
            out_x.append(math.nan)
            out_y.append(math.nan)
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def _draw_markers(ax: Any, events: list[dict[str, Any]], t0: float) -> None:
    """A vertical line per launcher kill/restart, labelled with its island."""
    for event in events:
        style = _MARKERS.get(str(event.get("event")))
        if style is None or event.get("source") != "launcher" or not finite(event.get("time")):
            continue
        x = event["time"] - t0
        ax.axvline(x, color=style[0], linestyle=style[1], linewidth=1.0)
        ax.annotate(f"{event['event']} {event.get('island')}", (x, 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize="x-small", color=style[0])


def _federation_markdown(name: str, federation: dict[str, Any], t0: float, png_name: str) -> str:
    agree = "yes" if federation.get("global_hash_agree") else "no"
    if federation.get("global_hash_outer_step") is not None:
        agree += f" (outer step {federation['global_hash_outer_step']}, the last all members committed)"
    lines = [f"# Federation report: {name}", "", f"![loss per island]({png_name})", ""]
    facts = [f"Islands: {len(federation['islands'])}", f"outer steps: {len(federation.get('outer_steps', []))}",
             f"final global weights agree: {agree}"]
    if finite(federation.get("wall_s")):
        facts.append(f"wall time: {_format_value('wall_s', federation['wall_s'])}")
    if federation.get("lighthouse"):
        facts.append(f"lighthouse: {federation['lighthouse']}")
    lines += ["; ".join(facts) + ".", ""]
    lines += _island_table(federation["islands"]) + [""]
    lines += _outer_step_table(federation.get("outer_steps", [])) + [""]
    lines += _event_table(federation.get("events", []), t0)
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "n/a" if value is None else str(value)


def _island_table(islands: list[dict[str, Any]]) -> list[str]:
    lines = ["## Islands", "",
             "| island | ranks | restarts | outer steps committed | final step | final loss | "
             "final val loss | global hash | exit code |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for i in islands:
        digest = f"`{i['global_hash'][:16]}`" if i.get("global_hash") else "n/a"
        lines.append(f"| {i['id']} | {_cell(i.get('ranks'))} | {_cell(i.get('restarts'))} | "
                     f"{_cell(i.get('outer_steps_committed'))} | {_cell(i.get('final_step'))} | "
                     f"{_cell(i.get('final_loss'))} | {_cell(i.get('final_val_loss'))} | {digest} | "
                     f"{_cell(i.get('exit_code'))} |")
    return lines


def _outer_step_table(outer_steps: list[dict[str, Any]]) -> list[str]:
    if not outer_steps:
        return ["## Outer steps", "", "No outer step was logged."]
    lines = ["## Outer steps", "",
             "| outer step | participants | committed by islands | healed | same hash | codec |",
             "| ---: | ---: | --- | --- | --- | --- |"]
    for entry in outer_steps:
        committed = ", ".join(map(str, entry.get("islands", []))) or "none"
        healed = ", ".join(map(str, entry.get("healed", []))) or "-"
        same = {True: "yes", False: "NO"}.get(bool(entry["hash_agree"]), "n/a") if "hash_agree" in entry else "n/a"
        lines.append(f"| {entry['outer_step']} | {entry.get('participants')} | {committed} | {healed} | {same} | "
                     f"{entry.get('codec', '-')} |")
    return lines


def _event_table(events: list[dict[str, Any]], t0: float) -> list[str]:
    if not events:
        return ["## Events", "", "No events were logged."]
    lines = ["## Events", "", "| t (s) | island | event | source | details |", "| ---: | ---: | --- | --- | --- |"]
    for event in events[:_EVENT_ROWS_MAX]:
        when = f"{event['time'] - t0:.1f}" if finite(event.get("time")) else "n/a"
        details = ", ".join(f"{k}={v}" for k, v in event.items()
                            if k not in ("time", "island", "event", "source") and not isinstance(v, (dict, list)))
        details = details.replace("|", "\\|")  # a pipe would end the Markdown cell
        lines.append(f"| {when} | {event.get('island')} | {event.get('event')} | {event.get('source', '')} | "
                     f"{details} |")
    if len(events) > _EVENT_ROWS_MAX:
        lines.append(f"\n... and {len(events) - _EVENT_ROWS_MAX} more events (see federation.json).")
    return lines
