"""What an operator does, by verb: to one email, in one table for the email's page (its forms'
`do`) and the API (`POST /api/emails/{email_id}/{verb}`); to many at once, in one table for the
failed and review lists' forms and their confirmation pages. Each verb's act is in
`mailpipe.operations.actions`, its arguments read from what was posted (`params.Posted`: a form's
fields or a JSON body, or the emails a list's form chose). Each face adds who acted and answers
with what the act came back with, a redirect or JSON; the act logs itself, with its user."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request

from mailpipe.broker.queues import Lane
from mailpipe.enqueue import sender
from mailpipe.operations import actions
from mailpipe.operations.search import EmailFilter
from mailpipe.operations.status import FailedFilter
from mailpipe.resources import Resources
from mailpipe.web.auth import acting
from mailpipe.web.params import Posted

# What an act comes back with: each face answers each of them in its own way.
Result = actions.Done | actions.Reprocessed | actions.Forgotten
OnEmail = Callable[[Resources, int, Posted, str], Result]


def reprocess_from(posted: Posted, lane: str = "lane") -> tuple[actions.Step, Lane]:
    """Where a reprocess starts (`from`) and the lane its jobs go in (`lane`, the bulk one
    unless given; the search's form names it `in_lane`, since its `lane` is a filter)."""
    step = actions.Step(posted.choice("from", actions.Step))
    return step, Lane(posted.choice(lane, Lane, default=Lane.BULK.value))


def plan_reprocess(res: Resources, filt: EmailFilter, as_of: int | None) -> actions.Reprocessed:
    """`actions.plan_reprocess`; a filter that takes every email is a 400."""
    try:
        return actions.plan_reprocess(res, filt, as_of=as_of)
    except actions.NotAFilter as refused:
        raise HTTPException(400, str(refused)) from None


def reprocess(
    res: Resources,
    filt: EmailFilter,
    step: actions.Step,
    lane: Lane,
    posted: Posted,
    user: str,
) -> actions.Reprocessed:
    """The emails `filt` finds run again from `step` in `lane`, as far as what was posted
    confirms them (`expect`, `as_of`, `over_max`); with `dry_run`, their plan alone. A filter
    that takes every email is a 400; `actions.Changed` and `actions.OverMax`, raised with the
    plan as it is now, are the face's to answer."""
    expect, as_of, over_max = posted.count("expect"), posted.count("as_of"), posted.flag("over_max")
    if posted.flag("dry_run"):
        return plan_reprocess(res, filt, as_of)
    try:
        return actions.reprocess(
            res,
            filt,
            step,
            lane=lane,
            enqueue=sender(res),
            user=user,
            expect=expect,
            as_of=as_of,
            over_max=over_max,
        )
    except actions.NotAFilter as refused:
        raise HTTPException(400, str(refused)) from None


# The acts on one email, by verb, each given (resources, email id, what was posted, user).
ON_EMAIL: dict[str, OnEmail] = {
    "retry": lambda res, email_id, _, user: actions.retry(
        res, [email_id], enqueue=sender(res), user=user
    ),
    "dismiss": lambda res, email_id, _, user: actions.dismiss(res, [email_id], user=user),
    "undo-dismiss": lambda res, email_id, _, user: actions.undo_dismiss(res, [email_id], user=user),
    "clear-review": lambda res, email_id, _, user: actions.clear_review(res, [email_id], user=user),
    "lane": lambda res, email_id, posted, user: actions.move(
        res, [email_id], Lane(posted.choice("lane", Lane)), user=user
    ),
    "reprocess": lambda res, email_id, posted, user: reprocess(
        res, EmailFilter(email_id=email_id), *reprocess_from(posted), posted, user
    ),
    "forget": lambda res, email_id, posted, user: actions.forget(
        res, [email_id], enqueue=sender(res), user=user, dry_run=posted.flag("dry_run")
    ),
}


async def act(request: Request, verb: str, email_id: int, posted: Posted, face: str) -> Result:
    """`verb` done to `email_id` by the request's user (`auth.acting`), on the thread pool,
    where it may block on the database and Redis."""
    res = request.app.state.resources
    return await run_in_threadpool(ON_EMAIL[verb], res, email_id, posted, acting(request, face))


@dataclass(frozen=True)
class Chosen:
    """What a list's act is on: the ticked `email_ids`; or, when they are None, the failed runs
    `filt` matches. `expect`: how many there are, as the operator confirmed it on the list's
    confirmation page."""

    email_ids: list[int] | None
    filt: FailedFilter | None = None
    expect: int | None = None

    def ticked(self) -> list[int]:
        """The ticked emails, for an act on them alone."""
        assert self.email_ids is not None, "this act takes the ticked emails, never a filter"
        return self.email_ids


@dataclass(frozen=True)
class OnList:
    """A verb of the lists' forms: its act (resources, what was chosen, user); the lists that
    post it, by their route's name; and when it also acts on all a list holds, once that
    list's confirmation page has counted them, what the page calls it."""

    act: Callable[[Resources, Chosen, str], actions.Done]
    lists: tuple[str, ...]
    on_all: str | None = None


# The acts on many emails, by verb: a list's form posts `<verb>-selected` for the ticked ones,
# and `<verb>-matching` for all it holds.
ON_LISTS: dict[str, OnList] = {
    "retry": OnList(
        lambda res, chosen, user: actions.retry(
            res,
            chosen.email_ids,
            chosen.filt,
            enqueue=sender(res),
            user=user,
            expect=chosen.expect,
        ),
        ("failed", "review"),
        "Retry",
    ),
    "dismiss": OnList(
        lambda res, chosen, user: actions.dismiss(
            res, chosen.email_ids, chosen.filt, user=user, expect=chosen.expect
        ),
        ("failed", "review"),
        "Dismiss",
    ),
    "undo": OnList(
        lambda res, chosen, user: actions.undo_dismiss(res, chosen.ticked(), user=user),
        ("failed", "review"),
    ),
    "clear": OnList(
        lambda res, chosen, user: actions.clear_review(
            res, chosen.ticked(), user=user, expect=chosen.expect
        ),
        ("review",),
        "Clear the mark of",
    ),
}


def posted_on(page: str) -> tuple[str, ...]:
    """The `do`s the list `page` (its route's name) takes from its form."""
    return tuple(
        f"{verb}-{scope}"
        for verb, on in ON_LISTS.items()
        if page in on.lists
        for scope in (("selected",) if on.on_all is None else ("selected", "matching"))
    )


def on_all(page: str) -> dict[str, str]:
    """The verbs that act on all the list `page` holds, by what its confirmation page calls
    each."""
    return {verb: on.on_all for verb, on in ON_LISTS.items() if page in on.lists and on.on_all}


async def act_on_list(request: Request, verb: str, chosen: Chosen, face: str) -> actions.Done:
    """`verb` done to what a list's form chose by the request's user, on the thread pool. None
    ticked and none confirmed is nothing done: never every failed run."""
    if chosen.email_ids is not None and not chosen.email_ids and chosen.expect is None:
        return actions.Done([])
    res = request.app.state.resources
    return await run_in_threadpool(ON_LISTS[verb].act, res, chosen, acting(request, face))
