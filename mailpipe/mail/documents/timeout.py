"""A per-document time limit that interrupts the conversion from inside.

Conversions run in the main thread of a prefork worker's child process, where SIGALRM is free:
billiard delivers the job's soft time limit with SIGUSR1 and enforces the hard one from the parent.
An interval timer raises `ConversionTimeout` in whatever Python code the conversion is running.

Limits of the approach, stated so nobody relies on more:
- The handler runs between Python bytecodes, so a single long call into C (inflating one large
  stream, lxml parsing one large part) finishes before the timeout is raised. The job's hard
  time limit is the backstop for that.
- Signals reach only the main thread. Elsewhere (a thread pool, a test runner's thread) the
  limit is not enforced, and a warning says so.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)

# After the first alarm the timer keeps firing at this interval (or the limit, if shorter): a
# library that swallows the first exception (openpyxl has a bare `except:`) gets another one.
_REPEAT_SECONDS = 0.5


class ConversionTimeout(BaseException):
    """The document's time limit ran out.

    A BaseException, like KeyboardInterrupt, so that the libraries' own `except Exception`
    recovery code (pypdf has plenty) does not swallow it and carry on converting.
    """


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `ConversionTimeout` in the body if it runs longer than `seconds`.

    The previous SIGALRM handler and timer are restored on the way out, with the time spent here
    taken off the timer. An earlier outer deadline is left alone: it will fire first anyway.
    """
    if not _can_use_alarm():
        _warn_unenforced()
        yield
        return
    previous_delay, previous_interval = signal.getitimer(signal.ITIMER_REAL)
    previous_handler = signal.getsignal(signal.SIGALRM)
    if previous_handler is None or (0 < previous_delay <= seconds):
        # None: a handler installed outside Python, which we could not put back.
        yield
        return

    active = True

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if active:
            raise ConversionTimeout(f"timed out after {seconds:g}s")

    started = time.monotonic()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, min(seconds, _REPEAT_SECONDS))
    try:
        yield
    finally:
        # Deactivate before disarming: an alarm already pending when the timer stops must find
        # the handler inert rather than raise inside this clean-up.
        active = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:
            remaining = previous_delay - (time.monotonic() - started)
            # A deadline that passed while we held the timer fires at once rather than never.
            signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-3), previous_interval)


def _can_use_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@functools.cache
def _warn_unenforced() -> None:
    """Once per process: a thread pool would otherwise log it for every attachment."""
    logger.warning("document time limit not enforced: not in the main thread")
