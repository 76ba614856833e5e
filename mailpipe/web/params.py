"""What a request's path, query or form carries, read and checked: a 400 names what is wrong.
Shared by the pages, their forms and the API."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request

from mailpipe.broker.queues import Stage
from mailpipe.operations.status import FailedFilter

FILTERS = ("error_class", "stage", "since", "until")


def email_id(request: Request) -> int:
    text = request.path_params["email_id"]
    try:
        return int(text)
    except ValueError:
        raise HTTPException(400, "an email id is a whole number") from None


def page_number(params: Mapping[str, str]) -> int:
    try:
        return max(1, int(params.get("page") or 1))
    except ValueError:
        raise HTTPException(400, "page is a whole number") from None


def filter_fields(params: Mapping[str, Any]) -> dict[str, str]:
    """The failed list's filters as the form and the links carry them."""
    return {name: str(params.get(name) or "").strip() for name in FILTERS}


def failed_filter(params: Mapping[str, Any]) -> tuple[FailedFilter, list[str]]:
    """The FailedFilter of the query or form, and what in it could not be read."""
    fields = filter_fields(params)
    problems = []
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
    filt = FailedFilter(
        error_class=fields["error_class"] or None,
        stage=stage,
        since=times["since"],
        until=times["until"],
    )
    return filt, problems


def query(fields: Mapping[str, str], **changes: Any) -> str:
    """A list's query string: its filters (the empty ones left out) and `changes`."""
    merged = {**fields, **{key: str(value) for key, value in changes.items()}}
    return urlencode({key: value for key, value in merged.items() if value})
