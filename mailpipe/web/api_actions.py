"""The write API: what an operator does from the console, for machines. Each action is a POST
(or a PUT for the switch) with a JSON body, done through `mailpipe.operations.actions` as the
pages' forms and the CLI do it, and answered with what it did as JSON.

A JSON body is the API's defence against a forged request: a page of another site can post a
form or plain text to the console with the browser's stored credentials, but not
`application/json` without the console's consent (CORS), which it never gives. So the API needs
no CSRF token; a body of any other type is refused (415).

A body is read by `_body` alone, within bounds: at most `MAILPIPE_API_BODY_MAX_BYTES` (413 past
it, before it is read whole) and nested at most MAX_DEPTH levels (400).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mailpipe.broker.queues import Lane, Stage
from mailpipe.enqueue import send_sweep, sender
from mailpipe.operations import actions
from mailpipe.operations.erasure import selection
from mailpipe.operations.search import BadSearch, EmailFilter, read_search
from mailpipe.web import params
from mailpipe.web.auth import ACT

# The actions on one email, by the last part of their path.
EMAIL_ACTIONS = ("retry", "dismiss", "undo-dismiss", "clear-review", "lane", "reprocess", "forget")
# An action's body is an object of values and of lists of ids, two levels; deeper is none of
# them, and far deeper (a body of brackets) would exhaust the parser's recursion.
MAX_DEPTH = 4
TOO_DEEP = f"the body is nested at most {MAX_DEPTH} levels deep"


async def act_on_email(request: Request) -> Response:
    """POST /api/emails/{email_id}/{action}: one of EMAIL_ACTIONS; `lane` takes {"lane": ...},
    `reprocess` {"from": ..., "lane": ...} (the bulk lane by default), `forget` answers as POST
    /api/forget does."""
    email_id = params.email_id(request)
    action = request.path_params["action"]
    if action not in EMAIL_ACTIONS:
        raise HTTPException(404, f"no action {action!r}: one of {', '.join(EMAIL_ACTIONS)}")
    body = await _body(request)
    res, who = request.app.state.resources, _who(request)
    ids = [email_id]
    if action == "retry":
        done = await run_in_threadpool(actions.retry, res, ids, enqueue=sender(res), user=who)
    elif action == "dismiss":
        done = await run_in_threadpool(actions.dismiss, res, ids, user=who)
    elif action == "undo-dismiss":
        done = await run_in_threadpool(actions.undo_dismiss, res, ids, user=who)
    elif action == "clear-review":
        done = await run_in_threadpool(actions.clear_review, res, ids, user=who)
    elif action == "lane":
        lane = params.choice(body, "lane", Lane)
        done = await run_in_threadpool(actions.move, res, ids, Lane(lane), user=who)
    elif action == "forget":
        return await _forget(request, body, ids, None)
    else:
        return await _reprocess(request, body, EmailFilter(email_id=email_id))
    return JSONResponse({"done": done.done, "enqueued": done.enqueued, "refused": done.refused})


# What POST /api/reprocess takes beside the search's fields.
REPROCESS_FIELDS = ("from", "lane", "dry_run", "expect", "as_of", "over_max")


async def reprocess(request: Request) -> Response:
    """POST /api/reprocess: the emails the search's fields find ({"label": "invoice", ...}, as
    GET /api/search takes them), from {"from": ...}, in {"lane": ...} (bulk by default). With
    {"dry_run": true}, its plan: how many it would take, the model calls that costs, and
    `as_of`. Without, it takes them only with the plan's count echoed ({"expect": N}, and its
    `as_of`), or answers 409 with the plan as it is now; past MAILPIPE_REPROCESS_MAX, only with
    {"over_max": true}."""
    body = await _body(request)
    fields = {k: str(v) for k, v in body.items() if k not in REPROCESS_FIELDS}
    try:
        filt, _ = read_search(fields)
    except BadSearch as exc:
        raise HTTPException(400, str(exc)) from None
    return await _reprocess(request, body, filt, planned=True)


async def _reprocess(
    request: Request, body: dict[str, Any], filt: EmailFilter, *, planned: bool = False
) -> Response:
    """A reprocess; `planned`: only of the count its plan gave, echoed as `expect` (one email's
    own needs none)."""
    step = actions.Step(params.choice(body, "from", actions.Step))
    lane = Lane(params.choice({"lane": Lane.BULK.value, **body}, "lane", Lane))
    dry_run, over_max = _flag(body, "dry_run"), _flag(body, "over_max")
    expect, as_of = _count(body, "expect"), _count(body, "as_of")
    res = request.app.state.resources
    try:
        if dry_run:
            plan = await run_in_threadpool(actions.plan_reprocess, res, filt, as_of=as_of)
            return JSONResponse(_reprocessed(plan))
        if planned and expect is None:
            plan = await run_in_threadpool(actions.plan_reprocess, res, filt, as_of=as_of)
            return _refused(409, "a reprocess takes its plan's count: give it as expect", plan)
        done = await run_in_threadpool(
            lambda: actions.reprocess(
                res,
                filt,
                step,
                lane=lane,
                enqueue=sender(res),
                user=_who(request),
                expect=expect,
                as_of=as_of,
                over_max=over_max,
            )
        )
    except actions.NotAFilter as refused:
        raise HTTPException(400, str(refused)) from None
    except actions.OverMax as refused:
        return _refused(400, f"{refused}: over_max takes them", refused.plan)
    except actions.Changed as refused:
        return _refused(409, str(refused), refused.plan)
    return JSONResponse(_reprocessed(done))


def _reprocessed(done: actions.Reprocessed) -> dict[str, Any]:
    return {
        "emails": done.emails,
        "model_calls": done.model_calls,
        "reprocess_id": done.reprocess_id,
        "enqueued": done.enqueued,
        "taken": done.taken,
        "as_of": done.as_of,
        "max": done.most,
    }


def _refused(status: int, why: str, plan: actions.Reprocessed | actions.Counted) -> Response:
    """A refusal with the plan as it is now, to look at and confirm instead."""
    assert isinstance(plan, actions.Reprocessed)
    return JSONResponse({"error": why, "plan": _reprocessed(plan)}, status)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise HTTPException(400, f"{name} is true or false")
    return value


def _count(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= params.MAX_ID:
        raise HTTPException(400, f"{name} is a whole number from 0 to {params.MAX_ID}")
    return value


async def forget(request: Request) -> Response:
    """POST /api/forget: {"email_ids": [...]}, {"message_id": ...} or {"sender": ...} (a whole
    address), one of them, erased everywhere; with {"dry_run": true}, what it would delete."""
    body = await _body(request)
    unknown = sorted(set(body) - {"email_ids", "message_id", "sender", "dry_run"})
    if unknown:
        raise HTTPException(400, f"unknown field {', '.join(unknown)}")
    email_ids = body.get("email_ids")
    if email_ids is None:
        try:
            filt = selection(body.get("message_id"), body.get("sender"))
        except BadSearch as exc:
            raise HTTPException(400, f"{exc}, or email_ids") from None
        return await _forget(request, body, None, filt)
    if "message_id" in body or "sender" in body:
        raise HTTPException(400, "email_ids, message_id or sender: one of them")
    if not isinstance(email_ids, list) or not all(
        type(i) is int and 1 <= i <= params.MAX_ID for i in email_ids
    ):
        raise HTTPException(400, "email_ids is a list of email ids")
    return await _forget(request, body, email_ids, None)


async def _forget(
    request: Request, body: dict[str, Any], email_ids: list[int] | None, filt: EmailFilter | None
) -> Response:
    dry_run = _flag(body, "dry_run")
    res = request.app.state.resources
    done = await run_in_threadpool(
        lambda: actions.forget(
            res, email_ids, filt, enqueue=sender(res), user=_who(request), dry_run=dry_run
        )
    )
    return JSONResponse(
        {
            "email_ids": done.email_ids,
            "rows": done.rows,
            "blobs": done.blobs,
            "redis": done.redis,
            "handed_on": done.handed_on,
            "completed": done.completed,
            "enqueued": done.enqueued,
            "refused": done.refused,
            "dry_run": done.dry_run,
        }
    )


async def pause_or_resume(request: Request) -> Response:
    """POST /api/stages/{stage}/pause ({"reason": ...}) or /resume."""
    stage = Stage(_path_choice(request, "stage", Stage))
    do = _path_choice(request, "do", ("pause", "resume"))
    body = await _body(request)
    res, who = request.app.state.resources, _who(request)
    if do == "pause":
        reason = str(body.get("reason") or "paused by an operator")[:200]
        held = await run_in_threadpool(actions.pause, res, stage, reason, user=who)
        return JSONResponse({"stage": stage.value, "paused": True, "by": held.by})
    ended = await run_in_threadpool(actions.resume, res, stage, user=who)
    return JSONResponse({"stage": stage.value, "paused": False, "was_paused": ended})


async def switch_model_calls(request: Request) -> Response:
    """PUT /api/model-calls {"on": true|false}; on sends a sweep, as the overview's switch does."""
    body = await _body(request)
    on = body.get("on")
    if not isinstance(on, bool):
        raise HTTPException(400, "on is true or false")
    await run_in_threadpool(
        actions.switch_model_calls,
        request.app.state.resources,
        on,
        send_sweep=send_sweep,
        user=_who(request),
    )
    return JSONResponse({"model_calls": on})


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object, once its caller is known to be an operator."""
    if ACT not in request.auth.scopes:
        raise HTTPException(403, "viewers read; only an operator can act")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "an action's body is JSON (Content-Type: application/json)")
    raw = await _bounded(request, request.app.state.resources.settings.api_body_max_bytes)
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise HTTPException(400, TOO_DEEP) from None
    except ValueError:
        raise HTTPException(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "the body is a JSON object")
    if _deeper_than(body, MAX_DEPTH):
        raise HTTPException(400, TOO_DEEP)
    return body


async def _bounded(request: Request, most: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to be longer than `most`
    bytes: by its Content-Length before a byte is read, else as it arrives (a chunked body
    declares none)."""
    too_long = f"the body is at most {most} bytes"
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit():
        # A length of thousands of digits is too long, and more than int() will read.
        if len(declared.lstrip("0")) > len(str(most)) or int(declared) > most:
            raise HTTPException(413, too_long)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > most:
            raise HTTPException(413, too_long)
        chunks.append(chunk)
    return b"".join(chunks)


def _deeper_than(value: Any, most: int) -> bool:
    """Whether parsed JSON nests objects and arrays more than `most` levels deep, read a level
    at a time (no recursion)."""
    level = [value]
    for _ in range(most):
        level = [
            child
            for item in level
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
        ]
    return any(isinstance(item, dict | list) for item in level)


def _path_choice(request: Request, name: str, allowed: Any) -> str:
    value = request.path_params[name]
    if value not in tuple(allowed):
        raise HTTPException(404, f"{name} is one of {', '.join(allowed)}")
    return str(value)


def _who(request: Request) -> str:
    return f"api:{request.user.username}"
