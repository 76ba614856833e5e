"""The job status API: JSON for scripts and dashboards, read through `mailpipe.operations.status`
as the pages are. Its errors are JSON too (`errors.as_json`, given to its Mount)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mailpipe.operations.status import fleet_status, job_state
from mailpipe.web import params


def job(request: Request) -> Response:
    """`status.job_state` of one email: where its job is, its attempts, labels and history."""
    email_id = params.email_id(request)
    res = request.app.state.resources
    with res.db.session() as session:
        state = job_state(res, session, email_id)
    if state is None:
        raise HTTPException(404, f"no email with id {email_id}")
    return JSONResponse(state)


def queues(request: Request) -> Response:
    """What the overview shows: queues, workers, switches, runs by status."""
    return JSONResponse(fleet_status(request.app.state.resources))
