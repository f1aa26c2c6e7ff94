"""What `archipelago local` shows: each island's output prefixed with its name, under a live
status table on a terminal (a status line every STATUS_EVERY_S elsewhere), from the islands'
metrics.jsonl as they grow."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan", "bright_magenta")
STATUS_EVERY_S = 10.0  # plain status line period when stdout is not a terminal
LIVE_HEADERS = ["island", "ranks", "state", "inner step", "outer step", "loss", "tokens/s", "participants"]


class MetricsTail:
    """Follows an island's metrics.jsonl as it grows, keeping the latest values for the table."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.latest: dict[str, Any] = {}
        self._offset = 0
        self._partial = b""  # a line still being written: completed by a later read

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # replaced or truncated: start over
                    self._offset, self._partial = 0, b""
                f.seek(self._offset)
                data = f.read()
        except OSError:  # not written yet
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._absorb(line)

    def _absorb(self, line: bytes) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            return
        if not isinstance(record, dict):
            return
        if record.get("event") == "outer_step":
            self.latest.update(outer_step=record.get("outer_step"), participants=record.get("participants"))
        elif "event" not in record and record.get("loss") is not None:
            self.latest.update(step=record.get("step"), loss=record.get("loss"),
                               tokens_per_s=record.get("tokens_per_s"))


# ------------------------------------------------------------------ output


class Output:
    """Island and launcher lines: colour prefixes on a terminal, plain prefixes elsewhere."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.lock = threading.Lock()  # reader threads print concurrently
        self.console: Any = None
        self.live: Any = None
        if tty:
            from rich.console import Console

            self.console = Console(highlight=False)

    def island_line(self, island: int, text: str) -> None:
        self._emit(f"[island-{island}]", COLOURS[island % len(COLOURS)], text)

    def note(self, text: str) -> None:
        self._emit("[local]", "bold", text)

    def error(self, text: str) -> None:
        with self.lock:
            _write(sys.stderr, text)

    def table(self, headers: list[str], rows: list[list[str]]) -> None:
        with self.lock:
            if self.console is not None:
                self.console.print(rich_table(headers, rows))
            else:
                _write(sys.stdout, plain_table(headers, rows))

    def start_live(self, renderable: Any) -> None:
        from rich.live import Live

        self.live = Live(renderable, console=self.console, refresh_per_second=2)
        self.live.start()

    def update_live(self, renderable: Any) -> None:
        if self.live is not None:
            with self.lock:
                self.live.update(renderable)

    def stop_live(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            live.stop()

    def _emit(self, prefix: str, style: str, text: str) -> None:
        with self.lock:
            if self.console is None:
                _write(sys.stdout, f"{prefix} {text}")
                return
            from rich.text import Text

            # soft_wrap: long log lines keep their shape instead of being re-flowed.
            self.console.print(Text.assemble((prefix, style), " ", text), soft_wrap=True)


def _write(stream: IO[str], text: str) -> None:
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):  # closed pipe: output is cosmetic, the islands must go on
        pass


def plain_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    lines = [headers] + rows
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def rich_table(headers: list[str], rows: list[list[str]]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(*headers, box=box.SIMPLE_HEAD)  # light borders: fits 80 columns
    for row in rows:
        table.add_row(*[str(c) for c in row])
    return table


def format_cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# ------------------------------------------------------------ the federation
