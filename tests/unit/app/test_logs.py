"""JSON log lines (mailpipe/app/logs.py): one line per record, the traceback inside it, the job's
ids as fields. A real worker's lines: tests/integration/test_roles.py."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator

import pytest
from celery import Celery
from celery._state import _task_stack

from mailpipe.app import logs

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(stream))
    logs.use_json(logger)
    logs.use_json(logger)  # idempotent: one filter, one format
    yield logger, stream
    logger.handlers.clear()


def records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_traceback_stays_inside_its_one_line_record(lines) -> None:  # type: ignore[no-untyped-def]
    logger, stream = lines
    try:
        raise KeyError("missing")
    except KeyError:
        logger.exception("email %s: unexpected error", 7, extra={"stage": "convert"})
    [record] = records(stream)
    assert record["message"] == "email 7: unexpected error"
    assert record["level"] == "ERROR" and record["logger"] == logger.name
    assert record["exc_info"].startswith("Traceback (most recent call last):")
    assert "KeyError: 'missing'" in record["exc_info"]
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
        raise ValueError("boom")
    except ValueError:
        context = {"id": "t-9", "name": "mailpipe.sweep", "traceback": "Traceback ...", "exc": "x"}
        logger.error(
            "Task %(name)s[%(id)s] raised", context, exc_info=True, extra={"data": context}
        )
    [record] = records(stream)
    assert record["message"] == "Task mailpipe.sweep[t-9] raised"
    assert "traceback" not in record["data"] and record["data"]["id"] == "t-9"
    assert "ValueError: boom" in record["exc_info"]


def test_celery_s_own_notices_are_json_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "out"
    with path.open("w") as out:
        logs.json_say("worker: Cold shutdown (MainProcess)", out)
    [record] = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["message"] == "worker: Cold shutdown (MainProcess)"
    assert {"time", "level", "logger", "process"} <= set(record)
