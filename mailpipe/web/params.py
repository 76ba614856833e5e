"""What a request's path, query or form carries, read and checked: a 400 names what is wrong.
Shared by the pages, their forms and the API."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request

from mailpipe.broker.queues import Stage
from mailpipe.operations.activity import WINDOWS, Window
from mailpipe.operations.status import FailedFilter

FILTERS = ("error_class", "stage", "since", "until", "view")
# The failed list's views: the runs on it, or those an operator dismissed.
VIEWS = ("", "dismissed")
# Ids are PostgreSQL bigints: a number past them is refused here, not by the database (a 500).
MAX_ID = 2**63 - 1
# A billion pages are 50 billion rows deep, past any list, and their offset fits a bigint.
MAX_PAGE = 10**9


def email_id(request: Request) -> int:
    return whole_number(request.path_params["email_id"], "an email id", MAX_ID)


def page_number(params: Mapping[str, str]) -> int:
    return whole_number(params.get("page") or "1", "page", MAX_PAGE)


def history_before(params: Mapping[str, str]) -> int | None:
    """The attempt an email's page of history ends before (its `older_history`), or None for
    the last attempts."""
    text = params.get("history_before")
    return None if not text else whole_number(text, "history_before", MAX_ID)


def whole_number(text: str, name: str, most: int) -> int:
    """`text` as a number from 1 to `most` in ASCII digits (int() would also take "+1", "1_0"
    and other scripts' digits), or a 400 that says so."""
    if text.isascii() and text.isdigit() and len(text) <= len(str(most)):
        number = int(text)
        if 1 <= number <= most:
            return number
    raise HTTPException(400, f"{name} is a whole number from 1 to {most}")


def unreadable(text: str) -> bool:
    """Whether `text` holds a control character (NUL, which PostgreSQL's text refuses, among
    them) or a byte that was not UTF-8 (decoded as U+FFFD)."""
    return any(unicodedata.category(char) == "Cc" or char == "\ufffd" for char in text)


def filter_fields(params: Mapping[str, Any]) -> dict[str, str]:
    """The failed list's filters as the form and the links carry them."""
    return {name: str(params.get(name) or "").strip() for name in FILTERS}


def failed_filter(params: Mapping[str, Any]) -> tuple[FailedFilter, list[str]]:
    """The FailedFilter of the query or form, and what in it could not be read."""
    fields = filter_fields(params)
    problems = []
    error_class = fields["error_class"] or None
    if error_class is not None and unreadable(error_class):
        problems.append("error_class is text without control characters, in UTF-8")
        error_class = None
    stage = None
    if fields["stage"]:
        try:
            stage = Stage(fields["stage"])
        except ValueError:
            problems.append("stage is cpu or model")
    times: dict[str, datetime | None] = {}
    for name in ("since", "until"):
        try:
            times[name] = datetime.fromisoformat(fields[name]) if fields[name] else None
        except ValueError:
            problems.append(f"{name} is a date and time, as 2025-01-31T14:00 (UTC)")
            times[name] = None
        if times[name] is not None and times[name].tzinfo is not None:  # type: ignore[union-attr]
            problems.append(f"{name} is UTC, without an offset")
            times[name] = None
    if fields["view"] not in VIEWS:
        problems.append("view is dismissed, or none for the failed list")
    filt = FailedFilter(
        error_class=error_class,
        stage=stage,
        since=times["since"],
        until=times["until"],
        dismissed=fields["view"] == "dismissed",
    )
    return filt, problems


def query(fields: Mapping[str, str], **changes: Any) -> str:
    """A list's query string: its filters (the empty ones left out) and `changes`."""
    merged = {**fields, **{key: str(value) for key, value in changes.items()}}
    return urlencode({key: value for key, value in merged.items() if value})


def window(params: Mapping[str, str]) -> Window:
    """The overview's activity window: the last hour unless `window=day`."""
    name = params.get("window") or "hour"
    if name not in WINDOWS:
        raise HTTPException(400, f"window is {' or '.join(WINDOWS)}")
    return WINDOWS[name]
