"""The search on a real `mailpipe web` when searches are slow: a statement past the web role's
read timeout is a 503 that says so, in JSON from the API.

A search is made slow by a lock on `email_label`, which the label filter reads and the overview
does not: it waits in PostgreSQL, holding its connection, until the test lets go or its statement
timeout gives it up."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests
from sqlalchemy import text

from tests.integration.test_web import console  # noqa: F401 (fixture)
from tests.support.console import VIEWER
from tests.support.searched import store_searched

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

BY_LABEL = {"label": "invoice"}


@contextmanager
def labels_locked(res) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """`email_label` locked against every read until the block ends."""
    with res.db.transaction() as session:
        session.execute(text("LOCK TABLE email_label IN ACCESS EXCLUSIVE MODE"))
        yield


def test_a_read_past_the_statement_timeout_is_a_503_that_says_so(res, console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    store_searched(res)
    web = console({**os.environ, "MAILPIPE_WEB_STATEMENT_TIMEOUT_MS": "300"})
    with labels_locked(res):
        api = requests.get(f"{web.url}/api/search", params=BY_LABEL, auth=VIEWER, timeout=10)
        page = requests.get(f"{web.url}/search", params=BY_LABEL, auth=VIEWER, timeout=10)
    said = (
        "the database did not answer within 300 ms (MAILPIPE_WEB_STATEMENT_TIMEOUT_MS): try "
        "again, or narrow the search"
    )
    assert (api.status_code, api.json(), api.headers["Retry-After"]) == (503, {"error": said}, "1")
    assert (page.status_code, page.text, page.headers["Retry-After"]) == (
        503,
        f"503: {said}\n",
        "1",
    )
    assert "/api/search gave up a read at 300 ms (statement timeout)" in web.output()
    # The lock let go, the same search answers.
    again = requests.get(f"{web.url}/api/search", params=BY_LABEL, auth=VIEWER, timeout=10)
    assert again.status_code == 200 and len(again.json()["rows"]) == 2
