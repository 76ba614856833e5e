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

from mailpipe.broker.queues import Stage
from mailpipe.enqueue import send_sweep
from mailpipe.operations import actions
from mailpipe.operations.search import FIELDS, failed_fields
from mailpipe.web import params, verbs
from mailpipe.web.auth import ACT, acting, csrf_refusal

# How the actions' audit lines name this face's users.
FACE = "web"

# What an action's result says, by the name it comes back under; anything else shows nothing.
ACTIONS = {
    "retry": "retried",
    "dismiss": "dismissed",
    "undo": "back on the failed list",
    "undo-dismiss": "back on the failed list",
    "clear": "review mark cleared",
    "clear-review": "review mark cleared",
    "lane": "moved to the other lane",
    "reprocess": "reprocessed",
    "forget": "forgotten",
}
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
        user=acting(request, FACE),
    )
    return RedirectResponse(request.app.url_path_for("overview"), status_code=303)


async def pause_or_resume(request: Request) -> Response:
    form = await _action_form(request)
    stage = Stage(params.choice(form, "stage", tuple(Stage)))
    res = request.app.state.resources
    if params.choice(form, "do", ("pause", "resume")) == "pause":
        reason = str(form.get("reason") or "").strip() or "paused by an operator"
        await run_in_threadpool(actions.pause, res, stage, reason[:200], user=acting(request, FACE))
    else:
        await run_in_threadpool(actions.resume, res, stage, user=acting(request, FACE))
    return RedirectResponse(request.app.url_path_for("overview"), status_code=303)


async def act_on_failed(request: Request) -> Response:
    """The failed list's actions (`verbs.ON_LISTS`): on the ticked runs at once; on every run
    the filters match only with the count its confirmation page showed (`expect`), or to that
    page."""
    form = await _action_form(request)
    verb, scope = params.choice(form, "do", verbs.posted_on("failed")).split("-")
    filt = params.failed_filter(params.filter_fields(form))
    fields = failed_fields(filt)
    if scope == "selected":
        done = await verbs.act_on_list(request, verb, verbs.Chosen(_selected(form)), FACE)
    else:
        expect = params.count(form, "expect")
        confirm = request.app.url_path_for("confirm_failed")
        if expect is None:
            return _to(confirm, fields, do=verb)
        try:
            done = await verbs.act_on_list(request, verb, verbs.Chosen(None, filt, expect), FACE)
        except actions.Changed:
            return _to(confirm, fields, do=verb, changed=expect)
    return _back(request, "failed", fields, verb, done)


async def act_on_review(request: Request) -> Response:
    """The review list's actions (`verbs.ON_LISTS`): on the ticked emails at once; on all of
    them only with the count its confirmation page showed (`expect`), or to that page."""
    form = await _action_form(request)
    verb, scope = params.choice(form, "do", verbs.posted_on("review")).split("-")
    if scope == "selected":
        email_ids, expect = _selected(form), None
    else:
        expect = params.count(form, "expect")
        if expect is None:
            return _to(request.app.url_path_for("confirm_review"), {}, do=verb)
        email_ids = await run_in_threadpool(actions.marked, request.app.state.resources)
    try:
        done = await verbs.act_on_list(request, verb, verbs.Chosen(email_ids, None, expect), FACE)
    except actions.Changed:
        return _to(request.app.url_path_for("confirm_review"), {}, do=verb, changed=expect)
    return _back(request, "review", {}, verb, done)


# Why a reprocess of one email took none.
NOT_TAKEN = "its run has not succeeded, or a reprocess under way took it"


async def act_on_email(request: Request) -> Response:
    """One of `verbs.ON_EMAIL` on the email whose page posted it; back to that page, with what
    it did. A forget only with its box ticked (the CLI asks before it forgets too), and then to
    the search, since the email's page is gone with it."""
    email_id = params.email_id(request)
    form = await _action_form(request)
    verb = params.choice(form, "do", verbs.ON_EMAIL)
    if verb == "forget" and form.get("confirm") != "yes":
        raise HTTPException(400, "forgetting an email cannot be undone: tick the box to confirm")
    done = await verbs.act(request, verb, email_id, params.Form(form), FACE)
    if isinstance(done, actions.Forgotten):
        if not done.email_ids:
            raise HTTPException(404, f"no email with id {email_id}")
        return _to(request.app.url_path_for("search"), {}, action="forget", done=1)
    if isinstance(done, actions.Reprocessed):  # of its one email
        done = (
            actions.Done([email_id], done.enqueued)
            if done.taken
            else actions.Done([], refused={email_id: NOT_TAKEN})
        )
    return _back(request, "email", {}, verb, done, email_id=email_id)


async def reprocess_matching(request: Request) -> Response:
    """The search's reprocess, as its plan page (`pages.Reprocess`) confirms it: the
    succeeded emails of its filter, from the step chosen, only with the plan's count (`expect`)
    and `as_of`, and past MAILPIPE_REPROCESS_MAX only with `over_max` ticked; else back to the
    plan page, as it is now. Then to the search, with what it did."""
    form = await _action_form(request)
    posted = params.Form(form)
    fields = {name: str(form.get(name) or "") for name in FIELDS}
    filt, _ = params.searched(fields)
    step, lane = verbs.reprocess_from(posted, lane="in_lane")
    expect, as_of = posted.count("expect"), posted.count("as_of")
    plan_page = request.app.url_path_for("reprocess")
    chosen = {**fields, "from": step.value, "in_lane": lane.value}
    if expect is None:
        return _to(plan_page, chosen)
    # Back to the plan as of its own `as_of`, should it be refused: what was taken since stays
    # left out.
    planned = {**chosen, "as_of": "" if as_of is None else str(as_of)}
    res = request.app.state.resources
    try:
        done = await run_in_threadpool(
            verbs.reprocess, res, filt, step, lane, posted, acting(request, FACE)
        )
    except actions.Changed:
        return _to(plan_page, planned, changed=expect)
    except actions.OverMax:  # the plan page says so, with the box to tick
        return _to(plan_page, planned)
    counts = {"done": done.taken, "enqueued": done.enqueued}
    return _to(request.app.url_path_for("search"), fields, action="reprocess", **counts)


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


def _to(path: str, fields: Mapping[str, str], **changes: Any) -> Response:
    """To a page of the console, with `fields` and `changes` in its query."""
    return RedirectResponse(f"{path}?{params.query(fields, **changes)}", status_code=303)


def _back(
    request: Request,
    page: str,
    fields: Mapping[str, str],
    verb: str,
    done: actions.Done,
    **path_params: Any,
) -> Response:
    """To the page named `page`, its filters kept, with the counts its notice shows."""
    counts = {"done": len(done.done), "enqueued": done.enqueued, "refused": len(done.refused)}
    return _to(request.app.url_path_for(page, **path_params), fields, action=verb, **counts)
