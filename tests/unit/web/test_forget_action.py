"""Forget from the console and the API (the app called in this process, as a server would call it;
the operation itself recorded, not run): an operator's act, confirmed; a viewer is refused."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlencode

import anyio
import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.types import Message

from mailpipe.operations import actions
from mailpipe.settings import Settings
from mailpipe.web.app import create_app
from mailpipe.web.auth import csrf_token

OPERATOR = ("ops", "ops-password")
VIEWER = ("viewer", "viewer-password")


def call(
    app: Starlette,
    path: str,
    user: tuple[str, str],
    *,
    form: dict[str, str] | list[tuple[str, str]] | None = None,
    body: object = None,
    method: str = "POST",
) -> tuple[int, dict[str, str], str]:
    """One request to `app` as `user` (a POST, with a form or a JSON body, unless `method` says
    otherwise; `path` may end in a query): its status, headers and body."""
    if form is not None:
        content, kind = urlencode(form).encode(), b"application/x-www-form-urlencoded"
    else:
        content, kind = json.dumps(body).encode(), b"application/json"
    auth = base64.b64encode(":".join(user).encode())
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", kind),
            (b"authorization", b"Basic " + auth),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": content}

    async def send(message: Message) -> None:
        sent.append(message)

    anyio.run(app, scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:]).decode()


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> tuple[Starlette, list[dict[str, Any]]]:
    """The console with an operator and a viewer, whose forgets are recorded, not run."""
    settings = Settings(
        web_operators=SecretStr(":".join(OPERATOR)), web_viewers=SecretStr(":".join(VIEWER))
    )
    app = create_app(settings)
    app.state.resources = SimpleNamespace(settings=settings)
    asked: list[dict[str, Any]] = []

    def forget(res: object, email_ids: Any = None, filt: Any = None, **kw: Any) -> Any:
        asked.append({"email_ids": email_ids, "filt": filt, **kw})
        dry_run = kw.get("dry_run", False)
        return actions.Forgotten(list(email_ids or [7]), {"email_message": 1}, 2, 0, 0, {}, dry_run)

    monkeypatch.setattr(actions, "forget", forget)
    return app, asked


def test_a_viewer_cannot_forget_from_the_page_nor_the_api(console) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    form = {"do": "forget", "confirm": "yes", "csrf_token": csrf_token(app.state.secret, "viewer")}
    assert call(app, "/emails/5/act", VIEWER, form=form)[0] == 403
    assert call(app, "/api/emails/5/forget", VIEWER, body={})[0] == 403
    assert call(app, "/api/forget", VIEWER, body={"email_ids": [5]})[0] == 403
    assert asked == []


def test_an_operator_forgets_from_the_email_page_once_confirmed(console) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    form = {"do": "forget", "csrf_token": csrf_token(app.state.secret, "ops")}
    status, _, body = call(app, "/emails/5/act", OPERATOR, form=form)
    assert (status, asked) == (400, [])
    assert "tick the box to confirm" in body

    status, headers, _ = call(app, "/emails/5/act", OPERATOR, form={**form, "confirm": "yes"})
    assert status == 303
    assert headers["location"] == "/search?action=forget&done=1"
    assert [{k: v for k, v in a.items() if k != "enqueue"} for a in asked] == [
        {"email_ids": [5], "filt": None, "user": "web:ops", "dry_run": False}
    ]
    assert callable(asked[0]["enqueue"])  # a copy that becomes the origin has its job sent


def test_an_operator_forgets_through_the_api(console) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    status, _, body = call(app, "/api/emails/5/forget", OPERATOR, body={"dry_run": True})
    assert status == 200
    assert json.loads(body) == {
        "email_ids": [5],
        "rows": {"email_message": 1},
        "blobs": 2,
        "redis": 0,
        "handed_on": 0,
        "completed": [],
        "enqueued": 0,
        "refused": {},
        "dry_run": True,
    }
    status, _, _ = call(app, "/api/forget", OPERATOR, body={"sender": "bob@acme.example"})
    assert status == 200
    assert [(a["email_ids"], a["dry_run"], a["user"]) for a in asked] == [
        ([5], True, "api:ops"),
        (None, False, "api:ops"),
    ]
    assert asked[1]["filt"].sender == "bob@acme.example"
    for refused in ({"sender": "@acme.example"}, {"email_ids": [5], "sender": "a@b.c"}, {}):
        assert call(app, "/api/forget", OPERATOR, body=refused)[0] == 400
    assert len(asked) == 2


def test_an_operator_forgets_a_mailbox_through_the_api(console) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    status, _, _ = call(app, "/api/forget", OPERATOR, body={"mailbox": "acme", "dry_run": True})
    assert status == 200
    assert [(a["email_ids"], a["filt"].mailbox, a["dry_run"]) for a in asked] == [
        (None, "acme", True)
    ]
    for refused in (
        {"mailbox": "acme", "sender": "a@b.c"},
        {"mailbox": "acme", "email_ids": [5]},
        {"mailbox": " "},
        {"mailbox": 5},
    ):
        status, _, body = call(app, "/api/forget", OPERATOR, body=refused)
        assert status == 400, body
        assert "acme" not in body
    assert len(asked) == 1
