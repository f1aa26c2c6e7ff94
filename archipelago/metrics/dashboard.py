"""A live federation dashboard: islands push their records, a web page and `/metrics` show them.

`archipelago lighthouse --dashboard HOST:PORT` and `archipelago local --dashboard HOST:PORT`
serve it (a Flask app, on the request server healing stands on: http_serving.RequestServer).
Islands started
with `--metrics.dashboard http://HOST:PORT` post their step records, outer steps and events
to `/push` (metrics/push.py). The page (`/`) polls `/api/state` and draws each island
(state, ranks, device, step, tokens/s, utilisation, last push), each outer step
(participants, bytes, exchange time hidden and exposed, refusals), validation and
training loss over tokens per island, and the events (join, leave, heal, refusals; and
under `archipelago local`, the launcher's kills, restarts and exits).
`/metrics` serves the same in Prometheus' text format. Nothing on it changes the run.

What arrives is another machine's data: bodies are capped, only known fields of the
expected types are kept, strings are cut short, and the page writes them as text. With a
verifier (the federation key) a push without a valid tag is refused; without one the
dashboard serves beyond loopback only when told it may (`insecure`). A request, head and
push body together, is read without a thread and within REQUEST_TIMEOUT_S, and at most
MAX_CONNECTIONS are answered at once (werkzeug's threaded server started a thread per
connection, and a push sent a byte at a time held it for good). What the islands pushed is
kept for at most MAX_ISLANDS islands (the least recently pushed forgotten first), each at
most CURVE_POINTS loss points (24 bytes each) and a few short fields: a stream of made-up
island ids costs a bounded few MB, not a growing heap.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
import urllib.parse
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archipelago.config.errors import ConfigError

MAX_BODY = 1 << 20        # bytes of one push
MAX_RECORDS = 500         # records in one push
CURVE_POINTS = 4000       # loss points kept per island
MAX_ISLANDS = 64          # islands kept (the least recently pushed forgotten first): a few MB at most
SILENT_AFTER_S = 15.0     # an island that has not pushed for this long is shown as silent
REQUEST_TIMEOUT_S = 10.0  # a request, head and body: a pusher sends at once (and gives up after 2 s)
MAX_CONNECTIONS = 8       # requests answered at once; pushes and page polls take milliseconds each

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


class Curve:
    """An island's last CURVE_POINTS loss points, [tokens, loss, val_loss] each, as three
    doubles (24 bytes a point; a deque of lists took about 150): NaN holds a missing loss."""

    def __init__(self, limit: int = CURVE_POINTS) -> None:
        self.limit, self.values = limit, array("d")

    def append(self, tokens: float, loss: float | None, val_loss: float | None) -> None:
        nan = float("nan")
        self.values.extend((tokens, nan if loss is None else loss, nan if val_loss is None else val_loss))
        if len(self.values) > 3 * (self.limit + self.limit // 8 + 1):  # trimmed an eighth at a time
            del self.values[:len(self.values) - 3 * self.limit]

    def __len__(self) -> int:
        return min(len(self.values) // 3, self.limit)

    def points(self) -> list[list[float | None]]:
        v = self.values[-3 * self.limit:]
        return [[v[i], None if v[i + 1] != v[i + 1] else v[i + 1], None if v[i + 2] != v[i + 2] else v[i + 2]]
                for i in range(0, len(v), 3)]


@dataclass
class IslandView:
    island: int
    info: dict[str, Any] = field(default_factory=dict)
    last_push: float = 0.0
    step: dict[str, float] = field(default_factory=dict)  # the newest step record's numbers
    curve: Curve = field(default_factory=Curve)  # [tokens, loss, val_loss] points
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
        self.islands: OrderedDict[int, IslandView] = OrderedDict()  # the least recently pushed first
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
            view = self._view(island)
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
            view = self._view(island)
            self.events.append({"island": island, "event": _text(event, 40), "time": when, "step": None})
            if event == "kill":
                view.killed_at = when

    def _view(self, island: int) -> IslandView:
        """The view of `island`, now the most recently pushed; the least recently pushed
        past MAX_ISLANDS is forgotten (the lock held)."""
        view = self.islands.get(island)
        if view is None:
            view = self.islands[island] = IslandView(island)
            while len(self.islands) > MAX_ISLANDS:
                self.islands.popitem(last=False)
        self.islands.move_to_end(island)
        return view

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
            view.curve.append(numbers.get("tokens", 0.0), numbers.get("loss"), numbers.get("val_loss"))
        return True

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        with self.lock:
            islands = [{"island": v.island, "state": v.state(now), **v.info, **v.step,
                        "utilisation": v.utilisation(), "last_push_s": now - v.last_push, "dropped": v.dropped,
                        "curve": v.curve.points()} for v in sorted(self.islands.values(), key=lambda v: v.island)]
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


def refuse_open_without_key(host: str, verify: Verifier | None, insecure: bool,
                            flags: tuple[str, str, str] = ("--dashboard", "--key-file", "--insecure")) -> None:
    """Raise ConfigError, naming the fix, for a dashboard without a verifier (no federation
    key) on an address beyond loopback, unless `insecure`: anyone who reaches it could push
    records for any island id and read what the islands pushed. `flags`: the caller's names
    for the address, the key file and the opt-out (as `archipelago lighthouse` refuses a
    keyless lighthouse: launch/lighthouse.refuse_open_without_key)."""
    from archipelago.federation.trust import is_loopback

    if verify is not None or insecure or is_loopback(host):
        return
    where, key_flag, insecure_flag = flags
    raise ConfigError(f"{where} {host}: a dashboard beyond loopback without a federation key: anyone who reaches "
                      "it could push made-up records for any island and read what the islands push. Give it the "
                      f"federation's key file ({key_flag} FILE or $ARCHIPELAGO_FEDERATION_KEY_FILE; make one with "
                      "`archipelago secret new --out FILE`), or serve it on 127.0.0.1; on a trusted private "
                      f"network, {insecure_flag} accepts the risk")


def _call_app(app: Callable[..., Any], environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """(status line, headers, body) of a WSGI app's answer to `environ`, the body whole:
    the dashboard's answers are a page, a state of bounded size, or a short JSON reply."""
    started: list[Any] = []
    written: list[bytes] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        started[:] = [status, headers]
        return written.append

    result = app(environ, start_response)
    try:
        written.extend(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return started[0], started[1], b"".join(written)


def _handler_class(app: Callable[..., Any]) -> type:
    """The request handler that answers with `app` (WSGI): a request whose head and body
    RequestServer has read (a push of at most MAX_BODY; a longer one, or one without a
    length, reaches the app without its body, which it refuses from the headers)."""
    from archipelago.federation.http_serving import HeadHandler, read_body

    class Handler(HeadHandler):
        server_name = "dashboard"

        def _answer(self) -> None:
            status, headers, body = _call_app(app, self._environ())
            code, _, reason = status.partition(" ")
            self.send_response(int(code), reason)
            for name, value in headers:
                if name.lower() != "connection":  # one request per connection: http.server closes it
                    self.send_header(name, value)
            if not any(name.lower() == "content-length" for name, _ in headers):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.flush()
            if self.command != "HEAD":
                self.connection.sendall(body)

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer

        def _environ(self) -> dict[str, Any]:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                length = -1
            body = b""
            if 0 < length <= MAX_BODY:  # RequestServer read it already (max_body): nothing waits here
                body = read_body(self.connection, self.rfile.read(), length, time.monotonic() + REQUEST_TIMEOUT_S,
                                 REQUEST_TIMEOUT_S)
            path, _, query = self.path.partition("?")
            listening: Any = self.server.server_address  # RequestServer's: (host, port, ...)
            host, port = listening[:2]
            environ: dict[str, Any] = {
                "REQUEST_METHOD": self.command, "SCRIPT_NAME": "", "QUERY_STRING": query,
                "PATH_INFO": urllib.parse.unquote(path, "latin-1"), "SERVER_NAME": str(host),
                "SERVER_PORT": str(port), "SERVER_PROTOCOL": self.request_version,
                "REMOTE_ADDR": str(self.client_address[0]), "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
                "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr, "wsgi.multithread": True,
                "wsgi.multiprocess": False, "wsgi.run_once": False}
            for name, value in self.headers.items():
                key = name.upper().replace("-", "_")
                if "_" in name:  # X_Tag would pass for X-Tag: such names are dropped (werkzeug's rule)
                    continue
                if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                    key = f"HTTP_{key}"
                environ[key] = f"{environ[key]},{value}" if key in environ else value
            return environ

    return Handler


class Dashboard:
    """The dashboard served on host:port (`address`, `shutdown`): heads and push bodies read
    on the request server's one thread, at most MAX_CONNECTIONS requests answered at once.
    Without `verify` (a federation key) beyond loopback only if `insecure` (ConfigError
    naming `flags` otherwise: refuse_open_without_key)."""

    def __init__(self, host: str, port: int, verify: Verifier | None = None, insecure: bool = False,
                 flags: tuple[str, str, str] = ("--dashboard", "--key-file", "--insecure")) -> None:
        from archipelago.federation.http_serving import RequestServer

        refuse_open_without_key(host, verify, insecure, flags)
        self.state = DashboardState()
        self.server = RequestServer(host, _handler_class(create_app(self.state, verify)), REQUEST_TIMEOUT_S,
                                    MAX_CONNECTIONS, port, max_body=MAX_BODY)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{f'[{name}]' if ':' in name else name}:{port}"

    def shutdown(self) -> None:
        self.server.close()
