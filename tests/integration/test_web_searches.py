"""The search on a real `mailpipe web` when searches are slow: a statement past the web role's
read timeout is a 503 that says so, in JSON from the API; searches past their slots are refused
at once (429 for one user's, 503 for all), with Retry-After; and the overview answers while the
slots are full, from connections the searches do not take.

A search is made slow by a lock on `email_label`, which the label filter reads and the overview
does not: it waits in PostgreSQL, holding its connection, until the test lets go or its statement
timeout gives it up."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests
from sqlalchemy import text

from tests.integration.test_web import console, waiting_on_a_lock  # noqa: F401 (fixture)
from tests.support.console import OPERATOR, OPERATOR_ARGON2, VIEWER
from tests.support.searched import store_searched
from tests.support.waits import wait_for

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


def test_searches_past_their_slots_are_refused_and_the_overview_answers(res, console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    ids = store_searched(res)
    # The pages' pool is 1 and 1 in a burst: two searches on it would hold all of it.
    web = console(
        {
            **os.environ,
            "MAILPIPE_DB_POOL_SIZE": "1",
            "MAILPIPE_WEB_SEARCHES": "2",
            "MAILPIPE_WEB_SEARCHES_PER_USER": "1",
            "MAILPIPE_WEB_STATEMENT_TIMEOUT_MS": "60000",
        }
    )

    def search(user: tuple[str, str], path: str = "/api/search") -> requests.Response:
        return requests.get(f"{web.url}{path}", params=BY_LABEL, auth=user, timeout=30)

    sign_ins = [requests.get(f"{web.url}/", auth=u, timeout=30) for u in (OPERATOR, VIEWER)]
    assert [answer.status_code for answer in sign_ins] == [200, 200]
    threads = ThreadPoolExecutor(2)
    try:
        with labels_locked(res):
            held = [threads.submit(search, user) for user in (OPERATOR, VIEWER)]
            wait_for(lambda: waiting_on_a_lock(res) == 2, 30, "both searches to wait")

            mine = search(OPERATOR)
            assert (mine.status_code, mine.headers["Retry-After"]) == (429, "1")
            assert mine.json() == {
                "error": "1 searches of yours are running, as many as run at once: try again in 1 s"
            }
            page = search(OPERATOR, "/search")
            assert (page.status_code, page.headers["Retry-After"]) == (429, "1")
            anyone = search(OPERATOR_ARGON2)
            assert (anyone.status_code, anyone.headers["Retry-After"]) == (503, "1")
            assert anyone.json() == {
                "error": "2 searches are running, as many as run at once: try again in 1 s"
            }

            overview = requests.get(f"{web.url}/", auth=VIEWER, timeout=10)
            assert overview.status_code == 200 and "<h2>Queues</h2>" in overview.text
            queues = requests.get(f"{web.url}/api/queues", auth=VIEWER, timeout=10)
            assert queues.status_code == 200 and queues.json()["emails"] == len(ids)
            assert not any(answer.done() for answer in held)
        found = [answer.result() for answer in held]
        assert [answer.status_code for answer in found] == [200, 200]
        expected = [ids["overdue"], ids["invoice"]]
        assert all([r["email_id"] for r in a.json()["rows"]] == expected for a in found)
    finally:
        threads.shutdown()
    # The slots given back: each user searches again.
    assert [search(u).status_code for u in (OPERATOR, OPERATOR_ARGON2)] == [200, 200]
