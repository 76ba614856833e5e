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
from dataclasses import asdict
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mailpipe.broker.queues import Stage
from mailpipe.enqueue import send_sweep, sender
from mailpipe.operations import actions
from mailpipe.operations.erasure import selection
from mailpipe.operations.search import BadSearch, EmailFilter
from mailpipe.web import params, verbs
from mailpipe.web.auth import ACT, acting

# An action's body is an object of values and of lists of ids, two levels; deeper is none of
# them, and far deeper (a body of brackets) would exhaust the parser's recursion.
MAX_DEPTH = 4
TOO_DEEP = f"the body is nested at most {MAX_DEPTH} levels deep"
# How the actions' audit lines name this face's users.
FACE = "api"


async def act_on_email(request: Request) -> Response:
    """POST /api/emails/{email_id}/{action}: one of `verbs.ON_EMAIL`; `lane` takes
    {"lane": ...}, `reprocess` {"from": ..., "lane": ...} (the bulk lane by default) and answers
    as POST /api/reprocess does, `forget` as POST /api/forget does."""
    email_id = params.email_id(request)
    action = request.path_params["action"]
    if action not in verbs.ON_EMAIL:
        raise HTTPException(404, f"no action {action!r}: one of {', '.join(verbs.ON_EMAIL)}")
    body = await _body(request)
    try:
        done = await verbs.act(request, action, email_id, params.Body(body), FACE)
    except (actions.Changed, actions.OverMax) as refused:
        return _refused(refused)
    if isinstance(done, actions.Reprocessed):
        return JSONResponse(_reprocessed(done))
    if isinstance(done, actions.Forgotten):
        return JSONResponse(asdict(done))
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
    filt, _ = params.searched({k: str(v) for k, v in body.items() if k not in REPROCESS_FIELDS})
    posted = params.Body(body)
    step, lane = verbs.reprocess_from(posted)
    res = request.app.state.resources
    if posted.count("expect") is None and not posted.flag("dry_run"):
        plan = await run_in_threadpool(verbs.plan_reprocess, res, filt, posted.count("as_of"))
        return _with_plan(409, "a reprocess takes its plan's count: give it as expect", plan)
    try:
        done = await run_in_threadpool(
            verbs.reprocess, res, filt, step, lane, posted, acting(request, FACE)
        )
    except (actions.Changed, actions.OverMax) as refused:
        return _refused(refused)
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


def _refused(refused: actions.Changed | actions.OverMax) -> Response:
    if isinstance(refused, actions.OverMax):
        return _with_plan(400, f"{refused}: over_max takes them", refused.plan)
    return _with_plan(409, str(refused), refused.plan)


def _with_plan(status: int, why: str, plan: actions.Reprocessed | actions.Counted) -> Response:
    """A refusal with the plan as it is now, to look at and confirm instead."""
    assert isinstance(plan, actions.Reprocessed)
    return JSONResponse({"error": why, "plan": _reprocessed(plan)}, status)


async def forget(request: Request) -> Response:
    """POST /api/forget: {"email_ids": [...]}, {"message_id": ...}, {"sender": ...} (a whole
    address) or {"mailbox": ...}, one of them, erased everywhere; with {"dry_run": true}, what
    it would delete."""
    body = await _body(request)
    chosen_by = ("message_id", "sender", "mailbox")
    unknown = sorted(set(body) - {"email_ids", *chosen_by, "dry_run"})
    if unknown:
        raise HTTPException(400, f"unknown field {', '.join(unknown)}")
    if any(not isinstance(body.get(name, ""), str) for name in chosen_by):
        raise HTTPException(400, f"{', '.join(chosen_by)} are text")
    email_ids = body.get("email_ids")
    if email_ids is None:
        try:
            filt = selection(*(body.get(name) for name in chosen_by))
        except BadSearch as exc:
            raise HTTPException(400, f"{exc}, or email_ids") from None
        return await _forget(request, body, None, filt)
    if any(name in body for name in chosen_by):
        raise HTTPException(400, "email_ids, message_id, sender or mailbox: one of them")
    if not isinstance(email_ids, list) or not all(
        type(i) is int and 1 <= i <= params.MAX_ID for i in email_ids
    ):
        raise HTTPException(400, "email_ids is a list of email ids")
    return await _forget(request, body, email_ids, None)


async def _forget(
    request: Request, body: dict[str, Any], email_ids: list[int] | None, filt: EmailFilter | None
) -> Response:
    res = request.app.state.resources
    done = await run_in_threadpool(
        lambda: actions.forget(
            res,
            email_ids,
            filt,
            enqueue=sender(res),
            user=acting(request, FACE),
            dry_run=params.Body(body).flag("dry_run"),
        )
    )
    return JSONResponse(asdict(done))


async def pause_or_resume(request: Request) -> Response:
    """POST /api/stages/{stage}/pause ({"reason": ...}) or /resume."""
    stage = Stage(_path_choice(request, "stage", Stage))
    do = _path_choice(request, "do", ("pause", "resume"))
    body = await _body(request)
    res, who = request.app.state.resources, acting(request, FACE)
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
        user=acting(request, FACE),
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
