"""The console's pages: server-rendered HTML over `mailpipe.operations.status`, each carrying its
user's CSRF token for the forms on it (`mailpipe.web.forms`).

Pages are sync endpoints: Starlette runs them on its thread pool, where they may block on the
database and Redis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from starlette.datastructures import URLPath
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from mailpipe.broker.queues import Lane, Stage
from mailpipe.operations.actions import Step
from mailpipe.operations.activity import fleet_activity
from mailpipe.operations.search import (
    FIELDS,
    STATES,
    BadSearch,
    Found,
    failed_fields,
    read_failed,
    read_search,
)
from mailpipe.operations.status import (
    FailedFilter,
    Page,
    email_detail,
    error_classes,
    failed_page,
    fleet_status,
    job_state,
    review_page,
)
from mailpipe.web import charts, forms, params, searching
from mailpipe.web.auth import ACT, csrf_token

PER_PAGE = 50
NOTHING = Page([], 1, 1, 0)


def templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.globals["stages"] = [stage.value for stage in Stage]
    env.globals["url_path_for"] = _url_path_for
    return Jinja2Templates(env=env)


@jinja2.pass_context
def _url_path_for(context: dict[str, Any], name: str, /, **path_params: Any) -> URLPath:
    """A route's path, without a scheme and host: behind a proxy, the host the console is asked
    for may not be the one the browser sees."""
    return context["request"].app.url_path_for(name, **path_params)


def overview(request: Request) -> Response:
    res = request.app.state.resources
    window = params.window(request.query_params)
    with res.db.reading() as session:
        activity = fleet_activity(session, window)
    return _render(
        request,
        "overview.html",
        status=fleet_status(res, estimates=True),
        activity=activity,
        activity_panels=charts.panels(activity),
    )


def failed(request: Request) -> Response:
    page = params.page_number(request.query_params)
    filt: FailedFilter | None = None
    try:
        filt = read_failed(request.query_params)
        fields, problems = failed_fields(filt), []
    except BadSearch as exc:
        # The form as it was sent, with what to correct, and nothing listed: what the filters
        # match is what "all matching" acts on.
        fields, problems = params.filter_fields(request.query_params), [str(exc)]
    with request.app.state.resources.db.reading() as session:
        listed = NOTHING if filt is None else failed_page(session, filt, page, PER_PAGE)
        classes = error_classes(session)
    return _render(
        request,
        "failed.html",
        status_code=400 if problems else 200,
        listed=listed,
        classes=classes,
        filters=fields,
        problems=problems,
        query=lambda **changes: params.query(fields, **changes),
    )


def review(request: Request) -> Response:
    page = params.page_number(request.query_params)
    with request.app.state.resources.db.reading() as session:
        listed = review_page(session, page, PER_PAGE)
    return _render(request, "review.html", listed=listed, query=lambda **c: params.query({}, **c))


def search(request: Request) -> Response:
    """The search page, and the search box's answer: an email id goes to the email's page."""
    asked = {k: v for k, v in request.query_params.items() if k not in forms.NOTICE_KEYS}
    try:
        filt, before = read_search(asked)
    except BadSearch as exc:
        # The form as it was sent, with what to correct.
        sent = {name: request.query_params.get(name, "") for name in FIELDS}
        return _search_page(request, sent, None, [str(exc)])
    if filt.email_id is not None:
        return RedirectResponse(request.app.url_path_for("email", email_id=filt.email_id), 303)
    found = searching.found(request, filt, before)
    return _search_page(request, filt.fields(), found, [], header_note=filt.reads_headers)


def _search_page(
    request: Request,
    fields: dict[str, str],
    found: Found | None,
    problems: list[str],
    header_note: bool = False,
) -> Response:
    return _render(
        request,
        "search.html",
        status_code=400 if problems else 200,
        found=found,
        filters=fields,
        problems=problems,
        header_note=header_note,
        steps=[step.value for step in Step],
        paged=bool(request.query_params.get("before")),
        states=STATES,
        lanes=[lane.value for lane in Lane],
        labels=request.app.state.resources.settings.labels,
        query=lambda **changes: params.query(fields, **changes),
    )


def email(request: Request) -> Response:
    email_id = params.email_id(request)
    before = params.history_before(request.query_params)
    res = request.app.state.resources
    with res.db.reading() as session:
        detail = email_detail(session, email_id, before)
        state = job_state(res, session, email_id) if detail is not None else None
    if detail is None or state is None:
        raise HTTPException(404, f"no email with id {email_id}")
    return _render(request, "email.html", email=detail, state=state, steps=[s.value for s in Step])


def _render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
    user = request.user.username
    state = request.app.state
    return state.templates.TemplateResponse(
        request,
        name,
        {
            "user": user,
            "operator": ACT in request.auth.scopes,
            "csrf": csrf_token(state.secret, user),
            "notice": forms.notice(request.query_params),
            "nav": name.removesuffix(".html"),
            **context,
        },
        status_code=status_code,
    )
