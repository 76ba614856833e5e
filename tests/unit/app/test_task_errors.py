"""What of an exception leaves a task for Celery (its log line, task events, Flower): describe()'s
words and the frames, never a message that quotes an email (`MailpipeTask`). Through Celery's own
tracer, as a worker runs a task; no broker."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry

from mailpipe.app.tasks import MailpipeTask
from mailpipe.errors import InputRejected, RunFailed, Unexpected

SUBJECT = "Sonnenschein quarterly figures"


def _read_subject() -> None:
    raise ValueError(f"unreadable Subject: {SUBJECT}")


def _reject() -> None:
    try:
        _read_subject()
    except ValueError:
        raise InputRejected("a header could not be read") from None


def _reject_after() -> None:
    try:
        _read_subject()
    except ValueError:
        raise RunFailed("email 7: rejected") from ValueError(SUBJECT)


@pytest.fixture
def app() -> Celery:
    return Celery("test-task-errors", set_as_current=False)


def run(app: Celery, body: Any) -> Any:
    """The task's result as Celery's tracer leaves it: its state, exception and traceback."""
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=MailpipeTask, name="test.job", shared=False)
    def job(self: MailpipeTask, email_id: int) -> str:
        seen["request_id"] = self.request.id
        body()
        return "succeeded"

    result = job.apply(args=(7,), task_id="t-1")
    assert seen["request_id"] == "t-1"  # Celery's request, not one pushed again
    return result


def test_an_unexpected_error_leaves_in_describe_s_words_with_its_frames(app: Celery) -> None:
    result = run(app, _read_subject)
    assert result.state == "FAILURE"
    assert isinstance(result.result, Unexpected) and str(result.result) == "ValueError"
    assert "in _read_subject" in result.traceback
    assert result.traceback.rstrip().endswith("mailpipe.errors.Unexpected: ValueError")
    assert "Sonnenschein" not in result.traceback


@pytest.mark.parametrize("body", [_reject, _reject_after], ids=["from None", "from a cause"])
def test_mailpipe_s_own_error_leaves_as_it_is_without_what_it_was_raised_from(
    app: Celery, body: Any
) -> None:
    result = run(app, body)
    assert result.state == "FAILURE"
    assert type(result.result) in (InputRejected, RunFailed)
    assert "During handling" not in result.traceback and "direct cause" not in result.traceback
    assert "Sonnenschein" not in result.traceback


def test_a_retry_passes_through(app: Celery) -> None:
    def retry() -> None:
        raise Retry("again", exc=InputRejected("attempt 1 failed"), when=1)

    assert run(app, retry).state == "RETRY"


def test_a_task_that_ends_returns_its_result(app: Celery) -> None:
    result = run(app, lambda: None)
    assert (result.state, result.result) == ("SUCCESS", "succeeded")
