"""Log lines (mailpipe/app/logs.py): in JSON one line per record, the traceback inside it, the
job's ids as fields; in every format, tracebacks in describe()'s words. A real worker's lines:
tests/integration/test_roles.py and tests/integration/test_no_email_content.py."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator

import pytest
from celery import Celery
from celery._state import _task_stack
from celery.utils.log import ColorFormatter

from mailpipe.app import logs
from mailpipe.errors import InputRejected

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# Words of an email that an exception's message could quote.
SUBJECT = "Sonnenschein quarterly figures"
BODY = "Kindly wire the Zahlungseingang"


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(stream))
    logs.set_up(logger, "json")
    logs.set_up(logger, "json")  # idempotent: one filter each, one format
    yield logger, stream
    logger.handlers.clear()


def records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_traceback_stays_inside_its_one_line_record(lines) -> None:  # type: ignore[no-untyped-def]
    logger, stream = lines
    try:
        raise KeyError(SUBJECT)
    except KeyError:
        logger.exception("email %s: unexpected error", 7, extra={"stage": "convert"})
    [record] = records(stream)
    assert record["message"] == "email 7: unexpected error"
    assert record["level"] == "ERROR" and record["logger"] == logger.name
    assert record["exc_info"].startswith("Traceback (most recent call last):")
    assert record["exc_info"].endswith("\nKeyError") and "Sonnenschein" not in record["exc_info"]
    assert record["stage"] == "convert" and record["process"] == os.getpid()
    assert "task_id" not in record and "email_id" not in record  # no job runs here
    assert len(stream.getvalue().splitlines()) == 1


def test_records_written_while_a_job_runs_carry_its_ids(lines) -> None:  # type: ignore[no-untyped-def]
    logger, stream = lines
    app = Celery("test-logs", set_as_current=False)

    # Not shared: a shared task joins every app finalized later in this process, mailpipe's too.
    @app.task(name="mailpipe.process_email", shared=False)
    def process_email(email_id: int) -> None: ...

    @app.task(name="mailpipe.sweep", shared=False)
    def sweep() -> None: ...

    for task, request in [
        (process_email, {"id": "t-1", "args": (42,), "mailpipe_email_id": 42}),
        (process_email, {"id": "t-2", "args": (43,)}),  # no header: the first argument
        (sweep, {"id": "t-3", "args": ()}),
    ]:
        task.push_request(**request)
        _task_stack.push(task)
        try:
            logger.info("inside %s", request["id"])
        finally:
            _task_stack.pop()
            task.pop_request()
    first, second, third = records(stream)
    assert (first["task_id"], first["task_name"], first["email_id"]) == (
        "t-1",
        "mailpipe.process_email",
        42,
    )
    assert (second["task_id"], second["email_id"]) == ("t-2", 43)
    assert third["task_id"] == "t-3" and "email_id" not in third


def test_celery_s_failure_record_keeps_one_traceback(lines) -> None:  # type: ignore[no-untyped-def]
    logger, stream = lines
    try:
        raise ValueError(BODY)
    except ValueError:
        context = {"id": "t-9", "name": "mailpipe.sweep", "traceback": "Traceback ...", "exc": "x"}
        logger.error(
            "Task %(name)s[%(id)s] raised", context, exc_info=True, extra={"data": context}
        )
    [record] = records(stream)
    assert record["message"] == "Task mailpipe.sweep[t-9] raised"
    assert "traceback" not in record["data"] and record["data"]["id"] == "t-9"
    assert (
        record["exc_info"].endswith("\nValueError") and "Zahlungseingang" not in record["exc_info"]
    )


def test_celery_s_own_notices_are_json_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "out"
    with path.open("w") as out:
        logs.json_say("worker: Cold shutdown (MainProcess)", out)
    [record] = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["message"] == "worker: Cold shutdown (MainProcess)"
    assert {"time", "level", "logger", "process"} <= set(record)


def _parse_header() -> None:
    raise ValueError(f"unreadable Subject: {SUBJECT}")


def _raise_a_chain() -> None:
    """A KeyError quoting the body, handled by raising a ValueError quoting the subject, which
    a mailpipe error is raised from: every link of the chain, and the frames of each."""
    try:
        try:
            raise KeyError(BODY)
        except KeyError:
            _parse_header()
    except ValueError as exc:
        raise InputRejected("a header could not be read") from exc


def _traceback_of(handler: logging.Handler, log_format: str) -> str:
    stream = io.StringIO()
    handler.setStream(stream)  # type: ignore[attr-defined]
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.propagate = False
    logger.addHandler(handler)
    logs.set_up(logger, log_format)
    try:
        _raise_a_chain()
    except InputRejected:
        logger.exception("email 7: rejected")
    logger.handlers.clear()
    text = stream.getvalue()
    return json.loads(text)["exc_info"] if log_format == "json" else text


@pytest.mark.parametrize(
    ("handler", "log_format"),
    [
        (logging.StreamHandler(), "json"),
        (logging.StreamHandler(), "text"),
        # The worker's and beat's plain lines: Celery's own formatter.
        (_celery_handler := logging.StreamHandler(), "text"),
    ],
    ids=["json", "standard", "celery"],
)
def test_a_traceback_names_each_exception_in_describe_s_words(
    handler: logging.Handler, log_format: str
) -> None:
    if handler is _celery_handler:
        handler.setFormatter(ColorFormatter("%(levelname)s %(message)s", use_color=False))
    text = _traceback_of(handler, log_format)
    assert "Sonnenschein" not in text and "Zahlungseingang" not in text
    # As Python prints it: each link, its frames and code, and the class it raised.
    assert text.count("Traceback (most recent call last):") == 3
    assert "During handling of the above exception, another exception occurred:" in text
    assert "The above exception was the direct cause of the following exception:" in text
    assert (
        "in _parse_header" in text and 'raise ValueError(f"unreadable Subject: {SUBJECT}")' in text
    )
    assert "\nKeyError\n" in text and "\nValueError\n" in text
    assert "InputRejected: a header could not be read" in text


def test_a_traceback_sent_from_another_process_is_named_without_its_frames() -> None:
    """Celery's main process has a child's failure with billiard's stand-in for a traceback."""
    from billiard.einfo import ExceptionInfo

    try:
        _parse_header()
    except ValueError:
        info = ExceptionInfo()
    described = logs.described_traceback(info.exception.exc, info.tb)
    assert described.endswith("\nValueError") and "Sonnenschein" not in described
    assert "in _parse_header" in described
