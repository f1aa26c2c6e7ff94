"""Logging refusals without letting whoever is refused flood the log.

A server that logs every refusal hands its log to an attacker: each call with a new id (or
from a new address) is one more warning line, as fast as it can send them. `RefusalLog`
names the first refusal of each source, up to `capacity` sources (then it remembers no
more, so its memory stays at `capacity` 16-byte digests whatever the number of sources);
every refusal of a source beyond those is counted, and the count is logged at most once
per `period_s` (the first at once), with the latest such refusal as an example. A source
already named is not named again (the lighthouse gate's "logged once per id"). A summary
is written by the first refusal after its period ends, or by `flush` (at shutdown): a
refusal costs a hash and a dict lookup, and no thread is needed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable


class RefusalLog:
    """Warnings for refusals: one per source for the first `capacity` sources, then a count
    per `period_s` (thread-safe)."""

    def __init__(self, logger: logging.Logger, what: str, capacity: int = 256, period_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._what = logger, what
        self._capacity, self._period_s, self._clock = capacity, period_s, clock
        self._named: dict[bytes, str] = {}  # digest of a source -> its label, as logged
        self._unnamed = 0  # refusals of sources not named, since the last summary
        self._latest = ""  # the latest of them, as its line would have read
        self._since = 0.0  # when the first of them came
        self._last_summary = -float("inf")
        self._lock = threading.Lock()

    def refused(self, source: str, label: str, message: str) -> bool:
        """Record a refusal of `source` (any text: hashed, never kept); log `message` if it
        is the source's first and there is room to name it. True when it was logged."""
        digest = hashlib.sha256(source.encode("utf-8", errors="replace")).digest()[:16]
        summary = None
        with self._lock:
            if digest in self._named:
                return False
            first = len(self._named) < self._capacity
            if first:
                self._named[digest] = label
            else:
                now = self._clock()
                if not self._unnamed:
                    self._since = now
                self._unnamed += 1
                self._latest = message
                if now - self._last_summary >= self._period_s:
                    summary = self._summary(now)
        if first:
            self._log.warning("%s", message)
        elif summary:
            self._log.warning("%s", summary)
        return first

    def _summary(self, now: float) -> str | None:
        """The count's line, and a new period from `now` (the lock held); None if none to count."""
        if not self._unnamed:
            return None
        line = (f"{self._what}: {self._unnamed} refusal(s) in {now - self._since:.0f} s not named one by one "
                f"(more than {self._capacity} sources were refused); the latest: {self._latest}")
        self._unnamed, self._latest, self._last_summary = 0, "", now
        return line

    def flush(self) -> None:
        """Log the count of refusals not named yet (at shutdown)."""
        with self._lock:
            summary = self._summary(self._clock())
        if summary:
            self._log.warning("%s", summary)

    @property
    def named(self) -> list[str]:
        """The labels of the sources named in the log, sorted (at most `capacity`)."""
        with self._lock:
            return sorted(self._named.values())
