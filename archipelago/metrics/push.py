"""Push an island's records to a federation dashboard (`metrics.dashboard`), never slowing training.

Records go into a bounded queue; a background thread posts them in batches every half
second. A full queue drops records (counted), an unreachable dashboard is logged once a
minute and retried: the run's own metrics.jsonl stays the complete record, the dashboard a view.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

log = logging.getLogger("archipelago.metrics")

Signer = Callable[[bytes], dict[str, str]]  # body -> authentication headers


class RecordPusher:
    """Posts {"island": ..., "info": ..., "records": [...]} to DASHBOARD/push in the background."""

    def __init__(self, url: str, island: int, info: dict[str, Any], sign: Signer | None = None,
                 interval_s: float = 0.5, capacity: int = 2000) -> None:
        self.url, self.island, self.info, self.sign = url.rstrip("/") + "/push", island, info, sign
        self.interval_s = interval_s
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=capacity)
        self.dropped = 0
        self.cpu_s = 0.0  # the sending thread's CPU time: what pushing costs the island's cores
        self._stop = threading.Event()
        self._last_complaint = 0.0
        self._thread = threading.Thread(target=self._run, name="dashboard-push", daemon=True)
        self._thread.start()

    def push(self, record: dict[str, Any]) -> None:
        """Queue one record (no I/O here; a full queue drops it)."""
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for at most `timeout_s`) and stop."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.interval_s)
            began = time.thread_time()
            batch = self._drain()
            if batch:
                self._post(batch)  # JSON, the tag and the HTTP request: counted, the waits for the reply not
            self.cpu_s += time.thread_time() - began
            if stopping:
                return

    def _drain(self) -> list[dict[str, Any]]:
        batch: list[dict[str, Any]] = []
        while len(batch) < 500:
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _post(self, batch: list[dict[str, Any]]) -> None:
        body = json.dumps({"island": self.island, "info": self.info, "time": time.time(),
                           "dropped": self.dropped, "records": batch}, default=str).encode()
        headers = {"Content-Type": "application/json", **(self.sign(body) if self.sign else {})}
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            self.dropped += len(batch)
            if time.monotonic() - self._last_complaint > 60:
                self._last_complaint = time.monotonic()
                log.warning("dashboard %s unreachable (%s): records are dropped there (metrics.jsonl keeps "
                            "them); retrying", self.url, exc)
