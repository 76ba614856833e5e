"""The failed list and the review list: `mailpipe failed` (the list, and its retries by id
or by filter), `dismiss` and `review`.

What a command needs beyond click, rich and the resources it imports when it runs: `main.py`
says why.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
from rich.table import Table

from mailpipe.cli import context
from mailpipe.cli.exits import BadInput
from mailpipe.cli.filters import failed_filter, failed_filters
from mailpipe.cli.output import YES, as_confirmed, asked, console, name_refused, to_second
from mailpipe.resources import Resources

_PAGE = click.option(
    "--page", type=click.IntRange(min=1), default=1, show_default=True, help="Which page."
)


@click.command()
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
    "error, needs_review, lane, mailbox, dismissed_at), page, pages and total.",
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


@click.command()
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


@click.command()
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
    help="List as JSON: the page's rows (email_id, subject, reason, mailbox, status), page, "
    "pages and total.",
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
