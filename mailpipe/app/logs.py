"""Log records as JSON lines, for every role, when `MAILPIPE_LOG_FORMAT=json`.

Plain text (Celery's own format) stays the default, for a terminal. With `json` each record is one
line holding one JSON object, so CloudWatch (or any collector) gets one event per record, with a
traceback inside its record instead of one event per line of it:

    {"time": "2025-01-01T12:00:00.123456+00:00", "level": "ERROR",
     "logger": "mailpipe.pipeline.job", "message": "email 42: unexpected error",
     "process": 1234, "process_name": "ForkPoolWorker-1", "task_id": "6f0c...",
     "task_name": "mailpipe.process_email", "email_id": 42,
     "exc_info": "Traceback (most recent call last): ..."}

Celery also writes a few lines itself, from the worker's signal handlers ("worker: Cold shutdown
(MainProcess)"), with a bare `os.write` rather than the log (a handler must not take the logging
lock). In JSON mode those become JSON lines too (`json_say`), so that every line is a record and
CloudWatch's multiline pattern `^{` (deploy/ecs) never glues a plain line onto a record.

`task_id`, `task_name` and `email_id` are there on every record logged while a job runs, in
whichever module it is logged (the pipeline never imports Celery; the fields come from Celery's
current task). Other fields given with `extra=` are kept as fields too.

In either format a traceback names each exception in `errors.describe`'s words
(`DescribedTracebacks`): the frames (files, lines, code) as Python prints them, and nothing of a
message that may quote an email.

Who installs it (`set_up`): the worker and beat through Celery's logging signals
(`after_setup_logger` and `after_setup_task_logger`, mailpipe/app/signals.py), which keeps
Celery's handlers (stderr, the redirection of print() to the log) and changes only their format;
Flower through its configuration (mailpipe/app/flowerconfig.py), after Tornado has set up its
handler; the console and the CLI through `to_stderr`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from mailpipe.errors import describe

# Standard record attributes written under these names; everything else a record carries (extra=)
# is written under its own name.
_FIELDS = "%(levelname)s %(name)s %(message)s %(process)d %(processName)s"
_RENAMED = {"levelname": "level", "name": "logger", "processName": "process_name"}

SWEEP = "mailpipe.sweep"  # the one task whose first argument is not an email id


class JobContext(logging.Filter):
    """Adds the running task's id and name, and its email's id, to each record logged while a
    task runs in this process (a prefork child)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from celery._state import get_current_task

        data = getattr(record, "data", None)
        if isinstance(data, dict) and "traceback" in data and (record.exc_info or record.exc_text):
            # Celery's failure records carry the traceback twice (exc_info, and data for its own
            # formatters): keep the one in exc_info. A new dict: data is also the message's args.
            record.data = {key: value for key, value in data.items() if key != "traceback"}

        task = get_current_task()
        request = getattr(task, "request", None)
        task_id = getattr(request, "id", None)
        if task is None or task_id is None:
            return True
        record.task_id = task_id
        record.task_name = task.name
        email_id = _email_id(task.name, request)
        if email_id is not None:
            record.email_id = email_id
        return True


def _email_id(task_name: str, request: Any) -> int | None:
    from mailpipe.broker.layout import EMAIL_ID_HEADER

    # Every job message carries its email's id in a header (layout.job_headers), which
    # Celery puts on the request; the email's jobs also take it as their first argument.
    found = request.get(EMAIL_ID_HEADER) if hasattr(request, "get") else None
    if found is None and task_name != SWEEP:
        args = getattr(request, "args", None) or ()
        found = args[0] if args else None
    if isinstance(found, int) and not isinstance(found, bool):
        return found
    return None


class DescribedTracebacks(logging.Filter):
    """Renders a record's traceback (`described_traceback`) into `exc_text`, which every
    formatter prints when `exc_info` is gone: JSON's, Celery's and the standard one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            _, exc, tb = record.exc_info
            if exc is not None:
                record.exc_text = described_traceback(exc, tb)
            record.exc_info = None
        return True


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def described_traceback(exc: BaseException, tb: Any = None) -> str:
    """`exc`'s traceback as Python prints it, chained exceptions included, with each exception's
    line in `describe`'s words instead of its message."""
    chain: list[tuple[BaseException, str]] = []
    link = ""
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen, _ in chain):
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current = None
    lines: list[str] = []
    for error, linked in reversed(chain):
        lines.append("Traceback (most recent call last):\n")
        frames = tb if error is exc and tb is not None else error.__traceback__
        try:
            lines.extend(traceback.format_tb(frames))
        except Exception:  # a traceback sent from another process, as Celery's parent has it
            lines.append("  (frames not available)\n")
        lines.append(f"{describe(error)}\n{linked}")
    return "".join(lines).rstrip("\n")


def set_up(logger: logging.Logger | None, log_format: str) -> None:
    """Every handler of `logger`: tracebacks in `describe`'s words, and JSON lines with `json`;
    idempotent."""
    if logger is None:
        return
    if log_format == "json":
        use_json(logger)
    for handler in logger.handlers:
        if not any(isinstance(f, DescribedTracebacks) for f in handler.filters):
            handler.addFilter(DescribedTracebacks())


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        _FIELDS,
        rename_fields=_RENAMED,
        timestamp="time",
        json_ensure_ascii=False,
    )


def use_json(logger: logging.Logger | None) -> None:
    """Give every handler of `logger` the JSON format and the job's fields; idempotent."""
    if logger is None:
        return
    for handler in logger.handlers:
        handler.setFormatter(json_formatter())
        if not any(isinstance(f, JobContext) for f in handler.filters):
            handler.addFilter(JobContext())


def to_stderr(logger: logging.Logger, log_format: str) -> None:
    """Send `logger`'s INFO records and above to stderr, as JSON lines with `json`, else as
    plain lines: for the processes Celery does not set up (the console, the CLI)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(name)s] %(message)s"))
    handler.addFilter(DescribedTracebacks())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def json_say(msg: str, f: Any = sys.__stderr__) -> None:
    """Celery's `safe_say` (celery.apps.worker), writing a JSON line: still one `os.write` and no
    lock, since it runs in a signal handler."""
    record = {
        "level": "INFO",
        "logger": "celery.apps.worker",
        "message": msg,
        "process": os.getpid(),
        "process_name": "MainProcess",
        "time": datetime.now(UTC).isoformat(),
    }
    try:
        os.write(f.fileno(), (json.dumps(record) + "\n").encode())
    except (AttributeError, OSError, ValueError):
        pass  # as Celery's: a lost notice must never break a shutdown


def use_json_for_celery_notices() -> None:
    """What Celery prints from the worker's signal handlers becomes JSON lines (`json_say`)."""
    from celery.apps import worker

    worker.safe_say = json_say
