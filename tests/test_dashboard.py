"""The federation dashboard: pushes in, a page, /api/state and /metrics out; hostile pushes refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from archipelago.federation.trust import FederationKey, dashboard_tag, dashboard_verifier, new_secret
from archipelago.metrics.dashboard import Dashboard, DashboardState, create_app
from archipelago.metrics.push import RecordPusher

ROOT = Path(__file__).resolve().parents[1]


def _push(island: int, *records: dict, info: dict | None = None) -> dict:
    return {"island": island, "info": info or {"ranks": 2, "device": "cpu"}, "time": time.time(), "dropped": 0,
            "records": list(records)}


STEP = {"step": 10, "loss": 5.5, "tokens": 5120, "tokens_per_s": 900.0, "mfu": None}
OUTER = {"event": "outer_step", "outer_step": 3, "step": 10, "committed": True, "participants": 2,
         "bytes_sent": 1234, "compute_s": 3.0, "sync_s": 1.0, "overlap_s": 0.0, "exposed_s": 1.0, "codec": "int8",
         "own_refused": None}


def test_pushed_records_become_islands_outer_steps_curves_and_prometheus_gauges():
    state = DashboardState()
    client = create_app(state).test_client()
    assert client.post("/push", data=json.dumps(_push(0, STEP, OUTER, {"step": 20, "loss": 5.1, "val_loss": 5.3,
                                                                        "tokens": 10240}))).status_code == 200
    assert client.post("/push", data=json.dumps(_push(1, {"event": "join", "step": 0, "time": 1.0}))).status_code == 200
    snapshot = client.get("/api/state").get_json()
    first = snapshot["islands"][0]
    assert (first["island"], first["state"], first["ranks"], first["step"], first["loss"]) == (0, "training", 2.0,
                                                                                              20.0, 5.1)
    assert first["utilisation"] == pytest.approx(0.75)  # 3 s computing of 4 s in the round
    assert first["curve"] == [[5120.0, 5.5, None], [10240.0, 5.1, 5.3]]
    assert snapshot["outer_steps"][0]["bytes_sent"] == 1234 and snapshot["outer_steps"][0]["codec"] == "int8"
    assert snapshot["events"][0]["event"] == "join" and snapshot["islands"][1]["island"] == 1
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").get_data(as_text=True))}
    losses = {s.labels["island"]: s.value for s in families["archipelago_island_loss"].samples}
    assert losses == {"0": 5.1}
    sent = [s for s in families["archipelago_outer_bytes_sent"].samples if s.name.endswith("_total")]
    assert {s.labels["island"]: s.value for s in sent} == {"0": 1234.0, "1": 0.0}
    assert "Archipelago federation" in client.get("/").get_data(as_text=True)


def test_a_kill_by_the_serving_launcher_shows_the_island_killed_until_it_pushes_again():
    state = DashboardState()
    client = create_app(state).test_client()
    client.post("/push", data=json.dumps(_push(1, STEP)))
    state.launcher_event(1, "kill", time.time())
    snapshot = client.get("/api/state").get_json()
    assert snapshot["islands"][0]["state"] == "killed"
    assert [e["event"] for e in snapshot["events"]] == ["kill"]
    state.launcher_event(1, "restart", time.time())
    client.post("/push", data=json.dumps(_push(1, {"event": "join", "step": 0, "time": time.time()})))
    snapshot = client.get("/api/state").get_json()
    assert snapshot["islands"][0]["state"] == "training"
    assert [e["event"] for e in snapshot["events"]] == ["kill", "restart", "join"]


def test_malformed_oversized_and_strange_pushes_are_refused_or_cut_down():
    state = DashboardState()
    client = create_app(state).test_client()
    assert client.post("/push", data=b"not json").status_code == 400
    assert client.post("/push", data=json.dumps({"island": "zero", "records": []})).status_code == 400
    assert client.post("/push", data=json.dumps(_push(0, *[STEP] * 501))).status_code == 400
    assert client.post("/push", data=b"x" * (2 << 20)).status_code == 413
    odd = {"step": 5, "loss": "<script>alert(1)</script>", "tokens": float("nan"), "extra": [1, 2]}
    assert client.post("/push", data=json.dumps(_push(0, odd, info={"device": "x" * 1000}))).status_code == 200
    island = client.get("/api/state").get_json()["islands"][0]
    assert "loss" not in island and "extra" not in island and "tokens" not in island  # only numbers are kept
    assert len(island["device"]) == 120


def test_with_a_federation_key_only_tagged_fresh_pushes_from_the_island_they_name_are_taken():
    key = FederationKey(bytes.fromhex(new_secret()))
    other = FederationKey(bytes.fromhex(new_secret()))
    client = create_app(DashboardState(), dashboard_verifier(key)).test_client()
    body = json.dumps(_push(1, STEP)).encode()
    assert client.post("/push", data=body).status_code == 403  # no tag
    assert client.post("/push", data=body, headers=dashboard_tag(other, 1, body)).status_code == 403
    assert client.post("/push", data=body, headers=dashboard_tag(key, 0, body)).status_code == 403  # another island's
    assert client.post("/push", data=body, headers=dashboard_tag(key, 1, body)).status_code == 200
    stale = json.dumps({**_push(1, STEP), "time": time.time() - 3600}).encode()
    assert client.post("/push", data=stale, headers=dashboard_tag(key, 1, stale)).status_code == 403


@pytest.mark.timeout(60)
def test_the_pusher_delivers_in_the_background_and_an_absent_dashboard_costs_nothing_but_records():
    dashboard = Dashboard("127.0.0.1", 0)
    try:
        pusher = RecordPusher(dashboard.address, 2, {"ranks": 1}, interval_s=0.05)
        for step in range(1, 101):
            pusher.push({"step": step, "loss": 6.0 - step / 100, "tokens": 512 * step})
        pusher.close()
        island = dashboard.state.snapshot()["islands"][0]
        assert island["island"] == 2 and island["step"] == 100 and len(island["curve"]) == 100
        assert pusher.cpu_s > 0  # the sending thread's own CPU time, what bench/dashboard.py reports
    finally:
        dashboard.shutdown()
    gone = RecordPusher(dashboard.address, 2, {}, interval_s=0.05)
    gone.push({"step": 1, "loss": 1.0})
    gone.close()
    assert gone.dropped == 1


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def _render(url: str, shot: Path) -> str:
    """The page's DOM after its scripts ran, and a screenshot, from headless Chromium."""
    flags = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=90).stdout
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1000,1000", url], capture_output=True, timeout=90)
    return dom


def _line_colours(shot: Path) -> set[str]:
    """The island colours (the page's first two) drawn as lines in a screenshot. A thin line
    is anti-aliased, so few of its pixels have the exact colour: pixels near it count (within
    100 in RGB, and coloured, not grey). At least 200 of them: a legend's text gives about
    60, a validation dot 25, a curve across a third of the plot several hundred."""
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    wanted = {"#1f77b4": (0x1F, 0x77, 0xB4), "#d62728": (0xD6, 0x27, 0x28)}
    near = dict.fromkeys(wanted, 0)
    for pixel in image.get_flattened_data() if hasattr(image, "get_flattened_data") else image.getdata():
        if max(pixel) - min(pixel) <= 60:
            continue
        for name, rgb in wanted.items():
            if sum((a - b) ** 2 for a, b in zip(pixel, rgb)) <= 100**2:
                near[name] += 1
    return {name for name, count in near.items() if count >= 200}


def _ready_to_draw(state: dict) -> bool:
    islands = state.get("islands", [])
    losses = [[p for p in island.get("curve", []) if isinstance(p[1], (int, float))] for island in islands]
    return len(islands) == 2 and bool(state.get("outer_steps")) and all(len(points) >= 2 for points in losses)


@pytest.mark.timeout(420)
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (make setup installs it)")
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_a_local_federation_shows_on_the_dashboard_in_a_browser(shakespeare, tmp_path):
    import socket
    import threading

    from conftest import TINY, run_cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    finished: list = []
    runner = threading.Thread(target=lambda: finished.append(run_cli(
        ["local", "--islands", "1,1", "--no-table", "--dashboard", f"127.0.0.1:{port}", *TINY,
         "--training.steps", "80", "--training.val_every", "20", "--checkpoint.no_enable",
         "--job.run_dir", str(tmp_path / "run")], timeout=360)))
    runner.start()
    try:
        state: dict = {}
        deadline = time.monotonic() + 240
        # Both islands in, an outer step done, and two loss points from each (a curve to draw;
        # on a loaded machine one island can lag the other by a log window).
        while time.monotonic() < deadline and runner.is_alive():
            try:
                state = json.loads(_get(f"{url}/api/state"))
            except OSError:
                state = {}
            if _ready_to_draw(state):
                break
            time.sleep(0.5)
        assert _ready_to_draw(state), state
        first = _render(url, tmp_path / "first.png")
        time.sleep(3)
        second = _render(url, tmp_path / "second.png")
        families = {f.name for f in text_string_to_metric_families(_get(f"{url}/metrics").decode())}
    finally:
        runner.join(400)
    assert finished and finished[0].returncode == 0, finished[0].output[-3000:] if finished else "no result"
    for dom, shot in ((first, tmp_path / "first.png"), (second, tmp_path / "second.png")):
        assert "2 island(s), updated" in dom, dom[-3000:]
        assert ">training<" in dom and ">yes<" in dom  # islands training, a committed outer step
        assert 'data-curves="2"' in dom, dom[:3000]  # a loss curve per island
        assert _line_colours(shot) == {"#1f77b4", "#d62728"}  # both islands' curves on the screen
    assert first != second  # the page refreshed itself with newer numbers
    points = [int(dom.split('data-points="', 1)[1].split('"', 1)[0]) for dom in (first, second)]
    assert 4 <= points[0] <= points[1], points  # the curves grew between the two renders
    assert "<td>join</td>" in second.replace(' class="t"', "")  # the islands' join events are listed
    assert {"archipelago_island_step", "archipelago_outer_steps"} <= families


def test_a_dashboard_address_without_a_host_serves_on_loopback_only():
    import socket

    from archipelago.launch.lighthouse import start_dashboard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dashboard = start_dashboard(f":{port}")  # the issue's `--dashboard :8080` form
    try:
        assert dashboard.address == f"http://127.0.0.1:{port}"
        assert dashboard.server.server_address[0] == "127.0.0.1"  # not 0.0.0.0
    finally:
        dashboard.shutdown()
    with pytest.raises(SystemExit, match=r"expected \[HOST\]:PORT"):
        start_dashboard("8080")


def test_the_dashboard_only_reads_nothing_on_it_can_change_the_run():
    """Every route but /push answers GET alone, and /push only adds records to the view:
    the page has no control over islands, the lighthouse or the launcher."""
    app = create_app(DashboardState())
    methods = {rule.rule: rule.methods - {"HEAD", "OPTIONS"} for rule in app.url_map.iter_rules()}
    assert methods.pop("/push") == {"POST"}
    assert methods and all(m == {"GET"} for m in methods.values()), methods
    client = app.test_client()
    for route in ("/", "/api/state", "/metrics"):
        for verb in (client.post, client.put, client.delete, client.patch):
            assert verb(route).status_code == 405, (route, verb)


def _raw_push(address: str, head: str, timeout: float = 10) -> str:
    """Send `head` (request line and headers, no body) to the dashboard; its answer's status
    line, read without sending a byte of body."""
    import socket

    host, port = address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(head.encode())
        try:
            answer = conn.recv(4096)
        except TimeoutError:
            pytest.fail(f"no answer within {timeout} s: the dashboard waits for the body")
    return answer.decode(errors="replace").split("\r\n", 1)[0]


@pytest.mark.timeout(60)
def test_a_push_over_the_limit_or_without_a_length_is_refused_before_its_body_is_read():
    dashboard = Dashboard("127.0.0.1", 0)
    try:
        # 10^9 bytes announced, none sent: the answer comes at once, from the headers alone.
        status = _raw_push(dashboard.address, "POST /push HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
                           "Content-Length: 1000000000\r\n\r\n")
        assert status.split()[1] == "413", status
        status = _raw_push(dashboard.address, "POST /push HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n")
        assert status.split()[1] == "411", status
        assert dashboard.state.snapshot()["islands"] == []
        # A connection that never finishes its request is closed by a deadline, holding no thread
        # meanwhile (test_slow_senders.py shows both).
        assert 0 < dashboard.server.request_timeout <= 60
    finally:
        dashboard.shutdown()
