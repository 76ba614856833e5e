"""What the console's logs keep of a request (the app called in this process, as a server would
call it; the operation recorded, not run): the access log's path without its query string, and
of an action nothing of its own: its audit line is the operation's (`actions`), and no line has
its filters' values, which may be an email's sender or subject (`mailpipe forget` must leave
them nowhere)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette

from mailpipe.operations import actions
from mailpipe.settings import Settings
from mailpipe.web import server
from mailpipe.web.app import create_app
from mailpipe.web.auth import LOCAL_USER, csrf_token
from tests.unit.operations.test_filter_faces import call

SENDER = "alice.target@residue.example"


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> tuple[Starlette, list[dict[str, Any]]]:
    settings = Settings()  # no users: every request on loopback is the local operator's
    app = create_app(settings)
    app.state.resources = SimpleNamespace(settings=settings)
    asked: list[dict[str, Any]] = []

    def reprocess(res: object, filt: Any, step: Any, **kw: Any) -> actions.Reprocessed:
        asked.append({"filt": filt, **kw})
        return actions.Reprocessed(1, 0, 7, 10_000, reprocess_id=8, enqueued=1, taken=1)

    monkeypatch.setattr(actions, "reprocess", reprocess)
    return app, asked


def test_the_access_log_keeps_the_path_and_not_the_query(console, caplog) -> None:  # type: ignore[no-untyped-def]
    app, _ = console
    caplog.set_level(logging.INFO)
    assert call(app, "GET", "/healthz", {"sender": SENDER, "subject": "Payslip"})[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "mailpipe.web.access"]
    assert lines == ['127.0.0.1:40000 - "GET /healthz HTTP/1.1" 200']


def test_an_action_leaves_its_audit_line_to_the_operation(console, caplog) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    caplog.set_level(logging.INFO)
    form = {
        "sender": SENDER,
        "subject": "Payslip",
        "from": "classify",
        "in_lane": "bulk",
        "do": "reprocess",
        "expect": "1",  # the plan's count, confirmed
        "as_of": "7",
        "csrf_token": csrf_token(app.state.secret, LOCAL_USER),
    }
    assert call(app, "POST", "/reprocess", form)[0] == 303
    assert asked and asked[0]["filt"].sender == SENDER  # the action had the values
    assert asked[0]["user"] == f"web:{LOCAL_USER}"  # whom its audit line names
    logged = [(r.name, r.getMessage()) for r in caplog.records]
    assert logged == [("mailpipe.web.access", '127.0.0.1:40000 - "POST /reprocess HTTP/1.1" 303')]


def test_mailpipe_web_turns_uvicorns_access_log_off(monkeypatch: pytest.MonkeyPatch) -> None:
    started: dict[str, Any] = {}
    monkeypatch.setattr(server, "_log_to_stderr", lambda settings: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: started.update(options))
    server.serve(Settings())
    assert started["access_log"] is False
