"""A live federation dashboard: islands push their records, a web page and `/metrics` show them.

`archipelago lighthouse --dashboard HOST:PORT` and `archipelago local --dashboard HOST:PORT`
serve it (Flask on werkzeug's threaded server, in a background thread). Islands started
with `--metrics.dashboard http://HOST:PORT` post their step records, outer steps and events
to `/push` (metrics/push.py). The page (`/`) polls `/api/state` and draws each island
(state, ranks, device, step, tokens/s, utilisation, last push), each outer step
(participants, bytes, exchange time hidden and exposed, refusals), validation and
training loss over tokens per island, and the events (join, leave, heal, refusals; and
under `archipelago local`, the launcher's kills, restarts and exits).
`/metrics` serves the same in Prometheus' text format. Nothing on it changes the run.

What arrives is another machine's data: bodies are capped, only known fields of the
expected types are kept, strings are cut short, and the page writes them as text. With a
verifier (the federation key) a push without a valid tag is refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_BODY = 1 << 20        # bytes of one push
MAX_RECORDS = 500         # records in one push
CURVE_POINTS = 4000       # loss points kept per island
SILENT_AFTER_S = 15.0     # an island that has not pushed for this long is shown as silent

STEP_FIELDS = ("step", "loss", "val_loss", "tokens", "tokens_per_s", "mfu", "lr", "grad_norm")
OUTER_FIELDS = ("outer_step", "step", "participants", "bytes_sent", "compute_s", "sync_s", "overlap_s",
                "exposed_s", "federation_tokens")
INFO_FIELDS = ("ranks", "device", "model", "job")

Verifier = Callable[[int, bytes, dict[str, str]], bool]  # (island, body, headers) -> authentic


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def _text(value: Any, limit: int = 120) -> str:
    return str(value)[:limit]


@dataclass
class IslandView:
    island: int
    info: dict[str, Any] = field(default_factory=dict)
    last_push: float = 0.0
    step: dict[str, float] = field(default_factory=dict)  # the newest step record's numbers
    curve: deque = field(default_factory=lambda: deque(maxlen=CURVE_POINTS))  # [tokens, loss, val_loss]
    compute_s: float = 0.0
    sync_s: float = 0.0
    left: bool = False
    dropped: int = 0
    killed_at: float = 0.0  # when the launcher last killed it (archipelago local --kill)

    def state(self, now: float) -> str:
        if self.left:
            return "left"
        if self.killed_at > self.last_push:  # killed, and not pushing again yet
            return "killed"
        return "silent" if now - self.last_push > SILENT_AFTER_S else "training"

    def utilisation(self) -> float | None:
        total = self.compute_s + self.sync_s
        return self.compute_s / total if total > 0 else None


class DashboardState:
    """What the islands pushed, kept bounded; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.islands: dict[int, IslandView] = {}
        self.outer_steps: deque = deque(maxlen=500)
        self.events: deque = deque(maxlen=500)
        self.started = time.time()

    def ingest(self, payload: Any) -> int:
        """Take one push; returns the records kept (ValueError for a malformed push)."""
        if not isinstance(payload, dict) or not isinstance(payload.get("island"), int) \
                or not isinstance(payload.get("records"), list) or len(payload["records"]) > MAX_RECORDS:
            raise ValueError("expected {island: int, records: [...]} with at most 500 records")
        island = payload["island"]
        with self.lock:
            view = self.islands.setdefault(island, IslandView(island))
            info = payload.get("info")
            if isinstance(info, dict):  # ranks a number, the rest short text
                view.info = {k: (_number(info[k]) if k == "ranks" else _text(info[k])) for k in INFO_FIELDS
                             if k in info}
            view.last_push = time.time()
            view.dropped = int(_number(payload.get("dropped")) or 0)
            kept = sum(self._record(view, r) for r in payload["records"] if isinstance(r, dict))
        return kept

    def launcher_event(self, island: int, event: str, when: float) -> None:
        """An event of the launcher that serves this dashboard in its own process
        (`archipelago local`: kill, restart, exit), which no island can push: a killed island
        is gone before it could."""
        with self.lock:
            view = self.islands.setdefault(island, IslandView(island))
            self.events.append({"island": island, "event": _text(event, 40), "time": when, "step": None})
            if event == "kill":
                view.killed_at = when

    def _record(self, view: IslandView, record: dict[str, Any]) -> bool:
        event = record.get("event")
        if event == "outer_step":
            row: dict[str, Any] = {k: _number(record.get(k)) for k in OUTER_FIELDS}
            row.update(island=view.island, committed=bool(record.get("committed")),
                       own_refused=_text(record.get("own_refused") or ""), codec=_text(record.get("codec") or ""))
            self.outer_steps.append(row)
            view.compute_s += row["compute_s"] or 0.0
            view.sync_s += row["sync_s"] or 0.0
            return True
        if isinstance(event, str):
            self.events.append({"island": view.island, "event": _text(event, 40), "time": _number(record.get("time")),
                                "step": _number(record.get("step"))})
            view.left = view.left or event == "leave"
            return True
        numbers = {k: v for k in STEP_FIELDS if (v := _number(record.get(k))) is not None}
        if "step" not in numbers:
            return False
        view.step.update(numbers)
        if "loss" in numbers or "val_loss" in numbers:
            view.curve.append([numbers.get("tokens", 0.0), numbers.get("loss"), numbers.get("val_loss")])
        return True

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        with self.lock:
            islands = [{"island": v.island, "state": v.state(now), **v.info, **v.step,
                        "utilisation": v.utilisation(), "last_push_s": now - v.last_push, "dropped": v.dropped,
                        "curve": list(v.curve)} for v in sorted(self.islands.values(), key=lambda v: v.island)]
            return {"islands": islands, "outer_steps": list(self.outer_steps)[-50:],
                    "events": list(self.events)[-50:], "uptime_s": now - self.started}


def prometheus_text(state: DashboardState) -> bytes:
    """The state in Prometheus' text exposition format (one gauge per island field)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    snapshot = state.snapshot()

    class Collector:
        def collect(self):  # noqa: ANN202 - prometheus_client's protocol
            gauges = {"step": "inner step", "loss": "training loss", "val_loss": "validation loss",
                      "tokens_per_s": "tokens per second", "utilisation": "share of round time computing",
                      "last_push_s": "seconds since the island last pushed"}
            for key, text in gauges.items():
                family = GaugeMetricFamily(f"archipelago_island_{key}", f"Each island's {text}", labels=["island"])
                for island in snapshot["islands"]:
                    if isinstance(island.get(key), (int, float)):
                        family.add_metric([str(island["island"])], float(island[key]))
                yield family
            rounds = CounterMetricFamily("archipelago_outer_steps", "Outer steps seen, per island", labels=["island"])
            sent = CounterMetricFamily("archipelago_outer_bytes_sent", "Bytes sent in outer steps", labels=["island"])
            for island in snapshot["islands"]:
                mine = [r for r in state.outer_steps if r["island"] == island["island"]]
                rounds.add_metric([str(island["island"])], len(mine))
                sent.add_metric([str(island["island"])], sum(r["bytes_sent"] or 0 for r in mine))
            yield rounds
            yield sent

    registry = CollectorRegistry()
    registry.register(Collector())  # type: ignore[arg-type]  # the protocol is collect()
    return generate_latest(registry)


def create_app(state: DashboardState, verify: Verifier | None = None):  # noqa: ANN201 - a Flask app
    from flask import Flask, Response, jsonify, request

    app = Flask("archipelago.dashboard")
    page = (Path(__file__).with_name("dashboard.html")).read_text()

    @app.get("/")
    def index() -> Response:
        return Response(page, mimetype="text/html")

    @app.get("/api/state")
    def api_state() -> Response:
        return jsonify(state.snapshot())

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(prometheus_text(state), mimetype="text/plain; version=0.0.4")

    @app.post("/push")
    def push() -> tuple[Response, int]:
        # The size is judged from the headers, before a byte of the body is read: a push
        # without a length (chunked) or over the limit is refused unread, and the stream
        # reads at most the length given (werkzeug limits it to Content-Length).
        size = request.content_length
        if size is None:
            return jsonify(error="a push needs a Content-Length"), 411
        if size > MAX_BODY:
            return jsonify(error=f"push too large: at most {MAX_BODY} bytes"), 413
        body = request.get_data(cache=False)
        try:
            payload = json.loads(body)
            island = payload["island"] if isinstance(payload, dict) else None
            if verify is not None and (not isinstance(island, int) or not verify(island, body, dict(request.headers))):
                return jsonify(error="not a member of this federation (bad or missing tag)"), 403
            kept = state.ingest(payload)
        except (ValueError, KeyError, TypeError) as exc:
            return jsonify(error=f"malformed push: {exc}"), 400
        return jsonify(kept=kept), 200

    return app


def _handler_class() -> type:
    from werkzeug.serving import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        # A socket timeout per connection: a client that stops sending mid-request (or never
        # sends one) frees its thread after this long instead of holding it forever.
        timeout = 30

    return Handler


class Dashboard:
    """The dashboard served on host:port from a background thread (`address`, `shutdown`)."""

    def __init__(self, host: str, port: int, verify: Verifier | None = None) -> None:
        from werkzeug.serving import make_server

        self.state = DashboardState()
        self.server = make_server(host, port, create_app(self.state, verify), threaded=True,
                                  request_handler=_handler_class())
        self.thread = threading.Thread(target=self.server.serve_forever, name="dashboard", daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{f'[{name}]' if ':' in name else name}:{port}"

    def shutdown(self) -> None:
        self.server.shutdown()
        self.thread.join(5)
