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
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from mailpipe.broker.queues import Stage
from mailpipe.operations.status import (
    email_detail,
    error_classes,
    failed_page,
    fleet_status,
    job_state,
    review_page,
)
from mailpipe.web import forms, params
from mailpipe.web.auth import ACT, csrf_token

PER_PAGE = 50


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
    return _render(
        request, "overview.html", status=fleet_status(request.app.state.resources, estimates=True)
    )


def failed(request: Request) -> Response:
    filt, problems = params.failed_filter(request.query_params)
    fields = params.filter_fields(request.query_params)
    page = params.page_number(request.query_params)
    with request.app.state.resources.db.session() as session:
        listed = failed_page(session, filt, page, PER_PAGE)
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
    with request.app.state.resources.db.session() as session:
        listed = review_page(session, page, PER_PAGE)
    return _render(request, "review.html", listed=listed, query=lambda **c: params.query({}, **c))


def email(request: Request) -> Response:
    email_id = params.email_id(request)
    res = request.app.state.resources
    with res.db.session() as session:
        detail = email_detail(session, email_id)
        state = job_state(res, session, email_id) if detail is not None else None
    if detail is None or state is None:
        raise HTTPException(404, f"no email with id {email_id}")
    return _render(request, "email.html", email=detail, state=state)


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
