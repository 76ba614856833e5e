"""The acts on one email come from one table (`verbs.ON_EMAIL`) for the email's page and the API:
each verb, posted as a form or as JSON, reaches the same operation with the same arguments, only
the user named by its face (the app called in this process; the operations recorded, not run)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import SecretStr
from starlette.applications import Starlette

from mailpipe.broker.queues import Lane
from mailpipe.operations import actions
from mailpipe.operations.search import EmailFilter
from mailpipe.settings import Settings
from mailpipe.web import verbs
from mailpipe.web.app import create_app
from mailpipe.web.auth import csrf_token
from tests.unit.web.test_forget_action import OPERATOR, call

Asked = list[tuple[str, tuple[Any, ...], dict[str, Any]]]

ANSWERS: dict[str, verbs.Result] = {
    "retry": actions.Done([5], 1),
    "dismiss": actions.Done([5]),
    "undo_dismiss": actions.Done([5]),
    "clear_review": actions.Done([5]),
    "move": actions.Done([5]),
    "reprocess": actions.Reprocessed(1, 0, 7, 10_000, reprocess_id=8, enqueued=1, taken=1),
    "forget": actions.Forgotten([5], {"email_message": 1}, 1, 0, 0),
}


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> tuple[Starlette, Asked]:
    settings = Settings(web_operators=SecretStr(":".join(OPERATOR)))
    app = create_app(settings)
    app.state.resources = SimpleNamespace(settings=settings)
    asked: Asked = []

    def recorded(name: str) -> Any:
        def act(res: object, *args: Any, **kw: Any) -> verbs.Result:
            asked.append((name, args, {k: v for k, v in kw.items() if k != "enqueue"}))
            return ANSWERS[name]

        return act

    for name in ANSWERS:
        monkeypatch.setattr(actions, name, recorded(name))
    return app, asked


# Each verb, what it is posted with, and the operation it reaches with its arguments.
CASES = [
    ("retry", {}, "retry", ([5],), {}),
    ("dismiss", {}, "dismiss", ([5],), {}),
    ("undo-dismiss", {}, "undo_dismiss", ([5],), {}),
    ("clear-review", {}, "clear_review", ([5],), {}),
    ("lane", {"lane": "bulk"}, "move", ([5], Lane.BULK), {}),
    (
        "reprocess",
        {"from": "parse", "lane": "live"},
        "reprocess",
        (EmailFilter(email_id=5), actions.Step.PARSE),
        {"lane": Lane.LIVE, "expect": None, "as_of": None, "over_max": False},
    ),
    ("forget", {}, "forget", ([5],), {"dry_run": False}),
]


def test_the_cases_name_every_verb() -> None:
    assert [verb for verb, *_ in CASES] == list(verbs.ON_EMAIL)


@pytest.mark.parametrize(("verb", "values", "operation", "args", "kw"), CASES, ids=repr)
def test_a_verb_does_the_same_from_the_page_and_the_api(  # type: ignore[no-untyped-def]
    console, verb: str, values: dict[str, str], operation: str, args: tuple[Any], kw: dict[str, Any]
) -> None:
    app, asked = console
    form = {
        **values,
        "do": verb,
        "confirm": "yes",
        "csrf_token": csrf_token(app.state.secret, "ops"),
    }
    assert call(app, "/emails/5/act", OPERATOR, form=form)[0] == 303
    assert call(app, f"/api/emails/5/{verb}", OPERATOR, body=values)[0] == 200
    assert asked == [
        (operation, args, {**kw, "user": "web:ops"}),
        (operation, args, {**kw, "user": "api:ops"}),
    ]


def test_an_unknown_verb_is_refused_by_both_faces(console) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    form = {"do": "archive", "csrf_token": csrf_token(app.state.secret, "ops")}
    assert call(app, "/emails/5/act", OPERATOR, form=form)[0] == 400
    assert call(app, "/api/emails/5/archive", OPERATOR, body={})[0] == 404
    assert asked == []
