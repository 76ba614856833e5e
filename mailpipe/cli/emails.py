"""Emails one by one or by filter: `mailpipe ingest`, `find`, `show`, `lane` and `reprocess`.

What a command needs beyond click, rich and the resources it imports when it runs: `main.py`
says why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from mailpipe.cli import context
from mailpipe.cli.exits import BadInput, NotFound
from mailpipe.cli.filters import email_filter, email_filters
from mailpipe.cli.output import YES, as_confirmed, asked, console, name_refused, to_second

_LANES = click.Choice(["live", "bulk"])


@click.command()
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
@click.option(
    "--mailbox",
    metavar="NAME",
    help="The mailbox the emails were delivered to (the default mailbox if not given).",
)
@click.option(
    "--mailbox-per-folder",
    is_flag=True,
    help="Each PATH is a folder of mailboxes: each folder in it is one, named as the folder.",
)
def ingest(
    paths: tuple[Path, ...],
    no_enqueue: bool,
    follow_symlinks: bool,
    allow_rejects: bool,
    lane: str,
    mailbox: str | None,
    mailbox_per_folder: bool,
) -> None:
    """Store .eml files, folders, mbox files and Maildir folders, then enqueue one job each.

    Whatever is rejected (not an email, over a limit, unreadable, a symlink out of a folder) is
    listed after the summary; then the exit code is 2 (bad input) unless --allow-rejects.
    """
    from mailpipe.broker import mailboxes
    from mailpipe.broker.queues import Lane
    from mailpipe.cli.ingest import IngestReport, Rejected, by_mailbox
    from mailpipe.cli.ingest import ingest as run_ingest

    if mailbox is not None and mailbox_per_folder:
        raise BadInput("--mailbox and --mailbox-per-folder: give one of them")
    loose: list[Rejected] = []
    try:
        if mailbox_per_folder:
            sources, loose = by_mailbox(paths)
        else:
            sources = {mailboxes.stored(mailbox): list(paths)}
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
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
        report = IngestReport.combined(
            run_ingest(
                res,
                group,
                enqueue=not no_enqueue,
                on_progress=lambda n: progress.advance(task, n),
                follow_symlinks=follow_symlinks,
                lane=Lane(lane),
                mailbox=name,
            )
            for name, group in sources.items()
        )
    report.rejected[:0] = loose
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


@click.command()
@email_filters
@click.option(
    "--before", metavar="EMAIL_ID", help="The next page: emails older than this id (as printed)."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="As JSON: the page's rows (email_id, received_at, sender, subject, lane, mailbox, "
    "state, error_class, needs_review) and next_before.",
)
def find(text: str | None, review: bool | None, as_json: bool, **options: str | None) -> None:
    """Find emails, newest first, 50 a page: every filter given at once. TEXT is what the
    console's search box takes: an email id, a <Message-ID>, a sender's address, or subject
    words."""
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
        "mailbox",
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
            Text(row["mailbox"]),
            row["state"],
            row["error_class"] or "",
        )
    console.print(table)
    if found.next_before is not None:
        click.echo(f"more: the same filters with --before {found.next_before}")


@click.command()
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


@click.command()
@click.argument("lane", type=_LANES)
@click.argument("email_ids", nargs=-1, type=int, required=True)
def lane(lane: str, email_ids: tuple[int, ...]) -> None:
    """Move emails to a lane: their next job goes in it (a job already queued stays put)."""
    from mailpipe.broker.queues import Lane
    from mailpipe.operations import actions

    done = actions.move(context.migrated(), email_ids, Lane(lane), user=context.user())
    click.echo(f"moved {len(done.done)} to {lane}")
    name_refused(done.refused, "moved")


@click.command()
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
