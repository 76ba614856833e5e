"""The console's routes and what wraps them (docs/console.md).

Each room is a module: `pages` (HTML), `forms` (the actions the pages' forms post), `api` (JSON),
`api_actions` (its actions), `verbs` (the acts on one email, for both faces), `params` (what a
request carries, checked), `errors` (how a refusal is answered), `searching` (the search's slots
and connections). Reads go through `mailpipe.operations.status`, in sessions
given up past the web role's statement timeout (`Resources.for_web`), and actions through
`mailpipe.operations.actions`, the code the CLI runs. The API and the console are Mounts of their
own, so that each signs in and answers its errors in its own format. Everything a handler uses
is in `app.state`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.authentication import AuthenticationBackend
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.web import api, api_actions, errors, forms, pages
from mailpipe.web.auth import BasicAuth, TokenOrBasicAuth, accounts, secret_of, tokens
from mailpipe.web.searching import SearchSlots

access_log = logging.getLogger("mailpipe.web.access")

# Never framed (clickjacking an operator's button), nothing from elsewhere, no inline style or
# script: should an email's text ever reach a page unescaped, the browser would run none of it.
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'self'; script-src 'self'; "
        b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


async def healthz(request: Request) -> Response:
    """No sign-in, no database, no thread: the process's event loop answers, whatever the pages
    and the sign-in's hash checks hold of the thread pool."""
    return PlainTextResponse("ok")


# The pages and their forms' actions, and /healthz: sign-in refused in text, as their errors.
CONSOLE = [
    Route("/healthz", healthz, name="healthz"),  # signs in nowhere (auth.OPEN_PATHS)
    Route("/", pages.overview, name="overview"),
    Route("/model-calls", forms.switch_model_calls, methods=["POST"], name="switch_model_calls"),
    Route("/stages", forms.pause_or_resume, methods=["POST"], name="pause_or_resume"),
    Route("/failed", pages.Failed, name="failed"),  # the list (GET) and its actions (POST)
    Route("/failed/confirm", pages.confirm_failed, name="confirm_failed"),
    Route("/review", pages.Review, name="review"),
    Route("/review/confirm", pages.confirm_review, name="confirm_review"),
    Route("/search", pages.search, name="search"),
    Route("/emails/{email_id}", pages.email, name="email"),
    Route("/emails/{email_id}/act", forms.act_on_email, methods=["POST"], name="act_on_email"),
    Route("/reprocess", pages.Reprocess, name="reprocess"),  # its plan (GET), taken (POST)
    Mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static"),
]
# Under /api/ (route names "api:job", "api:queues"): sign-in refused in JSON, as its errors.
API = [
    Route("/openapi.yaml", api.openapi, name="openapi"),
    Route("/jobs/{email_id}", api.job, name="job"),
    Route("/queues", api.queues, name="queues"),
    Route("/activity", api.activity, name="activity"),
    Route("/search", api.search, name="search"),
    Route("/failed", api.failed, name="failed"),
    Route("/review", api.review, name="review"),
    Route(
        "/emails/{email_id}/{action}",
        api_actions.act_on_email,
        methods=["POST"],
        name="act_on_email",
    ),
    Route("/reprocess", api_actions.reprocess, methods=["POST"], name="reprocess"),
    Route("/forget", api_actions.forget, methods=["POST"], name="forget"),
    Route(
        "/stages/{stage}/{do}",
        api_actions.pause_or_resume,
        methods=["POST"],
        name="pause_or_resume",
    ),
    Route("/model-calls", api_actions.switch_model_calls, methods=["PUT"], name="model_calls"),
]


def create_app(settings: Settings) -> Starlette:
    secret = secret_of(settings)
    sign_in = BasicAuth(accounts(settings), secret)
    api_sign_in = TokenOrBasicAuth(sign_in, tokens(settings))
    app = Starlette(
        routes=[
            Mount(
                "/api", routes=API, name="api", middleware=_answered(errors.as_json, api_sign_in)
            ),
            Mount("", routes=CONSOLE, middleware=_answered(errors.as_text, sign_in)),
        ],
        middleware=[
            Middleware(AccessLog),
            Middleware(SecurityHeaders),
            *_loopback_names_only(settings),
        ],
        lifespan=_closing,
    )
    app.state.resources = Resources.for_web(settings)
    app.state.search_slots = SearchSlots(settings.web_searches, settings.web_searches_per_user)
    app.state.templates = pages.templates()
    app.state.secret = secret
    return app


def _answered(answer: errors.Answer, sign_in: AuthenticationBackend) -> list[Middleware]:
    """Sign-in first, then the routes; a refusal or a failure of either, a read the database
    gave up among them, answered by `answer`."""
    handlers = {HTTPException: errors.http_error(answer), Exception: errors.server_error(answer)}
    return [
        Middleware(ExceptionMiddleware, handlers=handlers),
        Middleware(AuthenticationMiddleware, backend=sign_in, on_error=errors.unauthorized(answer)),
    ]


def _loopback_names_only(settings: Settings) -> list[Middleware]:
    """Open on loopback (no users), the console answers only requests made to a loopback name:
    a page of another site whose name it points at 127.0.0.1 (DNS rebinding) would otherwise
    read it, CSRF token included, as its own."""
    if accounts(settings):
        return []
    return [Middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "[::1]"])]


@asynccontextmanager
async def _closing(app: Starlette) -> AsyncIterator[None]:
    """The app's connections are its own: closed when the server stops."""
    yield
    app.state.resources.close()


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class AccessLog:
    """One line per request, as uvicorn's access log writes it but with the path alone: a query
    string holds what a search was for (a sender, a subject), which no log may keep. uvicorn's
    own access log, which writes the query string, is off (`mailpipe.web.server.serve`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers when the app raises before it answers

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            client = scope.get("client")
            access_log.info(
                '%s - "%s %s HTTP/%s" %d',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                scope.get("root_path", "") + scope["path"],
                scope["http_version"],
                status,
            )
