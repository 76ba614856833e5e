"""What a request's path, query or form carries, read and checked: a 400 names what is wrong.
Shared by the pages, their forms and the API."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request

from mailpipe.operations.activity import WINDOWS, Window
from mailpipe.operations.search import (
    FAILED_FIELDS,
    BadSearch,
    EmailFilter,
    read_failed,
    read_search,
)
from mailpipe.operations.status import FailedFilter

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


def searched(values: Mapping[str, Any]) -> tuple[EmailFilter, int | None]:
    """The search's filter and its page's `before` (`search.read_search`), or a 400 with what
    is wrong."""
    try:
        return read_search(values)
    except BadSearch as exc:
        raise HTTPException(400, str(exc)) from None


def failed_filter(values: Mapping[str, Any]) -> FailedFilter:
    """The failed list's filter (`search.read_failed`), or a 400 with what is wrong."""
    try:
        return read_failed(values)
    except BadSearch as exc:
        raise HTTPException(400, str(exc)) from None


@dataclass(frozen=True)
class Posted(ABC):
    """What an action was given, a form's fields or a JSON body's, read by name: a choice the
    same in both, a flag and a count as each writes them (`Form`, `Body`)."""

    values: Mapping[str, Any]

    def choice(self, name: str, allowed: Iterable[str], default: str | None = None) -> str:
        """The value of `name`, one of `allowed`; `default` when it is not there."""
        given = self.values if default is None else {name: default, **self.values}
        return choice(given, name, tuple(allowed))

    @abstractmethod
    def flag(self, name: str) -> bool: ...

    @abstractmethod
    def count(self, name: str) -> int | None: ...


class Form(Posted):
    """A form's fields: text; a box ticked is "yes"."""

    def flag(self, name: str) -> bool:
        return self.values.get(name) == "yes"

    def count(self, name: str) -> int | None:
        return count(self.values, name)


class Body(Posted):
    """A JSON body's values: a flag is true or false, a count a number."""

    def flag(self, name: str) -> bool:
        value = self.values.get(name, False)
        if not isinstance(value, bool):
            raise HTTPException(400, f"{name} is true or false")
        return value

    def count(self, name: str) -> int | None:
        value = self.values.get(name)
        if value is None:
            return None
        if type(value) is not int or not 0 <= value <= MAX_ID:
            raise HTTPException(400, f"{name} is a whole number from 0 to {MAX_ID}")
        return value
