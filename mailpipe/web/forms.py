"""The console's actions, each a form an operator posts: checked (an operator's, with the form's
CSRF token, fields read), done through `mailpipe.operations.actions` as the CLI does it, which
writes its one audit line with its user (`web:` and the name), and answered by a redirect to
the page it came from, which shows its counts.

An action is an async endpoint only for reading its form; its work runs on the thread pool, where
it may block on the database and Redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from mailpipe.broker.queues import Lane, Stage
from mailpipe.enqueue import send_sweep, sender
from mailpipe.operations import actions
from mailpipe.operations.search import FIELDS, BadSearch, failed_fields, read_failed, read_search
from mailpipe.operations.status import FailedFilter
from mailpipe.resources import Resources
from mailpipe.web import params
from mailpipe.web.auth import ACT, csrf_refusal

# What an action's result says, by the name it comes back under; anything else shows nothing.
ACTIONS = {
    "retry": "retried",
    "dismiss": "dismissed",
    "undo": "back on the failed list",
    "undo-dismiss": "back on the failed list",
    "clear": "review mark cleared",
    "clear-review": "review mark cleared",
    "reprocess": "reprocessed",
    "forget": "forgotten",
}
_VERBS = (
    "retry-selected",
    "retry-matching",
    "dismiss-selected",
    "dismiss-matching",
    "undo-selected",
)
_COUNTS = ("done", "enqueued", "refused")
# What the redirect after an action adds to a page's query, for its notice alone.
NOTICE_KEYS = ("action", *_COUNTS)


async def switch_model_calls(request: Request) -> Response:
    form = await _action_form(request)
    on = params.choice(form, "state", ("on", "off")) == "on"
    await run_in_threadpool(
        actions.switch_model_calls,
        request.app.state.resources,
        on,
        send_sweep=send_sweep,
        user=_who(request),
    )
    return RedirectResponse(request.app.url_path_for("overview"), status_code=303)


async def pause_or_resume(request: Request) -> Response:
    form = await _action_form(request)
    stage = Stage(params.choice(form, "stage", tuple(Stage)))
    res = request.app.state.resources
    if params.choice(form, "do", ("pause", "resume")) == "pause":
        reason = str(form.get("reason") or "").strip() or "paused by an operator"
        await run_in_threadpool(actions.pause, res, stage, reason[:200], user=_who(request))
    else:
        await run_in_threadpool(actions.resume, res, stage, user=_who(request))
    return RedirectResponse(request.app.url_path_for("overview"), status_code=303)


async def act_on_failed(request: Request) -> Response:
    """The failed list's actions: on the ticked runs at once; on every run the filters match
    only with the count its confirmation page showed (`expect`), or to that page."""
    form = await _action_form(request)
    verb, scope = params.choice(form, "do", _VERBS).split("-")
    try:
        filt = read_failed(params.filter_fields(form))
    except BadSearch as exc:
        raise HTTPException(400, str(exc)) from None
    fields = failed_fields(filt)
    res, user = request.app.state.resources, request.user.username
    if scope == "selected":
        done = await run_in_threadpool(_act, res, verb, user, _selected(form))
    else:
        expect = params.count(form, "expect")
        confirm = request.app.url_path_for("confirm_failed")
        if expect is None:
            return _to(confirm, fields, do=verb)
        try:
            done = await run_in_threadpool(_act, res, verb, user, None, filt, expect)
        except actions.Changed:
            return _to(confirm, fields, do=verb, changed=expect)
    return _back(request, "failed", fields, verb, done)


async def act_on_review(request: Request) -> Response:
    """The review list's actions: on the ticked emails at once; on all of them only with the
    count its confirmation page showed (`expect`), or to that page."""
    form = await _action_form(request)
    verb, scope = params.choice(form, "do", (*_VERBS, "clear-selected", "clear-matching")).split(
        "-"
    )
    res = request.app.state.resources
    if scope == "selected":
        email_ids, expect = _selected(form), None
    else:
        expect = params.count(form, "expect")
        if expect is None:
            return _to(request.app.url_path_for("confirm_review"), {}, do=verb)
        email_ids = await run_in_threadpool(actions.marked, res)
    try:
        done = await run_in_threadpool(
            _act, res, verb, request.user.username, email_ids, None, expect
        )
    except actions.Changed:
        return _to(request.app.url_path_for("confirm_review"), {}, do=verb, changed=expect)
    return _back(request, "review", {}, verb, done)


async def move_to_lane(request: Request) -> Response:
    """As `mailpipe lane`: the email's next job goes in the lane chosen."""
    email_id = params.email_id(request)
    form = await _action_form(request)
    lane = Lane(params.choice(form, "lane", tuple(Lane)))
    done = await run_in_threadpool(
        actions.move,
        request.app.state.resources,
        [email_id],
        lane,
        user=f"web:{request.user.username}",
    )
    if not done.done:
        raise HTTPException(404, f"no email with id {email_id}")
    return RedirectResponse(request.app.url_path_for("email", email_id=email_id), status_code=303)


# What an email's page offers, by the form's `do`; each as its list pages and the CLI do it.
EMAIL_ACTIONS = ("retry", "dismiss", "undo-dismiss", "clear-review", "reprocess", "forget")


async def act_on_email(request: Request) -> Response:
    """One of EMAIL_ACTIONS on the email whose page posted it; back to that page, with what it
    did."""
    email_id = params.email_id(request)
    form = await _action_form(request)
    verb = params.choice(form, "do", EMAIL_ACTIONS)
    res, who = request.app.state.resources, _who(request)
    if verb == "forget":
        return await _forget_one(request, form, email_id)
    if verb == "reprocess":
        step = actions.Step(params.choice(form, "from", tuple(actions.Step)))
        lane = Lane(params.choice(form, "lane", tuple(Lane)))
        done = await run_in_threadpool(_reprocess_one, res, email_id, step, lane, who)
    elif verb == "undo-dismiss":
        done = await run_in_threadpool(actions.undo_dismiss, res, [email_id], user=who)
    elif verb == "clear-review":
        done = await run_in_threadpool(actions.clear_review, res, [email_id], user=who)
    else:
        done = await run_in_threadpool(_act, res, verb, request.user.username, [email_id])
    counts = {"done": len(done.done), "enqueued": done.enqueued, "refused": len(done.refused)}
    path = request.app.url_path_for("email", email_id=email_id)
    return RedirectResponse(f"{path}?{params.query({}, action=verb, **counts)}", status_code=303)


async def _forget_one(request: Request, form: FormData, email_id: int) -> Response:
    """The email page's forget, only with its box ticked (the CLI asks before it forgets too);
    to the search, since the email's page is gone with it."""
    if form.get("confirm") != "yes":
        raise HTTPException(400, "forgetting an email cannot be undone: tick the box to confirm")
    res = request.app.state.resources
    done = await run_in_threadpool(
        lambda: actions.forget(res, [email_id], enqueue=sender(res), user=_who(request))
    )
    if not done.email_ids:
        raise HTTPException(404, f"no email with id {email_id}")
    path = request.app.url_path_for("search")
    return RedirectResponse(f"{path}?{params.query({}, action='forget', done=1)}", 303)


async def reprocess_matching(request: Request) -> Response:
    """The search's reprocess, as its plan page (`pages.reprocess_plan`) confirms it: the
    succeeded emails of its filter, from the step chosen, only with the plan's count (`expect`)
    and `as_of`, and past MAILPIPE_REPROCESS_MAX only with `over_max` ticked; else back to the
    plan page, as it is now. Then to the search, with what it did."""
    form = await _action_form(request)
    fields = {name: str(form.get(name) or "") for name in FIELDS}
    try:
        filt, _ = read_search(fields)
    except BadSearch as exc:
        raise HTTPException(400, str(exc)) from None
    step = actions.Step(params.choice(form, "from", tuple(actions.Step)))
    # `lane` is the search's filter; the jobs' lane is `in_lane`.
    lane = Lane(params.choice(form, "in_lane", tuple(Lane)))
    expect, as_of = params.count(form, "expect"), params.count(form, "as_of")
    plan_page = request.app.url_path_for("reprocess_plan")
    chosen = {**fields, "from": step.value, "in_lane": lane.value}
    if expect is None:
        return _to(plan_page, chosen)
    # Back to the plan as of its own `as_of`, should it be refused: what was taken since stays
    # left out.
    planned = {**chosen, "as_of": "" if as_of is None else str(as_of)}
    res = request.app.state.resources
    try:
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
                over_max=form.get("over_max") == "yes",
            )
        )
    except actions.NotAFilter as refused:
        raise HTTPException(400, str(refused)) from None
    except actions.Changed:
        return _to(plan_page, planned, changed=expect)
    except actions.OverMax:  # the plan page says so, with the box to tick
        return _to(plan_page, planned)
    counts = {"done": done.taken, "enqueued": done.enqueued}
    path = request.app.url_path_for("search")
    return RedirectResponse(f"{path}?{params.query(fields, action='reprocess', **counts)}", 303)


def _reprocess_one(
    res: Resources, email_id: int, step: actions.Step, lane: Lane, who: str
) -> actions.Done:
    from mailpipe.operations.search import EmailFilter

    done = actions.reprocess(
        res, EmailFilter(email_id=email_id), step, lane=lane, enqueue=sender(res), user=who
    )
    if not done.taken:
        return actions.Done(
            [], refused={email_id: "its run has not succeeded, or a reprocess under way took it"}
        )
    return actions.Done([email_id], done.enqueued)


def notice(query: Mapping[str, str]) -> str | None:
    """An action's result, as the redirect after it carries it: counts, never text."""
    verb = ACTIONS.get(query.get("action", ""))
    if verb is None:
        return None
    try:
        done, enqueued, refused = (int(query.get(key, "0")) for key in _COUNTS)
    except ValueError:
        return None
    parts = [f"{done} {verb}"]
    if query.get("action") in ("retry", "reprocess"):
        parts.append(f"{enqueued} jobs sent")
    if refused:
        parts.append(f"{refused} refused (not in a state for it)")
    return ", ".join(parts)


async def _action_form(request: Request) -> FormData:
    """The action's form, once its user is known to be an operator and its token right."""
    if ACT not in request.auth.scopes:
        raise HTTPException(403, "viewers read; only an operator can act")
    form = await request.form()
    refused = csrf_refusal(request.app.state.secret, request.user.username, form.get("csrf_token"))
    if refused is not None:
        raise HTTPException(403, refused)
    return form


def _selected(form: FormData) -> list[int]:
    return [
        params.whole_number(str(value), "an email id", params.MAX_ID)
        for value in form.getlist("email_id")
    ]


def _who(request: Request) -> str:
    """The user as the actions' audit lines name a console user."""
    return f"web:{request.user.username}"


def _act(
    res: Resources,
    verb: str,
    user: str,
    email_ids: list[int] | None,
    filt: FailedFilter | None = None,
    expect: int | None = None,
) -> actions.Done:
    """The action `verb` on `email_ids`, or on the failed runs `filt` matches when they are None,
    `expect` of them when it is confirmed; done by `user` as the operations' log names them."""
    if email_ids is not None and not email_ids and expect is None:
        return actions.Done([])  # nothing selected: never "every failed run"
    who = f"web:{user}"
    if verb == "retry":
        return actions.retry(res, email_ids, filt, enqueue=sender(res), user=who, expect=expect)
    if verb == "dismiss":
        return actions.dismiss(res, email_ids, filt, user=who, expect=expect)
    assert email_ids is not None
    if verb == "undo":
        return actions.undo_dismiss(res, email_ids, user=who)
    return actions.clear_review(res, email_ids, user=who, expect=expect)


def _to(path: str, fields: Mapping[str, str], **changes: Any) -> Response:
    """To a page of the console, with `fields` and `changes` in its query."""
    return RedirectResponse(f"{path}?{params.query(fields, **changes)}", status_code=303)


def _back(
    request: Request, page: str, fields: Mapping[str, str], verb: str, done: actions.Done
) -> Response:
    """To the page named `page`, its filters kept, with the counts its notice shows."""
    counts = {"done": len(done.done), "enqueued": done.enqueued, "refused": len(done.refused)}
    path = request.app.url_path_for(page)
    return RedirectResponse(
        f"{path}?{params.query(fields, action=verb, **counts)}", status_code=303
    )
