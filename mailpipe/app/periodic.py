"""Work that beat's lock holder does itself every so often, on a thread of its own: the metrics
report and housekeeping (mailpipe.app.scheduler). A slow CloudWatch or database never delays
beat's ticks, and at most one run of each is in flight."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    """`work` every `interval` seconds, each run on a thread of its own. A run still going when
    the next is due costs that one, with a warning; a run that raises is logged, and the next
    one is a fresh try."""

    def __init__(self, name: str, work: Callable[[], object], interval: float) -> None:
        self._name = name
        self._work = work
        self._interval = interval
        self._due = -float("inf")  # the first run at once
        self._thread: threading.Thread | None = None

    def tick(self) -> float:
        """Start the run that is due, if any; the seconds until the next one is due."""
        now = time.monotonic()
        if now >= self._due:
            # On the beat of the interval; from now if a whole interval was missed (the first
            # run, a standby that has just taken the lock).
            next_due = self._due + self._interval
            self._due = next_due if next_due > now else now + self._interval
            if self._thread is not None and self._thread.is_alive():
                log.warning("the previous %s is still running: this one is skipped", self._name)
            else:
                self._thread = threading.Thread(
                    target=self._run, name=f"mailpipe-{self._name.replace(' ', '-')}", daemon=True
                )
                self._thread.start()
        return self._due - now

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the run in flight, if any (tests, and a clean exit)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._work()
        except Exception:
            # Redis or the database unreachable, mostly; the next run is a fresh try.
            log.warning("the %s failed", self._name, exc_info=True)
