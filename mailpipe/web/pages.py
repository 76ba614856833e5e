"""The console's pages: server-rendered HTML over `mailpipe.operations.status`, each carrying its
user's CSRF token for the forms on it (`mailpipe.web.forms`).

Pages are sync endpoints: Starlette runs them on its thread pool, where they may block on the
database and Redis. A page whose form posts back to its own path is one `HTTPEndpoint`: its
`get` here, its `post` the form's action in `forms`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from starlette.datastructures import URLPath
from starlette.endpoints import HTTPEndpoint
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from mailpipe.broker.queues import Lane, Stage
from mailpipe.errors import input_rejections
from mailpipe.operations.actions import (
    Counted,
    Step,
    count_failed,
    count_of,
    marked,
)
from mailpipe.operations.activity import fleet_activity
from mailpipe.operations.search import (
    FIELDS,
    STATES,
    BadSearch,
    Found,
    failed_fields,
    read_failed,
    read_search,
)
from mailpipe.operations.status import (
    FailedFilter,
    Page,
    email_detail,
    error_classes,
    failed_page,
    fleet_status,
    job_state,
    review_page,
)
from mailpipe.web import charts, forms, params, searching, verbs
from mailpipe.web.auth import ACT, csrf_token

PER_PAGE = 50
NOTHING = Page([], 1, 1, 0)


def templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.globals["stages"] = [stage.value for stage in Stage]
    env.globals["url_path_for"] = _url_path_for
    return Jinja2Templates(env=env)


@jinja2.pass_context
def _url_path_for(context: dict[str, Any], name: str, /, **path_params: Any) -> URLPath:
    """A route's path, without a scheme and host: behind a proxy, the host the console is asked
    for may not be the one the browser sees."""
    return context["request"].app.url_path_for(name, **path_params)


def overview(request: Request) -> Response:
    res = request.app.state.resources
    window = params.window(request.query_params)
    with res.db.reading() as session:
        activity = fleet_activity(session, window)
    return _render(
        request,
        "overview.html",
        status=fleet_status(res, estimates=True),
        activity=activity,
        activity_panels=charts.panels(activity),
    )


class Failed(HTTPEndpoint):
    """The failed list, and the actions its form posts (`forms.act_on_failed`)."""

    def get(self, request: Request) -> Response:
        page = params.page_number(request.query_params)
        filt: FailedFilter | None = None
        try:
            filt = read_failed(request.query_params)
            fields, problems = failed_fields(filt), []
        except BadSearch as exc:
            # The form as it was sent, with what to correct, and nothing listed: what the filters
            # match is what "all matching" acts on.
            fields, problems = params.filter_fields(request.query_params), [str(exc)]
        with request.app.state.resources.db.reading() as session:
            listed = NOTHING if filt is None else failed_page(session, filt, page, PER_PAGE)
            classes = error_classes(session)
        return _render(
            request,
            "failed.html",
            status_code=400 if problems else 200,
            listed=listed,
            classes=classes,
            filters=fields,
            problems=problems,
            query=lambda **changes: params.query(fields, **changes),
        )

    async def post(self, request: Request) -> Response:
        return await forms.act_on_failed(request)


class Review(HTTPEndpoint):
    """The review list, and the actions its form posts (`forms.act_on_review`)."""

    def get(self, request: Request) -> Response:
        page = params.page_number(request.query_params)
        with request.app.state.resources.db.reading() as session:
            listed = review_page(session, page, PER_PAGE)
        return _render(
            request, "review.html", listed=listed, query=lambda **c: params.query({}, **c)
        )

    async def post(self, request: Request) -> Response:
        return await forms.act_on_review(request)


def search(request: Request) -> Response:
    """The search page, and the search box's answer: an email id goes to the email's page."""
    asked = {k: v for k, v in request.query_params.items() if k not in forms.NOTICE_KEYS}
    try:
        filt, before = read_search(asked)
    except BadSearch as exc:
        # The form as it was sent, with what to correct.
        sent = {name: request.query_params.get(name, "") for name in FIELDS}
        return _search_page(request, sent, None, [str(exc)])
    if filt.email_id is not None:
        return RedirectResponse(request.app.url_path_for("email", email_id=filt.email_id), 303)
    found = searching.found(request, filt, before)
    return _search_page(request, filt.fields(), found, [], header_note=filt.reads_headers)


def _search_page(
    request: Request,
    fields: dict[str, str],
    found: Found | None,
    problems: list[str],
    header_note: bool = False,
) -> Response:
    return _render(
        request,
        "search.html",
        status_code=400 if problems else 200,
        found=found,
        filters=fields,
        problems=problems,
        header_note=header_note,
        steps=[step.value for step in Step],
        paged=bool(request.query_params.get("before")),
        states=STATES,
        lanes=[lane.value for lane in Lane],
        labels=request.app.state.resources.settings.labels,
        query=lambda **changes: params.query(fields, **changes),
    )


# The confirmations of the lists' actions on all they list: what each does, by its `do`.
FAILED_VERBS = verbs.on_all("failed")
REVIEW_VERBS = verbs.on_all("review")


def confirm_failed(request: Request) -> Response:
    """What "Retry all" or "Dismiss all" of the failed list takes, and the form that does it:
    the count, and for a retry the runs whose input was rejected, which fail again."""
    verb = _verb(request, FAILED_VERBS)
    filt = params.failed_filter(request.query_params)
    counted = count_failed(request.app.state.resources, filt)
    fields = failed_fields(filt)
    shown = {name: value for name, value in fields.items() if value and name != "view"}
    return _confirm(
        request,
        title=f"{FAILED_VERBS[verb]} all {counted.runs} failed runs the filters match?",
        figures=[("failed runs", str(counted.runs)), *_filters_shown(shown)],
        counted=counted,
        rejections=verb == "retry",
        action=request.app.url_path_for("failed"),
        fields={**fields, "do": f"{verb}-matching", "expect": str(counted.runs)},
        button=f"{FAILED_VERBS[verb]} {counted.runs} runs",
        back=f"{request.app.url_path_for('failed')}?{params.query(fields)}",
    )


def confirm_review(request: Request) -> Response:
    """What an action on every email of the review list takes, and the form that does it."""
    verb = _verb(request, REVIEW_VERBS)
    counted = count_of(request.app.state.resources, marked(request.app.state.resources))
    return _confirm(
        request,
        title=f"{REVIEW_VERBS[verb]} all {counted.runs} emails on the review list?",
        figures=[("emails marked", str(counted.runs))],
        counted=counted,
        rejections=verb == "retry",
        action=request.app.url_path_for("review"),
        fields={"do": f"{verb}-matching", "expect": str(counted.runs)},
        button=f"{REVIEW_VERBS[verb]} {counted.runs} emails",
        back=request.app.url_path_for("review"),
    )


class Reprocess(HTTPEndpoint):
    """A reprocess: its plan, and the form that takes it (`forms.reprocess_matching`)."""

    def get(self, request: Request) -> Response:
        """A reprocess's plan, from the search's form: how many emails it takes, the model calls
        that costs, and the form that takes them (with the plan's count and `as_of`)."""
        query = request.query_params
        filt, _ = params.searched({name: query.get(name, "") for name in FIELDS})
        step, lane = query.get("from"), query.get("in_lane")
        if step not in tuple(Step) or lane not in tuple(Lane):
            raise HTTPException(
                400, "from is a step and in_lane a lane, as the search's form has them"
            )
        res = request.app.state.resources
        plan = verbs.plan_reprocess(res, filt, params.count(query, "as_of"))
        fields = filt.fields()
        shown = {name: value for name, value in fields.items() if value}
        over = plan.emails > plan.most
        return _confirm(
            request,
            title=f"Reprocess {plan.emails} succeeded emails from {step}?",
            figures=[
                ("emails", str(plan.emails)),
                ("model calls", f"{plan.model_calls} ({res.settings.model_backend})"),
                ("from", str(step)),
                ("in the lane", str(lane)),
                *_filters_shown(shown),
            ],
            counted=Counted(plan.emails),
            problems=[
                f"That is more than MAILPIPE_REPROCESS_MAX ({plan.most}) takes at once: narrow "
                "the search, or tick the box to take them all the same."
            ]
            if over
            else [],
            over_max=over,
            action=request.app.url_path_for("reprocess"),
            fields={
                **fields,
                "from": str(step),
                "in_lane": str(lane),
                "expect": str(plan.emails),
                "as_of": str(plan.as_of),
            },
            button=f"Reprocess {plan.emails} emails",
            back=f"{request.app.url_path_for('search')}?{params.query(fields)}",
        )

    async def post(self, request: Request) -> Response:
        return await forms.reprocess_matching(request)


def _verb(request: Request, verbs: dict[str, str]) -> str:
    verb = request.query_params.get("do", "")
    if verb not in verbs:
        raise HTTPException(400, f"do is one of {', '.join(verbs)}")
    return verb


def _filters_shown(fields: dict[str, str]) -> list[tuple[str, str]]:
    return (
        [("filters", ", ".join(f"{name} {value}" for name, value in fields.items()))]
        if fields
        else []
    )


def _confirm(
    request: Request,
    *,
    counted: Counted,
    rejections: bool = False,
    problems: list[str] | None = None,
    over_max: bool = False,
    **context: Any,
) -> Response:
    """The confirmation of a mass action: its figures, and a form that posts them back with
    the count it showed, which the action checks (`actions.Changed`: back here, with the
    figures now). `changed` in the query: the count a confirmation showed before."""
    said = list(problems or [])
    before = params.count(request.query_params, "changed")
    if before is not None:
        said.insert(
            0, f"It was {before} when you confirmed; it is {counted.runs} now: nothing was done."
        )
    notes = []  # (its class, its text)
    if rejections:
        names = " or ".join(input_rejections())
        notes.append(
            (
                "warning",
                f"{counted.rejected} of them failed as {names}: their input is rejected, and a "
                "retry fails again.",
            )
            if counted.rejected
            else ("muted", f"None of them failed as {names}.")
        )
    return _render(
        request,
        "confirm.html",
        count=counted.runs,
        problems=said,
        notes=notes,
        over_max=over_max,
        **context,
    )


def email(request: Request) -> Response:
    email_id = params.email_id(request)
    before = params.history_before(request.query_params)
    res = request.app.state.resources
    with res.db.reading() as session:
        detail = email_detail(session, email_id, before)
        state = job_state(res, session, email_id) if detail is not None else None
    if detail is None or state is None:
        raise HTTPException(404, f"no email with id {email_id}")
    return _render(request, "email.html", email=detail, state=state, steps=[s.value for s in Step])


def _render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
    user = request.user.username
    state = request.app.state
    return state.templates.TemplateResponse(
        request,
        name,
        {
            "user": user,
            "operator": ACT in request.auth.scopes,
            "csrf": csrf_token(state.secret, user),
            "notice": forms.notice(request.query_params),
            "nav": name.removesuffix(".html"),
            **context,
        },
        status_code=status_code,
    )
