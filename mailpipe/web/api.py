"""The job status API: JSON for scripts and dashboards, read through `mailpipe.operations.status`
as the pages are. Its errors are JSON too (`errors.as_json`, given to its Mount)."""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mailpipe.operations.activity import fleet_activity
from mailpipe.operations.status import failed_page, fleet_status, job_state, review_page
from mailpipe.web import params, searching


def job(request: Request) -> Response:
    """`status.job_state` of one email: where its job is, its attempts, labels and its last 50
    attempts (`?history_before=` its `older_history` for those before)."""
    email_id = params.email_id(request)
    before = params.history_before(request.query_params)
    res = request.app.state.resources
    with res.db.reading() as session:
        state = job_state(res, session, email_id, before)
    if state is None:
        raise HTTPException(404, f"no email with id {email_id}")
    return JSONResponse(state)


def queues(request: Request) -> Response:
    """What the overview shows: queues, workers, switches, runs by status."""
    return JSONResponse(fleet_status(request.app.state.resources))


def activity(request: Request) -> Response:
    """What the overview's charts draw (`activity.Activity.as_json`): `?window=hour` (a bucket a
    minute, the default) or `day` (a bucket a quarter hour)."""
    window = params.window(request.query_params)
    with request.app.state.resources.db.reading() as session:
        return JSONResponse(fleet_activity(session, window).as_json())


def search(request: Request) -> Response:
    """The search page's emails, a page of 50 at a time: `rows`, newest first, and `next_before`,
    the `before` of the next page (null on the last)."""
    filt, before = params.searched(request.query_params)
    return JSONResponse(searching.found(request, filt, before).as_json())


def failed(request: Request) -> Response:
    """The failed list, as `mailpipe failed --json`: `?error_class`, `stage`, `since`, `until`,
    `view=dismissed`, `page` (50 a page)."""
    filt = params.failed_filter(request.query_params)
    page = params.page_number(request.query_params)
    with request.app.state.resources.db.reading() as session:
        return JSONResponse(failed_page(session, filt, page).as_json())


def review(request: Request) -> Response:
    """The review list, as `mailpipe review --json`: `?page` (50 a page)."""
    page = params.page_number(request.query_params)
    with request.app.state.resources.db.reading() as session:
        return JSONResponse(review_page(session, page).as_json())


# The API's description (OpenAPI 3.1), shipped with the package; a test holds it to the routes.
OPENAPI = Path(__file__).with_name("openapi.yaml")


def openapi(request: Request) -> Response:
    return PlainTextResponse(OPENAPI.read_text(), media_type="application/yaml")
