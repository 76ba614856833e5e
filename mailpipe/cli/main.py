"""The `mailpipe` command line (docs/architecture.md; README: Command line).

What an operator can act on (bad input, an unknown id, a service down, a database not migrated)
ends in one line on stderr and an exit code of its kind (listed in `mailpipe --help`), so that
scripts can tell them apart; only a bug prints a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mailpipe.cli import context
from mailpipe.cli.exits import BadInput, NoSchema, NotFound, Unavailable
from mailpipe.cli.filters import email_filter, email_filters, failed_filter, failed_filters
from mailpipe.cli.output import YES, as_confirmed, asked, console, name_refused, to_second
from mailpipe.resources import Resources, get_resources


class Commands(click.Group):
    """The group whose parsing and commands end in one line for whatever an operator can fix."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _one_line_failures():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_failures():
            return super().invoke(ctx)


@contextmanager
def _one_line_failures() -> Iterator[None]:
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # `mailpipe` alone: the help text, as click shows it
    except Exception as exc:
        failure = _as_failure(exc)
        if failure is None:
            raise
        raise failure from None


def _as_failure(exc: Exception) -> click.ClickException | None:
    """The one-line failure that `exc` stands for; None to let it through (click's, or a bug)."""
    # Imported here: the error path alone needs it (Alembic's import is not free).
    from mailpipe.storage.migrate import SchemaMissing

    if isinstance(exc, click.UsageError):
        # Click would print the usage and a hint around the error; one line says as much.
        hint = f" Try '{exc.ctx.command_path} --help'." if exc.ctx else ""
        return BadInput(exc.format_message() + hint)
    if isinstance(exc, ValidationError):
        return BadInput(_settings_problems(exc))
    if isinstance(exc, SchemaMissing):
        return NoSchema(str(exc))
    unavailable = _unavailable(exc)
    return None if unavailable is None else Unavailable(unavailable)


def _settings_problems(exc: ValidationError) -> str:
    """A pydantic ValidationError of the settings, as one line naming the variables."""
    problems = []
    for error in exc.errors():
        # A validator of several variables names them in its message, after pydantic's prefix.
        message = error["msg"].removeprefix("Value error, ")
        loc = error["loc"]
        problems.append(f"MAILPIPE_{str(loc[0]).upper()}: {message}" if loc else message)
    return "invalid settings: " + "; ".join(problems)


def _unavailable(exc: Exception) -> str | None:
    """What service `exc` says is down or busy, and where; None if it is not such an error."""
    from kombu.exceptions import OperationalError as BrokerError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from sqlalchemy.exc import OperationalError as DatabaseError

    from mailpipe.errors import TransientError
    from mailpipe.settings import get_settings
    from mailpipe.storage.migrate import shown_url

    if isinstance(exc, RedisConnectionError | RedisTimeoutError | BrokerError):
        return f"Redis unavailable at {shown_url(get_settings().broker_url)}: {_first_line(exc)}"
    if isinstance(exc, DatabaseError):
        # The driver's own message, without SQLAlchemy's statement and link.
        reason = _first_line(exc.orig)
        return f"database unavailable at {shown_url(get_settings().database_url)}: {reason}"
    if isinstance(exc, TransientError):  # the blob store's, as mailpipe.storage.s3 words them
        return _first_line(exc)
    return None


def _first_line(error: BaseException | None) -> str:
    # Drivers add hint lines (psycopg: "Is the server running ...?") that would break the one.
    return str(error).strip().partition("\n")[0]


@click.group(cls=Commands)
@click.version_option(
    package_name="mailpipe", prog_name="mailpipe", help="Show the installed version and exit."
)
def main() -> None:
    """mailpipe: process stored emails with a Celery worker fleet.

    \b
    Exit codes:
      0  done, or nothing to do: nothing matched, or the question was answered no
      1  an unexpected error (a bug), printed with its traceback
      2  bad input: a bad command, option, argument or MAILPIPE_ setting
      3  not found: an unknown email id, or one without a failed run to retry
      4  a service is unavailable: Redis, the database server or the blob store
      5  no database, or one not migrated: `createdb` it on PostgreSQL, then run
         `mailpipe db upgrade`
    """


@main.group()
def db() -> None:
    """The database schema."""


@db.command("upgrade")
@click.option(
    "--revision",
    default="head",
    show_default=True,
    help="The Alembic revision to upgrade to.",
)
def db_upgrade(revision: str) -> None:
    """Create or upgrade the schema (Alembic); the release role runs this before a rollout."""
    from mailpipe.storage.migrate import shown_url, upgrade

    settings = get_resources().settings
    for warning in settings.database_tls_warnings():
        click.echo(f"warning: {warning}", err=True)
    database_url = settings.database_url
    upgrade(database_url, revision)
    click.echo(f"database at {revision}: {shown_url(database_url)}")


_LANES = click.Choice(["live", "bulk"])


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--no-enqueue", is_flag=True, help="Store only; the sweeper enqueues later.")
@click.option(
    "--follow-symlinks",
    is_flag=True,
    help="Read files that symlinks in a folder point to outside it (refused by default).",
)
@click.option(
    "--allow-rejects",
    is_flag=True,
    help="Exit 0 even if some files or messages were rejected (exit 2 by default).",
)
@click.option(
    "--lane",
    type=_LANES,
    default="live",
    show_default=True,
    help="The emails' lane: bulk (a backfill) never holds up live mail.",
)
def ingest(
    paths: tuple[Path, ...],
    no_enqueue: bool,
    follow_symlinks: bool,
    allow_rejects: bool,
    lane: str,
) -> None:
    """Store .eml files, folders, mbox files and Maildir folders, then enqueue one job each.

    Whatever is rejected (not an email, over a limit, unreadable, a symlink out of a folder) is
    listed after the summary; then the exit code is 2 (bad input) unless --allow-rejects.
    """
    from mailpipe.broker.queues import Lane
    from mailpipe.cli.ingest import ingest as run_ingest

    res = context.migrated()
    with Progress(
        TextColumn("ingest"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task("ingest", total=None)
        report = run_ingest(
            res,
            paths,
            enqueue=not no_enqueue,
            on_progress=lambda n: progress.advance(task, n),
            follow_symlinks=follow_symlinks,
            lane=Lane(lane),
        )
    # Plain lines, never wrapped: scripts read this summary.
    click.echo(
        f"stored {report.stored}, enqueued {report.enqueued}, already queued "
        f"{report.already_queued}, rejected {len(report.rejected)}"
    )
    for rejected in report.rejected:
        click.echo(f"  rejected {rejected.source}: {rejected.reason}")
    if report.rejected and not allow_rejects:
        raise BadInput(
            f"{len(report.rejected)} rejected (listed above); the rest was stored. "
            "--allow-rejects exits 0 for them."
        )


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object (the status contract).")
def status(as_json: bool) -> None:
    """Emails, runs by status, review count, each queue, the live workers and the last sweep."""
    from mailpipe.operations.status import fleet_status

    data = fleet_status(context.migrated())
    if as_json:
        click.echo(json.dumps(data))
        return
    table = Table(title="mailpipe status", show_header=False)
    about = data["estimated"]
    table.add_row("emails", _count(data["emails"], "emails" in about))
    table.add_row("no run yet", str(data["no_run"]))
    for name, count in data["runs"].items():
        table.add_row(f"runs {name}", _count(count, f"runs.{name}" in about))
    table.add_row("needs review", str(data["needs_review"]))
    for role, queue in data["queues"].items():
        age = queue["oldest_age_s"]
        table.add_row(
            f"{role} queue depth",
            f"{queue['depth']} ({queue['name']}), oldest "
            f"{'-' if age is None else f'{age:.1f} s'}, deferred {queue['deferred']}, "
            f"{queue['workers']} worker(s)",
        )
    table.add_row("live workers", str(len(data["workers"])))
    for worker in data["workers"]:
        table.add_row(
            f"  {worker['id']}",
            f"seen {worker['last_seen_s']:.1f} s ago; {', '.join(worker['queues']) or '-'}",
        )
    table.add_row("model calls", "on" if data["model_calls"] else "off")
    for stage, pause in data["paused"].items():
        table.add_row(
            f"{stage} stage", f"PAUSED since {pause['since']} ({pause['by']}): {pause['error']}"
        )
    sweep = data["last_sweep"]
    if sweep:
        table.add_row(
            "last sweep",
            f"{sweep['finished_at']}: re-added {sweep['readded_no_run']} without run, "
            f"{sweep['readded_stalled']} stalled; started {sweep['started_waiting']} waiting for "
            f"model calls; {sweep['marked_for_review']} marked for review",
        )
    console.print(table)


def _count(n: int, estimated: bool) -> str:
    return f"about {n} (PostgreSQL's estimate)" if estimated else str(n)


_STAGES = click.Choice(["cpu", "model"])

_PAGE = click.option(
    "--page", type=click.IntRange(min=1), default=1, show_default=True, help="Which page."
)


@main.command()
@click.option(
    "--retry",
    "retry_ids",
    multiple=True,
    type=int,
    metavar="EMAIL_ID",
    help="Reopen and re-enqueue this email's failed run (a dismissed one too); repeat for more.",
)
@click.option(
    "--retry-all",
    is_flag=True,
    help="Reopen and re-enqueue every listed failed run the filters match (none dismissed).",
)
@failed_filters
@_PAGE
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="List at most this many a page, the latest first.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="List as JSON: the page's rows (email_id, attempts, failed_at, stage, error_class, "
    "error, needs_review, lane, dismissed_at), page, pages and total.",
)
@click.option(
    "--dismissed", is_flag=True, help="List the dismissed runs instead (`dismiss --undo`)."
)
@YES
def failed(
    retry_ids: tuple[int, ...],
    retry_all: bool,
    page: int,
    limit: int,
    as_json: bool,
    dismissed: bool,
    yes: bool,
    **filters: str | None,
) -> None:
    """List failed runs (dismissed runs are not listed), or reopen and re-enqueue them;
    `--retry-all` says how many it takes and asks first."""
    from mailpipe.operations.status import failed_page

    if retry_ids and retry_all:
        raise BadInput("--retry and --retry-all: one or the other")
    if dismissed and (retry_ids or retry_all):
        raise BadInput("--dismissed lists; retry a dismissed run with --retry EMAIL_ID")
    filt = failed_filter(retry_ids, filters, dismissed)
    res = context.migrated()
    if retry_ids:
        _retry(res, retry_ids, None, None)
    elif retry_all:
        counted = _confirmed_count(res, filt, "Retry", yes)
        if counted is not None:
            _retry(res, None, filt, None if yes else counted)
    if retry_ids or retry_all:
        return
    with res.db.session() as session:
        listed = failed_page(session, filt, page, limit)
    if as_json:
        click.echo(json.dumps(listed.as_json()))
        return
    table = Table(
        "email",
        "attempts",
        "failed at",
        "error",
        title=f"{'dismissed' if dismissed else 'failed'} runs: page {listed.page} of "
        f"{listed.pages}, {listed.total} in all",
    )
    for row in listed.rows:
        table.add_row(
            str(row["email_id"]),
            str(row["attempts"]),
            to_second(row["failed_at"]),
            row["error"],
        )
    console.print(table)


def _retry(res: Resources, email_ids: Sequence[int] | None, filt: Any, expect: int | None) -> None:
    """Reopen the failed runs of `email_ids` (None: every listed one `filt` matches, `expect`
    of them) and enqueue their jobs. The ids not retried are named on stderr, and make the exit
    code NotFound's."""
    from mailpipe.enqueue import sender
    from mailpipe.operations import actions

    done = as_confirmed(
        lambda: actions.retry(
            res, email_ids, filt, enqueue=sender(res), user=context.user(), expect=expect
        )
    )
    click.echo(f"reopened {len(done.done)}, enqueued {done.enqueued}")
    name_refused(done.refused, "retried")


def _confirmed_count(res: Resources, filt: Any, verb: str, yes: bool) -> int | None:
    """How many failed runs `filt` lists, said with those that failed as rejected input (a
    retry fails again); that count once confirmed (`yes`: without asking), None when there is
    nothing to do or the answer was no."""
    from mailpipe.errors import input_rejections
    from mailpipe.operations import actions

    counted = actions.count_failed(res, filt)
    rejections = " or ".join(input_rejections())
    click.echo(
        f"{counted.runs} failed runs match; {counted.rejected} of them failed as {rejections}"
        + (": their input is rejected, and a retry fails again" if counted.rejected else "")
    )
    if not counted.runs or not (yes or asked(f"{verb} these {counted.runs}?")):
        return None
    return counted.runs


@main.command()
@click.argument("email_ids", nargs=-1, type=int)
@click.option(
    "--all", "dismiss_all", is_flag=True, help="Every listed failed run the filters match."
)
@click.option(
    "--undo", is_flag=True, help="Take the dismiss back: the runs are on the failed list again."
)
@failed_filters
@YES
def dismiss(
    email_ids: tuple[int, ...],
    dismiss_all: bool,
    undo: bool,
    yes: bool,
    **filters: str | None,
) -> None:
    """Give up on failed runs: each stays failed, leaves the failed and review lists, and no
    retry-all or sweep takes it up again (`failed --retry EMAIL_ID` still does). `failed
    --dismissed` lists them; `dismiss --undo EMAIL_ID...` takes the dismiss back. `--all` says
    how many it takes and asks first."""
    from mailpipe.operations import actions

    if bool(email_ids) == dismiss_all:
        raise BadInput("give EMAIL_ID... or --all (with filters), one or the other")
    if undo and dismiss_all:
        raise BadInput("--undo takes EMAIL_ID..., not --all")
    filt = failed_filter(email_ids, filters)
    res = context.migrated()
    if undo:
        undone = actions.undo_dismiss(res, email_ids, user=context.user())
        click.echo(f"back on the failed list: {len(undone.done)}")
        name_refused(undone.refused, "taken back")
        return
    expect = None
    if dismiss_all:
        counted = _confirmed_count(res, filt, "Dismiss", yes)
        if counted is None:
            return
        expect = None if yes else counted
    done = as_confirmed(
        lambda: actions.dismiss(
            res, email_ids or None, None if email_ids else filt, user=context.user(), expect=expect
        )
    )
    click.echo(f"dismissed {len(done.done)}")
    name_refused(done.refused, "dismissed")


@main.command()
@_PAGE
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="List at most this many a page, the oldest first.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="List as JSON: the page's rows (email_id, subject, reason, status), page, pages and "
    "total.",
)
def review(page: int, limit: int, as_json: bool) -> None:
    """List the emails marked for review, with the reason; `failed --retry` and `dismiss` clear
    the mark."""
    from mailpipe.operations.status import review_page

    with context.migrated().db.session() as session:
        listed = review_page(session, page, limit)
    if as_json:
        click.echo(json.dumps(listed.as_json()))
        return
    table = Table(
        "email",
        "subject",
        "reason",
        "run",
        title=f"emails to review: page {listed.page} of {listed.pages}, {listed.total} in all",
    )
    for row in listed.rows:
        table.add_row(
            str(row["email_id"]), row["subject"] or "", row["reason"] or "", row["status"] or ""
        )
    console.print(table)


@main.command()
@email_filters
@click.option(
    "--before", metavar="EMAIL_ID", help="The next page: emails older than this id (as printed)."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="As JSON: the page's rows (email_id, received_at, sender, subject, lane, state, "
    "error_class, needs_review) and next_before.",
)
def find(text: str | None, review: bool | None, as_json: bool, **options: str | None) -> None:
    """Find emails, newest first, 50 a page: every filter given at once. TEXT is what the
    console's search box takes: an email id, a <Message-ID>, a sender's address, or subject
    words."""
    from rich.text import Text

    from mailpipe.operations import search

    filt, before = email_filter(text, review, options)
    with context.migrated().db.session() as session:
        found = search.find(session, filt, before)
    if as_json:
        click.echo(json.dumps(found.as_json()))
        return
    if not found.rows:
        note = " (Message-ID, sender and subject find only emails a job has read)"
        click.echo("no email found" + (note if filt.reads_headers else ""))
        return
    table = Table(
        "email",
        "received",
        "from",
        "subject",
        "lane",
        "state",
        "error class",
        title=f"emails found: {len(found.rows)}, newest first",
    )
    for row in found.rows:
        # Text, not markup: a subject's "[bold]" is the sender's, to be shown as it is.
        table.add_row(
            str(row["email_id"]),
            to_second(row["received_at"]),
            Text(row["sender"] or ""),
            Text(row["subject"] or ""),
            row["lane"],
            row["state"],
            row["error_class"] or "",
        )
    console.print(table)
    if found.next_before is not None:
        click.echo(f"more: the same filters with --before {found.next_before}")


@main.command("model-calls")
@click.argument("state", type=click.Choice(["on", "off"]), required=False)
def model_calls(state: str | None) -> None:
    """Show or switch model calls; workers read the switch per job, no restart needed."""
    from mailpipe.app.tasks import sweep
    from mailpipe.operations import actions
    from mailpipe.storage import flags

    res = context.migrated()
    if state is None:
        with res.db.session() as session:
            console.print("on" if flags.model_calls_enabled(session) else "off")
        return
    actions.switch_model_calls(
        res, state == "on", send_sweep=sweep.apply_async, user=context.user()
    )
    console.print(f"model calls {state}")
    if state == "on":
        console.print("sweep enqueued")


@main.command()
@click.argument("stage", type=_STAGES)
@click.option(
    "--reason",
    default="paused by an operator",
    show_default=True,
    help="Why, as status shows it.",
)
def pause(stage: str, reason: str) -> None:
    """Pause a stage: its workers stop taking its work until `mailpipe resume STAGE`."""
    from mailpipe.broker.queues import Stage
    from mailpipe.operations import actions

    held = actions.pause(get_resources(), Stage(stage), reason, user=context.user())
    console.print(f"{stage} stage paused ({held.by}): {held.error}")


@main.command()
@click.argument("stage", type=_STAGES)
def resume(stage: str) -> None:
    """End a stage's pause, an operator's or one an outage caused."""
    from mailpipe.broker.queues import Stage
    from mailpipe.operations import actions

    ended = actions.resume(get_resources(), Stage(stage), user=context.user())
    console.print(f"{stage} stage resumed" if ended else f"{stage} stage was not paused")


@main.command()
def sweep() -> None:
    """Run one sweep now, in this process, and print what it did (JSON)."""
    from mailpipe.app.tasks import run_sweep

    result = run_sweep(context.migrated())
    if not result.ran:
        console.print("another sweep is running; nothing done")
        return
    click.echo(json.dumps(result.summary()))


@main.command()
def housekeeping() -> None:
    """Run one housekeeping pass now, in this process, and print what it deleted (JSON): what
    beat's lock holder does every MAILPIPE_HOUSEKEEPING_INTERVAL seconds."""
    from dataclasses import asdict

    from mailpipe.operations.housekeeping import prune

    click.echo(json.dumps(asdict(prune(context.migrated()))))


@main.command()
@click.argument("lane", type=_LANES)
@click.argument("email_ids", nargs=-1, type=int, required=True)
def lane(lane: str, email_ids: tuple[int, ...]) -> None:
    """Move emails to a lane: their next job goes in it (a job already queued stays put)."""
    from mailpipe.broker.queues import Lane
    from mailpipe.operations import actions

    done = actions.move(context.migrated(), email_ids, Lane(lane), user=context.user())
    click.echo(f"moved {len(done.done)} to {lane}")
    name_refused(done.refused, "moved")


@main.command()
@click.argument("email_id", type=int)
@click.option(
    "--history-before",
    type=click.IntRange(min=1),
    help="The attempts before this one (a page's `older_history`); the last 50 without it.",
)
def show(email_id: int, history_before: int | None) -> None:
    """An email's run, where its job is, documents, labels, classification and last 50
    attempts, as JSON."""
    from mailpipe.operations.status import email_detail, job_state

    res = context.migrated()
    with res.db.session() as session:
        detail = email_detail(session, email_id, history_before)
        if detail is None:
            raise NotFound(f"no email with id {email_id}")
        job = job_state(res, session, email_id)
    assert job is not None
    # Where the job is, as the job status API says it (waiting, and for what; lost; running).
    detail["job"] = {"state": job["state"], "waiting_for": job["waiting_for"]}
    click.echo(json.dumps(detail, indent=2))


@main.command()
def web() -> None:
    """Serve the operator's console and the job status API (MAILPIPE_WEB_HOST, _PORT).

    Viewers (MAILPIPE_WEB_VIEWERS) read; operators (MAILPIPE_WEB_OPERATORS) also retry, dismiss,
    pause and switch model calls. Without either, it serves loopback only.
    """
    from mailpipe.web.server import refusal, serve

    settings = get_resources().settings
    refused = refusal(settings)
    if refused is not None:
        raise BadInput(refused)
    serve(settings)


@main.command()
@email_filters
@click.option(
    "--from",
    "step",
    type=click.Choice(["classify", "documents", "parse"]),
    required=True,
    help="Where to start: the model stage alone (classify), or the CPU stage and the model "
    "stage after it (documents and parse both parse the email and convert its documents).",
)
@click.option(
    "--in-lane",
    type=click.Choice(["bulk", "live"]),
    default="bulk",
    show_default=True,
    help="The lane the jobs are sent in.",
)
@click.option("--dry-run", is_flag=True, help="Say what it would take and cost; change nothing.")
@click.option(
    "--over-max",
    is_flag=True,
    help="Take them even when they are more than MAILPIPE_REPROCESS_MAX.",
)
@YES
def reprocess(
    text: str | None,
    review: bool | None,
    step: str,
    in_lane: str,
    dry_run: bool,
    over_max: bool,
    yes: bool,
    **options: str | None,
) -> None:
    """Run again the emails the filters find whose run succeeded, from a step (after a change to
    the rules, the prompt or the labels). Says how many it takes and the model calls that costs,
    then asks; takes each email once however often it is sent, and at most
    MAILPIPE_REPROCESS_MAX of them unless --over-max. Their classification and labels stay until
    the new ones replace them; the overview and `status --json` ("reprocesses") show the
    progress."""
    from mailpipe.broker.queues import Lane
    from mailpipe.enqueue import sender
    from mailpipe.operations import actions

    filt, _ = email_filter(text, review, options)
    res = context.migrated()
    step_ = actions.Step(step)
    lane = Lane(in_lane)

    try:
        planned = actions.plan_reprocess(res, filt)
    except actions.NotAFilter as refused:
        raise BadInput(str(refused)) from None
    click.echo(
        f"{planned.emails} succeeded emails match, from {step}, in the {lane} lane: "
        f"{planned.model_calls} model calls"
    )
    if planned.emails > planned.most and not over_max:
        over = (
            f"{planned.emails} emails is more than MAILPIPE_REPROCESS_MAX ({planned.most}) "
            "takes at once: narrow the filters, or --over-max takes them"
        )
        if not dry_run:
            raise BadInput(over)
        click.echo(over)
    if dry_run or not planned.emails or not (yes or asked("Reprocess them?")):
        return
    # Asked, the count must still be the one confirmed; told --yes, a script takes what the
    # filters find then, as of its plan all the same.
    done = as_confirmed(
        lambda: actions.reprocess(
            res,
            filt,
            step_,
            lane=lane,
            enqueue=sender(res),
            user=context.user(),
            expect=None if yes else planned.emails,
            as_of=planned.as_of,
            over_max=over_max,
        )
    )
    click.echo(f"reprocess {done.reprocess_id}: reopened {done.taken}, enqueued {done.enqueued}")


@main.command()
@click.argument("email_ids", nargs=-1, type=click.IntRange(min=1), metavar="[EMAIL_ID]...")
@click.option("--message-id", metavar="ID", help="Every email with this Message-ID.")
@click.option(
    "--sender",
    metavar="ADDRESS",
    help="Every email whose From holds this address (whole, in any case).",
)
@click.option(
    "--dry-run", is_flag=True, help="List what it would delete (ids, counts); change nothing."
)
@YES
def forget(
    email_ids: tuple[int, ...],
    message_id: str | None,
    sender: str | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Erase emails everywhere: their rows, blobs, documents, labels, history and Redis state.
    Their origins pass to their next copy, which keeps their labels and runs the steps a copy
    skips; their jobs in flight are fenced off. Each leaves one audit line (who, its id, the
    SHA-256 of its Message-ID). It cannot be undone."""
    from mailpipe.enqueue import sender as jobs_sender
    from mailpipe.operations import actions
    from mailpipe.operations.erasure import selection
    from mailpipe.operations.search import BadSearch

    if sum((bool(email_ids), message_id is not None, sender is not None)) != 1:
        raise BadInput("give email ids, --message-id or --sender: one of them")
    filt = None
    if not email_ids:
        try:
            filt = selection(message_id, sender)
        except BadSearch as exc:
            raise BadInput(str(exc)) from None
    res = context.migrated()
    planned = actions.forget(
        res, email_ids or None, filt, enqueue=jobs_sender(res), user="", dry_run=True
    )
    if not planned.email_ids:
        if planned.refused:
            raise NotFound(f"no email with id {' '.join(map(str, planned.refused))}")
        click.echo("no email found (Message-ID and sender find only emails a job has read)")
        return
    click.echo(f"{len(planned.email_ids)} emails: {' '.join(map(str, planned.email_ids))}")
    click.echo(_forget_counts(planned))
    if planned.completed:
        click.echo(_completed(planned.completed))
    if dry_run:
        name_refused(planned.refused, "forgotten")
        return
    if not (yes or asked(f"Forget these {len(planned.email_ids)} emails for good?")):
        return
    done = actions.forget(res, planned.email_ids, enqueue=jobs_sender(res), user=context.user())
    click.echo(f"forgot {len(done.email_ids)}: {_forget_counts(done)}")
    if done.completed:
        click.echo(
            f"copies completed: {' '.join(map(str, done.completed))}, jobs sent {done.enqueued}"
        )
    name_refused({**planned.refused, **done.refused}, "forgotten")


def _completed(email_ids: list[int]) -> str:
    """What becomes of the copies whose origin is forgotten, said before the forget."""
    return (
        f"copies that become their origin's first email: {' '.join(map(str, email_ids))}; "
        "each keeps the labels of the email forgotten and runs the steps a copy skips "
        "(documents, then classification), from its CPU stage"
    )


def _forget_counts(done: Any) -> str:
    """What a forget deleted (or would): counts, never content."""
    rows = ", ".join(f"{table} {n}" for table, n in sorted(done.rows.items()) if n)
    return (
        f"rows: {rows}; blobs: {done.blobs}; Redis entries: {done.redis}; "
        f"origins handed on to a copy: {done.handed_on}"
    )


@main.command("web-token")
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(["viewer", "operator"]),
    default="viewer",
    show_default=True,
    help="A viewer's token reads the API; an operator's also acts.",
)
def web_token(name: str, role: str) -> None:
    """Make a bearer token for the console's API: the token, shown once, for the machine that
    calls; and its entry for MAILPIPE_WEB_TOKENS, which holds only the token's SHA-256."""
    import hashlib
    import secrets

    if not name.replace("-", "").replace("_", "").isalnum():
        raise BadInput("a token's name is letters, digits, - and _")
    token = secrets.token_urlsafe(32)
    click.echo(f"token (give it to the caller; it is not kept): {token}")
    click.echo(
        f"MAILPIPE_WEB_TOKENS entry: {name}:{role}:{hashlib.sha256(token.encode()).hexdigest()}"
    )


@main.command()
@click.option("--keep", is_flag=True, help="Keep the demo's folder instead of deleting it.")
def demo(keep: bool) -> None:
    """Run the bundled sample emails through a real prefork worker and summarise."""
    from mailpipe.cli.demo import run_demo

    sys.exit(run_demo(console, keep=keep))


if __name__ == "__main__":
    main(prog_name="mailpipe")
