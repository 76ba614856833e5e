"""How a refusal or an error is answered: the pages with a line of text, which the browser shows as
it is, the API with JSON. `app.create_app` gives each Mount the one it answers in."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping

from starlette.authentication import AuthenticationError
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mailpipe.errors import is_statement_timeout
from mailpipe.web.auth import SignInRefused

log = logging.getLogger("mailpipe.web")

Answer = Callable[[int, str, Mapping[str, str] | None], Response]

CHALLENGE = {"WWW-Authenticate": 'Basic realm="mailpipe", charset="UTF-8"'}


def as_text(status: int, detail: str, headers: Mapping[str, str] | None) -> Response:
    return PlainTextResponse(f"{status}: {detail}\n", status, headers=headers)


def as_json(status: int, detail: str, headers: Mapping[str, str] | None) -> Response:
    return JSONResponse({"error": detail}, status, headers=headers)


def unauthorized(answer: Answer) -> Callable[[HTTPConnection, AuthenticationError], Response]:
    """AuthenticationMiddleware's `on_error`: a 401 with the basic-auth challenge, or the 429 or
    503 of a sign-in refused before its password was checked, with when to try again."""

    def refuse(conn: HTTPConnection, exc: AuthenticationError) -> Response:
        if isinstance(exc, SignInRefused):
            return answer(exc.status, str(exc), {"Retry-After": str(exc.retry_after)})
        return answer(401, str(exc), CHALLENGE)

    return refuse


def http_error(answer: Answer) -> Callable[[Request, Exception], Awaitable[Response]]:
    """The handler of the HTTPExceptions a route raises (Starlette's 404 and 405 among them)."""

    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return answer(exc.status_code, exc.detail, exc.headers)

    return handle


def server_error(answer: Answer) -> Callable[[Request, Exception], Awaitable[Response]]:
    """The handler of any other exception, in the Mount's format, which passes through the app's
    middleware (its security headers) as every answer does, where Starlette's own last resort
    would answer in bare text from outside them. A read given up past the web role's statement
    timeout is a 503 that says so, with Retry-After (the database may be busy, or the search too
    wide); anything else a 500, its traceback in the log in `errors.describe`'s words (the
    console's log, `app.logs.to_stderr`)."""

    async def handle(request: Request, exc: Exception) -> Response:
        if is_statement_timeout(exc):
            limit_ms = request.app.state.resources.settings.web_statement_timeout_ms
            # The path alone: a query string may hold what an operator searched for.
            log.warning(
                "%s gave up a read at %d ms (statement timeout)", request.url.path, limit_ms
            )
            return answer(
                503,
                f"the database did not answer within {limit_ms} ms "
                "(MAILPIPE_WEB_STATEMENT_TIMEOUT_MS): try again, or narrow the search",
                {"Retry-After": str(max(1, math.ceil(limit_ms / 1000)))},
            )
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return answer(500, "internal error: the console's log has its traceback", None)

    return handle
