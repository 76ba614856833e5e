"""What a request's path, query or form carries, read and checked: a 400 names what is wrong.
Shared by the pages, their forms and the API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request

from mailpipe.operations.activity import WINDOWS, Window
from mailpipe.operations.search import FAILED_FIELDS

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


def count(params: Mapping[str, Any], name: str) -> int | None:
    """A count a confirmation carries (`expect`, `as_of`): a whole number from 0, or None when
    it is not there."""
    text = str(params.get(name) or "")
    if not text:
        return None
    if text.isascii() and text.isdigit() and len(text) <= len(str(MAX_ID)) and int(text) <= MAX_ID:
        return int(text)
    raise HTTPException(400, f"{name} is a whole number from 0 to {MAX_ID}")


def filter_fields(params: Mapping[str, Any]) -> dict[str, str]:
    """The failed list's filters as the query or form sent them (`search.read_failed` reads
    them), for the form that shows them again."""
    return {name: str(params.get(name) or "").strip() for name in FAILED_FIELDS}


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


def choice(values: Mapping[str, Any], name: str, allowed: Any) -> str:
    """The value of `name` in a form or a JSON body, one of `allowed`; else a 400 that lists
    them."""
    value = values.get(name)
    if value not in tuple(allowed):
        raise HTTPException(400, f"{name} is one of {', '.join(allowed)}")
    return str(value)
