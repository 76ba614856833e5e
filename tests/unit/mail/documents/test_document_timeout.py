"""The per-document time limit: a genuinely slow document, and the helper's contract.

No test asserts how long anything took; each asserts what the limit did (stopped the work, put
back the previous handler and timer, stayed out of threads).
"""

from __future__ import annotations

import signal
import threading
from dataclasses import replace
from types import FrameType

import pytest

from mailpipe.mail.documents.timeout import ConversionTimeout, _warn_unenforced, time_limit
from tests.support.document_samples import attachment, pdf_slow


def _spin_until(stop: threading.Event | None = None) -> int:
    """Pure Python busy work that only a signal (or `stop`) ends; returns the rounds done."""
    rounds = 0
    while stop is None or not stop.is_set():
        rounds += 1
    return rounds


def test_slow_pdf_is_stopped_by_the_time_limit(convert, limits) -> None:
    # 30 MB of white space in a content stream: under every size limit, but pypdf walks it
    # byte by byte in Python, which takes seconds. The limit is a small fraction of that.
    payload = pdf_slow(whitespace_mib=30)
    document = convert(
        attachment(payload, "application/pdf", "slow.pdf"), replace(limits, time_limit=0.2)
    )
    assert (document.status, document.error, document.text) == (
        "failed",
        "timed out after 0.2s",
        None,
    )


def test_time_limit_interrupts_busy_code() -> None:
    with pytest.raises(ConversionTimeout, match=r"^timed out after 0\.05s$"), time_limit(0.05):
        _spin_until()


def test_code_that_swallows_the_first_timeout_is_stopped_by_the_next() -> None:
    swallowed = 0
    with pytest.raises(ConversionTimeout), time_limit(0.05):
        while True:
            try:
                _spin_until()
            except BaseException:  # like openpyxl's bare `except:` turning it into TypeError
                swallowed += 1
                if swallowed > 1:
                    raise
    assert swallowed == 2


def test_previous_handler_and_timer_are_restored() -> None:
    fired: list[int] = []

    def outer_handler(signum: int, frame: FrameType | None) -> None:
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, outer_handler)
    signal.setitimer(signal.ITIMER_REAL, 60)
    try:
        with pytest.raises(ConversionTimeout), time_limit(0.05):
            _spin_until()
        assert signal.getsignal(signal.SIGALRM) is outer_handler
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 60
        assert fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_an_earlier_outer_deadline_is_left_alone() -> None:
    def outer_handler(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("outer deadline")

    previous = signal.signal(signal.SIGALRM, outer_handler)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        with pytest.raises(TimeoutError, match="outer deadline"), time_limit(60):
            _spin_until()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_outside_the_main_thread_the_body_runs_without_a_limit(caplog) -> None:
    outcome: list[object] = []
    stop = threading.Event()
    handler_before = signal.getsignal(signal.SIGALRM)
    _warn_unenforced.cache_clear()  # the warning is logged once per process

    def body() -> None:
        try:
            with time_limit(0.01):
                threading.Timer(0.2, stop.set).start()
                outcome.append(_spin_until(stop))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert len(outcome) == 1 and isinstance(outcome[0], int)
    assert "not in the main thread" in caplog.text
    assert signal.getsignal(signal.SIGALRM) is handler_before
