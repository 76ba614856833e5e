"""The failed and review lists' acts on many emails come from one table (`verbs.ON_LISTS`): each
`do` a list's form posts reaches its operation with the ticked emails, or with what the list
holds and the count confirmed, and back to the list with what it did; the confirmation pages
take the verbs that act on all of a list, and nothing else (the app called in this process; the
operations recorded, not run)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import SecretStr
from starlette.applications import Starlette

from mailpipe.operations import actions
from mailpipe.operations.status import FailedFilter
from mailpipe.settings import Settings
from mailpipe.web import pages, verbs
from mailpipe.web.app import create_app
from mailpipe.web.auth import csrf_token
from tests.unit.web.test_forget_action import OPERATOR, call

Asked = list[tuple[str, tuple[Any, ...], dict[str, Any]]]

OPERATIONS = ("retry", "dismiss", "undo_dismiss", "clear_review")
# What `actions.marked` answers: the emails on the review list.
MARKED = [7, 8]


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> tuple[Starlette, Asked]:
    settings = Settings(web_operators=SecretStr(":".join(OPERATOR)))
    app = create_app(settings)
    app.state.resources = SimpleNamespace(settings=settings)
    asked: Asked = []

    def recorded(name: str) -> Any:
        def act(res: object, *args: Any, **kw: Any) -> actions.Done:
            asked.append((name, args, {k: v for k, v in kw.items() if k != "enqueue"}))
            return actions.Done([5], 1, {6: "not failed"})

        return act

    for name in OPERATIONS:
        monkeypatch.setattr(actions, name, recorded(name))
    monkeypatch.setattr(actions, "marked", lambda res: MARKED)
    monkeypatch.setattr(pages, "count_failed", lambda res, filt: actions.Counted(3))
    monkeypatch.setattr(pages, "count_of", lambda res, ids: actions.Counted(len(ids)))
    monkeypatch.setattr(pages, "marked", lambda res: MARKED)
    return app, asked


TICKED = {"email_id": ["5", "6"]}
ALL = {"expect": "3", "error_class": "Timeout"}
TIMEOUTS = FailedFilter(error_class="Timeout")
CONFIRMED = {"user": "web:ops", "expect": 3}

# Each list, each `do` its form may post, what with, and the operation it reaches.
CASES = [
    ("failed", "retry-selected", TICKED, "retry", ([5, 6], None), {"expect": None}),
    ("failed", "retry-matching", ALL, "retry", (None, TIMEOUTS), {"expect": 3}),
    ("failed", "dismiss-selected", TICKED, "dismiss", ([5, 6], None), {"expect": None}),
    ("failed", "dismiss-matching", ALL, "dismiss", (None, TIMEOUTS), {"expect": 3}),
    ("failed", "undo-selected", TICKED, "undo_dismiss", ([5, 6],), {}),
    ("review", "retry-selected", TICKED, "retry", ([5, 6], None), {"expect": None}),
    ("review", "retry-matching", ALL, "retry", (MARKED, None), {"expect": 3}),
    ("review", "dismiss-selected", TICKED, "dismiss", ([5, 6], None), {"expect": None}),
    ("review", "dismiss-matching", ALL, "dismiss", (MARKED, None), {"expect": 3}),
    ("review", "undo-selected", TICKED, "undo_dismiss", ([5, 6],), {}),
    ("review", "clear-selected", TICKED, "clear_review", ([5, 6],), {"expect": None}),
    ("review", "clear-matching", ALL, "clear_review", (MARKED,), {"expect": 3}),
]


def posted(app: Starlette, page: str, do: str, values: dict[str, Any]) -> tuple[int, str]:
    """A list's form posted, as urlencoded pairs (a box ticked per email): status, location."""
    form = [("do", do), ("csrf_token", csrf_token(app.state.secret, "ops"))]
    form += [(k, v) for k, vs in values.items() for v in ([vs] if isinstance(vs, str) else vs)]
    status, headers, _ = call(app, f"/{page}", OPERATOR, form=form)
    return status, headers.get("location", "")


def test_the_cases_name_every_do_each_list_takes() -> None:
    assert [(page, do) for page, do, *_ in CASES] == [
        (page, do) for page in ("failed", "review") for do in verbs.posted_on(page)
    ]


@pytest.mark.parametrize(("page", "do", "values", "operation", "args", "kw"), CASES, ids=repr)
def test_a_list_verb_reaches_its_operation(  # type: ignore[no-untyped-def]
    console,
    page: str,
    do: str,
    values: dict[str, Any],
    operation: str,
    args: tuple[Any, ...],
    kw: dict[str, Any],
) -> None:
    app, asked = console
    status, location = posted(app, page, do, values)
    assert asked == [(operation, args, {**kw, "user": "web:ops"})]
    kept = "error_class=Timeout&" if page == "failed" and do.endswith("matching") else ""
    verb = do.split("-")[0]
    assert (status, location) == (303, f"/{page}?{kept}action={verb}&done=1&enqueued=1&refused=1")


@pytest.mark.parametrize(
    ("page", "do"), [("failed", "clear-selected"), ("failed", "undo-matching"), ("review", "x")]
)
def test_a_do_its_list_does_not_take_is_refused(console, page: str, do: str) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    assert posted(app, page, do, TICKED)[0] == 400
    assert asked == []


def test_nothing_ticked_is_nothing_done(console) -> None:  # type: ignore[no-untyped-def]
    app, asked = console
    assert posted(app, "failed", "retry-selected", {}) == (
        303,
        "/failed?action=retry&done=0&enqueued=0&refused=0",
    )
    assert asked == []


# Each list's confirmation of an act on all it holds, by its `do`, and what its title asks.
CONFIRMATIONS = [
    ("failed", "retry", "Retry all 3 failed runs the filters match?"),
    ("failed", "dismiss", "Dismiss all 3 failed runs the filters match?"),
    ("review", "retry", "Retry all 2 emails on the review list?"),
    ("review", "dismiss", "Dismiss all 2 emails on the review list?"),
    ("review", "clear", "Clear the mark of all 2 emails on the review list?"),
]


def test_the_confirmations_are_the_verbs_that_act_on_all() -> None:
    assert [(page, verb) for page, verb, _ in CONFIRMATIONS] == [
        (page, verb) for page in ("failed", "review") for verb in verbs.on_all(page)
    ]


@pytest.mark.parametrize(("page", "verb", "title"), CONFIRMATIONS, ids=repr)
def test_a_confirmation_posts_its_verb_on_all(console, page: str, verb: str, title: str) -> None:  # type: ignore[no-untyped-def]
    app, _ = console
    status, _, body = call(app, f"/{page}/confirm?do={verb}", OPERATOR, method="GET")
    assert status == 200
    assert title in body
    assert f'value="{verb}-matching"' in body


@pytest.mark.parametrize(
    ("page", "verb"), [("failed", "clear"), ("failed", "undo"), ("review", "undo")]
)
def test_a_confirmation_refuses_a_verb_that_acts_on_the_ticked_alone(  # type: ignore[no-untyped-def]
    console, page: str, verb: str
) -> None:
    app, _ = console
    assert call(app, f"/{page}/confirm?do={verb}", OPERATOR, method="GET")[0] == 400
