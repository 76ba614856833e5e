"""The failed list's and the search's filters, given as the same strings to each face: `mailpipe
failed` and `mailpipe find`, the console's `/failed` (its page and its form) and `/search`, and
the API's `/api/failed` and `/api/search`. Each face reads them with the one reader of
`mailpipe/operations/search.py`, so each gets the same filter or refuses with the same reason.

Pure code: the faces run in this process (click's runner; the console's ASGI app, called as a
server would call it) over a database that is never reached, whose lists note the filter they
were asked for."""

from __future__ import annotations

import html
import json
import re
from contextlib import nullcontext
from datetime import datetime
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlencode

import anyio
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.types import Message, Scope

from mailpipe.broker.queues import Lane, Stage
from mailpipe.cli import context
from mailpipe.cli import main as cli
from mailpipe.operations import actions, search, status
from mailpipe.operations.search import EmailFilter, Found
from mailpipe.operations.status import FailedFilter, Page
from mailpipe.settings import Settings
from mailpipe.web import api, pages, searching
from mailpipe.web.app import create_app
from mailpipe.web.auth import LOCAL_USER, csrf_token


class Faces:
    """The CLI and the console, over lists that note the filter each was asked for."""

    def __init__(self, resources: object) -> None:
        self.asked: list[object] = []
        # No user: the local operator's console, on loopback.
        app = create_app(Settings())
        app.state.resources = resources
        self.secret = app.state.secret
        self.app = app

    def read(self, command: str, path: str, values: dict[str, str]) -> list[object]:
        """What each face made of `values`: the filter it listed (or acted) with, or the
        reason it refused them."""
        answers: list[object] = []

        def answer(refusal: str | None) -> None:
            answers.append(refusal if refusal is not None else self.asked.pop())

        run = CliRunner().invoke(cli.main, [command, "--json", *_options(values)])
        assert run.exit_code in (0, 2), run.output
        answer(run.stderr.removeprefix("Error: ").rstrip("\n") if run.exit_code else None)
        code, page = call(self.app, "GET", path, values)
        problems = re.findall(r'<p class="problem">([^<]*)</p>', page)
        assert code == (400 if problems else 200), page
        answer(html.unescape(problems[0]) if problems else None)
        code, body = call(self.app, "GET", f"/api{path}", values)
        answer(json.loads(body)["error"] if code == 400 else None)
        if path == "/failed":
            # The confirmation's form, as "Retry all matching" posts it.
            token = csrf_token(self.secret, LOCAL_USER)
            form = {**values, "do": "retry-matching", "expect": "1", "csrf_token": token}
            code, body = call(self.app, "POST", path, form)
            answer(body.removeprefix("400: ").rstrip("\n") if code == 400 else None)
        assert self.asked == []
        return answers


def call(app: Starlette, method: str, path: str, values: dict[str, str]) -> tuple[int, str]:
    """The status and body of one request to `app`: `values` in the query of a GET, the form
    of a POST."""
    encoded = urlencode(values).encode()
    headers = [(b"host", b"127.0.0.1")]
    if method == "POST":
        headers.append((b"content-type", b"application/x-www-form-urlencoded"))
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"" if method == "POST" else encoded,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": encoded if method == "POST" else b""}

    async def send(message: Message) -> None:
        sent.append(message)

    anyio.run(app, scope, receive, send)
    body = b"".join(message.get("body", b"") for message in sent[1:])
    return sent[0]["status"], body.decode()


def _options(values: dict[str, str]) -> list[str]:
    """`values` as the CLI's options: `view=dismissed` is `mailpipe failed --dismissed`."""
    args = []
    for name, value in values.items():
        args += ["--dismissed"] if name == "view" else [f"--{name.replace('_', '-')}", value]
    return args


@pytest.fixture
def faces(monkeypatch: pytest.MonkeyPatch) -> Faces:
    never = SimpleNamespace(session=nullcontext, reading=nullcontext)
    resources = SimpleNamespace(db=never, searches=never, settings=Settings())
    faces = Faces(resources)

    def failed_page(session: object, filt: FailedFilter, *paging: int) -> Page:
        faces.asked.append(filt)
        return Page([], 1, 1, 0)

    def find(session: object, filt: EmailFilter, *paging: Any) -> Found:
        faces.asked.append(filt)
        return Found([], None)

    def retry(res: object, ids: object, filt: FailedFilter, **kw: Any) -> actions.Done:
        faces.asked.append(filt)
        return actions.Done([])

    for module in (status, pages, api):
        monkeypatch.setattr(module, "failed_page", failed_page)
    for module in (search, searching):
        monkeypatch.setattr(module, "find", find)
    monkeypatch.setattr(pages, "error_classes", lambda session: [])
    monkeypatch.setattr(actions, "retry", retry)
    monkeypatch.setattr(context, "migrated", lambda: resources)
    return faces


@pytest.mark.parametrize(
    ("values", "read"),
    [
        ({}, FailedFilter()),
        ({"since": "2026-01-31"}, FailedFilter(since=datetime(2026, 1, 31))),
        (
            {"since": "2026-01-31T14:00", "until": "2026-01-31 18:30:15"},
            FailedFilter(since=datetime(2026, 1, 31, 14), until=datetime(2026, 1, 31, 18, 30, 15)),
        ),
        # With an offset, or Z, a time is converted to UTC; without, it is UTC.
        (
            {"since": "2026-01-31T14:00:00Z", "until": "2026-01-31T18:00+02:00"},
            FailedFilter(since=datetime(2026, 1, 31, 14), until=datetime(2026, 1, 31, 16)),
        ),
        (
            {"error_class": "BlobMissing", "stage": "model"},
            FailedFilter(error_class="BlobMissing", stage=Stage.MODEL),
        ),
        ({"view": "dismissed"}, FailedFilter(dismissed=True)),
    ],
    ids=repr,
)
def test_the_failed_list_s_filter_is_the_same_in_every_face(
    values: dict[str, str], read: FailedFilter, faces: Faces
) -> None:
    assert faces.read("failed", "/failed", values) == [read] * 4


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        (
            {"since": "yesterday"},
            "since is a date or a date and time, as 2026-01-31 or 2026-01-31T14:00 "
            "(UTC unless given)",
        ),
        ({"until": "2026-02-30"}, "until is a date or a date and time"),
        ({"stage": "gpu"}, "stage is one of cpu, model"),
        (
            {"until": "0001-01-01T00:00+01:00"},
            "until is out of range: from 0001-01-01 to 9999-12-31 in UTC",
        ),
        ({"since": "2026-02-01", "until": "2026-01-01"}, "since is earlier than until"),
        (
            {"error_class": "Blob\x1bMissing"},
            "error_class is text without control characters, in UTF-8",
        ),
        ({"error_class": "E" * 65}, "error_class is at most 64 characters"),
        (
            {"stage": "gpu", "until": "soon"},
            "stage is one of cpu, model; until is a date or a date and time",
        ),
    ],
    ids=repr,
)
def test_a_failed_list_filter_is_refused_with_the_same_reason_in_every_face(
    values: dict[str, str], reason: str, faces: Faces
) -> None:
    answers = faces.read("failed", "/failed", values)
    assert len(set(answers)) == 1, answers
    assert str(answers[0]).startswith(reason), answers[0]


@pytest.mark.parametrize(
    ("values", "read"),
    [
        (
            {"since": "2026-01-31T14:00:00Z", "until": "2026-02-01", "state": "failed"},
            EmailFilter(
                since=datetime(2026, 1, 31, 14), until=datetime(2026, 2, 1), state="failed"
            ),
        ),
        ({"label": "invoice", "lane": "bulk"}, EmailFilter(label="invoice", lane=Lane.BULK)),
    ],
    ids=repr,
)
def test_the_search_s_filter_is_the_same_in_every_face(
    values: dict[str, str], read: EmailFilter, faces: Faces
) -> None:
    assert faces.read("find", "/search", values) == [read] * 3


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"until": "31/01/2026"}, "until is a date or a date and time"),
        ({"lane": "fast"}, "lane is one of live, bulk"),
        ({"since": "2026-02-01", "until": "2026-01-01"}, "since is earlier than until"),
        ({"since": "0001-01-01T00:00+01:00"}, "since is out of range: from 0001-01-01"),
    ],
    ids=repr,
)
def test_a_search_is_refused_with_the_same_reason_in_every_face(
    values: dict[str, str], reason: str, faces: Faces
) -> None:
    answers = faces.read("find", "/search", values)
    assert len(set(answers)) == 1, answers
    assert str(answers[0]).startswith(reason), answers[0]
