"""The console's pages, its actions and the job status API, on Starlette (docs/operations.md,
"The console").

Reads go through `mailpipe.operations.status` and actions through `mailpipe.operations.actions`,
the code the CLI runs. Pages are sync endpoints: Starlette runs them on its thread pool, where
they may block on the database and Redis. An action is an async endpoint only for reading its
form; its work runs on the thread pool too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.authentication import AuthenticationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mailpipe.broker.queues import Lane, Stage
from mailpipe.coordination import pauses
from mailpipe.enqueue import sender
from mailpipe.operations import actions
from mailpipe.operations.status import (
    FailedFilter,
    email_detail,
    error_classes,
    failed_page,
    fleet_status,
    job_state,
    review_page,
)
from mailpipe.resources import Resources, get_resources
from mailpipe.settings import Settings
from mailpipe.web.auth import ACT, BasicAuth, accounts, csrf_token, csrf_valid, secret_of

log = logging.getLogger("mailpipe.web")

PER_PAGE = 50
# How many email ids an action's log line names; the count is always there.
LOGGED_IDS = 200
# What an action's result says, by the name it comes back under; anything else shows nothing.
ACTIONS = {
    "retry": "retried",
    "dismiss": "dismissed",
    "clear": "review mark cleared",
}
# Never framed (clickjacking an operator's button), no content from elsewhere; the few lines of
# script are inline.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


def create_app(settings: Settings) -> Starlette:
    secret = secret_of(settings)
    templates = Jinja2Templates(
        env=jinja2.Environment(
            loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
    )
    templates.env.globals["stages"] = [stage.value for stage in Stage]
    console = Console(templates, secret)
    return Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/", console.overview),
            Route("/model-calls", console.switch_model_calls, methods=["POST"]),
            Route("/stages", console.pause_or_resume, methods=["POST"]),
            Route("/failed", console.failed),
            Route("/failed", console.act_on_failed, methods=["POST"]),
            Route("/review", console.review),
            Route("/review", console.act_on_review, methods=["POST"]),
            Route("/emails/{email_id}", console.email),
            Route("/emails/{email_id}/lane", console.move_to_lane, methods=["POST"]),
            Route("/api/jobs/{email_id}", api_job),
            Route("/api/queues", api_queues),
        ],
        middleware=[
            Middleware(SecurityHeaders),
            *_loopback_names_only(settings),
            Middleware(
                AuthenticationMiddleware,
                backend=BasicAuth(accounts(settings), secret),
                on_error=unauthorized,
            ),
        ],
        exception_handlers={HTTPException: http_error},
    )


def _loopback_names_only(settings: Settings) -> list[Middleware]:
    """Open on loopback (no users), the console answers only requests made to a loopback name:
    a page of another site whose name it points at 127.0.0.1 (DNS rebinding) would otherwise
    read it, CSRF token included, as its own."""
    if accounts(settings):
        return []
    return [Middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "[::1]"])]


def healthz(request: Request) -> Response:
    """No sign-in, no database: the process answers."""
    return PlainTextResponse("ok")


class Console:
    """The pages and their actions; each page carries its user's CSRF token."""

    def __init__(self, templates: Jinja2Templates, secret: bytes) -> None:
        self.templates = templates
        self.secret = secret

    def page(self, request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        user = request.user.username
        return self.templates.TemplateResponse(
            request,
            name,
            {
                "user": user,
                "operator": ACT in request.auth.scopes,
                "csrf": csrf_token(self.secret, user),
                "notice": _notice(request.query_params),
                "nav": name.removesuffix(".html"),
                **context,
            },
            status_code=status_code,
        )

    # --- pages --------------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        return self.page(request, "overview.html", status=fleet_status(get_resources()))

    def failed(self, request: Request) -> Response:
        filt, problems = _failed_filter(request.query_params)
        page = _page_number(request.query_params)
        with get_resources().db.session() as session:
            listed = failed_page(session, filt, page, PER_PAGE)
            classes = error_classes(session)
        return self.page(
            request,
            "failed.html",
            status_code=400 if problems else 200,
            listed=listed,
            classes=classes,
            filters=_filter_fields(request.query_params),
            problems=problems,
            query=lambda **changes: _query(_filter_fields(request.query_params), **changes),
        )

    def review(self, request: Request) -> Response:
        page = _page_number(request.query_params)
        with get_resources().db.session() as session:
            listed = review_page(session, page, PER_PAGE)
        return self.page(request, "review.html", listed=listed, query=lambda **c: _query({}, **c))

    def email(self, request: Request) -> Response:
        email_id = _email_id(request)
        res = get_resources()
        with res.db.session() as session:
            detail = email_detail(session, email_id)
            state = job_state(res, session, email_id) if detail is not None else None
        if detail is None or state is None:
            raise HTTPException(404, f"no email with id {email_id}")
        return self.page(request, "email.html", email=detail, state=state)

    # --- actions ------------------------------------------------------------------------------

    async def switch_model_calls(self, request: Request) -> Response:
        form = await self.action_form(request)
        on = _choice(form, "state", ("on", "off")) == "on"
        await run_in_threadpool(_switch_model_calls, get_resources(), on)
        _log_action(request, f"model calls {'on' if on else 'off'}", [])
        return RedirectResponse("/", status_code=303)

    async def pause_or_resume(self, request: Request) -> Response:
        form = await self.action_form(request)
        stage = Stage(_choice(form, "stage", tuple(Stage)))
        redis = get_resources().redis
        if _choice(form, "do", ("pause", "resume")) == "pause":
            reason = str(form.get("reason") or "").strip() or "paused by an operator"
            await run_in_threadpool(pauses.pause, redis, stage, reason[:200])
            _log_action(request, f"pause {stage.value}", [])
        else:
            await run_in_threadpool(pauses.resume, redis, stage)
            _log_action(request, f"resume {stage.value}", [])
        return RedirectResponse("/", status_code=303)

    async def act_on_failed(self, request: Request) -> Response:
        form = await self.action_form(request)
        verb, scope = _choice(form, "do", _VERBS).split("-")
        fields = _filter_fields(form)
        filt, problems = _failed_filter(form)
        if problems:
            raise HTTPException(400, "; ".join(problems))
        user = request.user.username
        if scope == "matching":
            done = await run_in_threadpool(_act, verb, user, None, filt)
        else:
            done = await run_in_threadpool(_act, verb, user, _selected(form))
        _log_action(request, f"{verb} {scope} in the failed list", done.done, fields)
        return _back("/failed", fields, verb, done)

    async def act_on_review(self, request: Request) -> Response:
        form = await self.action_form(request)
        verb, scope = _choice(form, "do", (*_VERBS, "clear-selected", "clear-matching")).split("-")
        if scope == "matching":
            email_ids = await run_in_threadpool(_all_marked_for_review, get_resources())
        else:
            email_ids = _selected(form)
        done = await run_in_threadpool(_act, verb, request.user.username, email_ids)
        _log_action(request, f"{verb} {scope} in the review list", done.done)
        return _back("/review", {}, verb, done)

    async def move_to_lane(self, request: Request) -> Response:
        """As `mailpipe lane`: the email's next job goes in the lane chosen."""
        email_id = _email_id(request)
        form = await self.action_form(request)
        lane = Lane(_choice(form, "lane", tuple(Lane)))
        done = await run_in_threadpool(
            actions.move, get_resources(), [email_id], lane, user=f"web:{request.user.username}"
        )
        if not done.done:
            raise HTTPException(404, f"no email with id {email_id}")
        _log_action(request, f"move to {lane.value}", done.done)
        return RedirectResponse(f"/emails/{email_id}", status_code=303)

    async def action_form(self, request: Request) -> FormData:
        """The action's form, once its user is known to be an operator and its token right."""
        if ACT not in request.auth.scopes:
            raise HTTPException(403, "viewers read; only an operator can act")
        form = await request.form()
        token = form.get("csrf_token")
        if not isinstance(token, str) or not csrf_valid(self.secret, request.user.username, token):
            raise HTTPException(403, "the form's token is missing or wrong: reload the page")
        return form


# --- the JSON API ------------------------------------------------------------------------------


def api_job(request: Request) -> Response:
    """`status.job_state` of one email: where its job is, its attempts, labels and history."""
    email_id = _email_id(request)
    res = get_resources()
    with res.db.session() as session:
        state = job_state(res, session, email_id)
    if state is None:
        raise HTTPException(404, f"no email with id {email_id}")
    return JSONResponse(state)


def api_queues(request: Request) -> Response:
    """What the overview shows: queues, workers, switches, runs by status."""
    return JSONResponse(fleet_status(get_resources()))


# --- errors and headers ------------------------------------------------------------------------


def unauthorized(conn: HTTPConnection, exc: AuthenticationError) -> Response:
    headers = {"WWW-Authenticate": 'Basic realm="mailpipe", charset="UTF-8"'}
    return _error(conn, 401, str(exc), headers)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(request, exc.status_code, exc.detail, exc.headers)


def _error(
    conn: HTTPConnection, status: int, detail: str, headers: Mapping[str, str] | None = None
) -> Response:
    """JSON under /api/, a line of text elsewhere (the browser shows it as it is)."""
    if conn.url.path.startswith("/api/"):
        return JSONResponse({"error": detail}, status, headers=headers)
    return PlainTextResponse(f"{status}: {detail}\n", status, headers=headers)


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


# --- the parts ---------------------------------------------------------------------------------

_VERBS = ("retry-selected", "retry-matching", "dismiss-selected", "dismiss-matching")
_FILTERS = ("error_class", "stage", "since", "until")


def _switch_model_calls(res: Resources, on: bool) -> None:
    """As `mailpipe model-calls on|off`: the flag, then a sweep so that waiting runs go on now."""
    from mailpipe.storage import flags

    with res.db.transaction() as session:
        flags.set_model_calls(session, on)
    if on:
        from mailpipe.app.tasks import sweep

        sweep.apply_async()


def _act(
    verb: str, user: str, email_ids: list[int] | None, filt: FailedFilter | None = None
) -> actions.Done:
    """The action `verb` on `email_ids`, or on the failed runs `filt` matches when they are None;
    done by `user` as the operations' log names them."""
    if email_ids is not None and not email_ids:
        return actions.Done([])  # nothing selected: never "every failed run"
    res = get_resources()
    who = f"web:{user}"
    if verb == "retry":
        return actions.retry(res, email_ids, filt, enqueue=sender(res), user=who)
    if verb == "dismiss":
        return actions.dismiss(res, email_ids, filt, user=who)
    assert email_ids is not None
    return actions.clear_review(res, email_ids, user=who)


def _all_marked_for_review(res: Resources) -> list[int]:
    email_ids: list[int] = []
    page = 1
    with res.db.session() as session:
        while True:
            listed = review_page(session, page, 500)
            email_ids += [row["email_id"] for row in listed.rows]
            if page >= listed.pages:
                return email_ids
            page += 1


def _email_id(request: Request) -> int:
    text = request.path_params["email_id"]
    try:
        return int(text)
    except ValueError:
        raise HTTPException(400, "an email id is a whole number") from None


def _page_number(params: Mapping[str, str]) -> int:
    try:
        return max(1, int(params.get("page") or 1))
    except ValueError:
        raise HTTPException(400, "page is a whole number") from None


def _filter_fields(params: Mapping[str, Any]) -> dict[str, str]:
    """The failed list's filters as the form and the links carry them."""
    return {name: str(params.get(name) or "").strip() for name in _FILTERS}


def _failed_filter(params: Mapping[str, Any]) -> tuple[FailedFilter, list[str]]:
    """The FailedFilter of the query or form, and what in it could not be read."""
    fields = _filter_fields(params)
    problems = []
    stage = None
    if fields["stage"]:
        try:
            stage = Stage(fields["stage"])
        except ValueError:
            problems.append("stage is cpu or model")
    times: dict[str, datetime | None] = {}
    for name in ("since", "until"):
        try:
            times[name] = datetime.fromisoformat(fields[name]) if fields[name] else None
        except ValueError:
            problems.append(f"{name} is a date and time, as 2025-01-31T14:00 (UTC)")
            times[name] = None
        if times[name] is not None and times[name].tzinfo is not None:  # type: ignore[union-attr]
            problems.append(f"{name} is UTC, without an offset")
            times[name] = None
    filt = FailedFilter(
        error_class=fields["error_class"] or None,
        stage=stage,
        since=times["since"],
        until=times["until"],
    )
    return filt, problems


def _choice(form: FormData, name: str, allowed: Sequence[str]) -> str:
    value = form.get(name)
    if value not in allowed:
        raise HTTPException(400, f"{name} is one of {', '.join(allowed)}")
    return str(value)


def _selected(form: FormData) -> list[int]:
    try:
        return [int(str(value)) for value in form.getlist("email_id")]
    except ValueError:
        raise HTTPException(400, "an email id is a whole number") from None


def _query(fields: Mapping[str, str], **changes: Any) -> str:
    """A list's query string: its filters (the empty ones left out) and `changes`."""
    merged = {**fields, **{key: str(value) for key, value in changes.items()}}
    return urlencode({key: value for key, value in merged.items() if value})


def _notice(params: Mapping[str, str]) -> str | None:
    """An action's result, as the redirect after it carries it: counts, never text."""
    verb = ACTIONS.get(params.get("action", ""))
    if verb is None:
        return None
    try:
        done, enqueued, refused = (int(params.get(key, "0")) for key in _COUNTS)
    except ValueError:
        return None
    parts = [f"{done} {verb}"]
    if params.get("action") == "retry":
        parts.append(f"{enqueued} jobs sent")
    if refused:
        parts.append(f"{refused} refused (not in a state for it)")
    return ", ".join(parts)


_COUNTS = ("done", "enqueued", "refused")


def _back(path: str, fields: Mapping[str, str], verb: str, done: actions.Done) -> Response:
    counts = {"done": len(done.done), "enqueued": done.enqueued, "refused": len(done.refused)}
    return RedirectResponse(f"{path}?{_query(fields, action=verb, **counts)}", status_code=303)


def _log_action(
    request: Request,
    action: str,
    email_ids: Sequence[int],
    filters: Mapping[str, str] | None = None,
) -> None:
    named = list(email_ids[:LOGGED_IDS])
    more = f" and {len(email_ids) - LOGGED_IDS} more" if len(email_ids) > LOGGED_IDS else ""
    shown = {key: value for key, value in (filters or {}).items() if value}
    log.info(
        "%s: %s, %d emails %s%s%s",
        request.user.username,
        action,
        len(email_ids),
        named,
        more,
        f" (filters {shown})" if shown else "",
        extra={"user": request.user.username, "action": action, "email_ids": named},
    )
