"""The `mailpipe` command line (DESIGN: Command line)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import select

from mailpipe.resources import get_resources

console = Console(stderr=False)


@click.group()
def main() -> None:
    """mailpipe: process stored emails with a Celery worker fleet."""


@main.group()
def db() -> None:
    """The database schema."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Create or upgrade the schema (Alembic); the release role runs this before a rollout."""
    from mailpipe.migrate import upgrade

    upgrade(get_resources().settings.database_url, revision)
    console.print(f"database at {revision}")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--no-enqueue", is_flag=True, help="Store only; the sweeper enqueues later.")
def ingest(paths: tuple[Path, ...], no_enqueue: bool) -> None:
    """Store .eml files, folders, mbox files and Maildir folders, then enqueue one job each."""
    from mailpipe.ingest import ingest as run_ingest

    res = get_resources()
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
            res, paths, enqueue=not no_enqueue, on_progress=lambda n: progress.advance(task, n)
        )
    # Plain lines, never wrapped: scripts read this summary.
    click.echo(
        f"stored {report.stored}, enqueued {report.enqueued}, already queued "
        f"{report.already_queued}, rejected {len(report.rejected)}"
    )
    for rejected in report.rejected:
        click.echo(f"  rejected {rejected.source}: {rejected.reason}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object (the status contract).")
def status(as_json: bool) -> None:
    """Emails, runs by status, review count, queue depth and the last sweep."""
    from mailpipe.status import fleet_status

    data = fleet_status(get_resources())
    if as_json:
        click.echo(json.dumps(data))
        return
    table = Table(title="mailpipe status", show_header=False)
    table.add_row("emails", str(data["emails"]))
    table.add_row("no run yet", str(data["no_run"]))
    for name, count in data["runs"].items():
        table.add_row(f"runs {name}", str(count))
    table.add_row("needs review", str(data["needs_review"]))
    table.add_row("queue depth", str(data["queue"]["depth"]))
    age = data["queue"]["oldest_age_s"]
    table.add_row("oldest job age", "-" if age is None else f"{age:.1f} s")
    table.add_row("model calls", "on" if data["model_calls"] else "off")
    sweep = data["last_sweep"]
    if sweep:
        table.add_row(
            "last sweep",
            f"{sweep['finished_at']}: re-added {sweep['readded_no_run']} without run, "
            f"{sweep['readded_stalled']} stalled; {sweep['marked_for_review']} marked for review",
        )
    console.print(table)


@main.command()
@click.option("--retry", "retry_ids", multiple=True, type=int, metavar="EMAIL_ID")
@click.option("--retry-all", is_flag=True, help="Reopen and re-enqueue every failed run.")
@click.option("--limit", default=50, show_default=True)
def failed(retry_ids: tuple[int, ...], retry_all: bool, limit: int) -> None:
    """List failed runs, or reopen and re-enqueue them."""
    from mailpipe.enqueue import enqueue_emails
    from mailpipe.models import PipelineRun, RunStatus
    from mailpipe.pipeline import runs

    res = get_resources()
    if retry_ids or retry_all:
        with res.db.transaction() as session:
            if retry_all:
                retry_ids = tuple(
                    session.scalars(
                        select(PipelineRun.email_id).where(PipelineRun.status == RunStatus.FAILED)
                    )
                )
            reopened = [email_id for email_id in retry_ids if runs.reopen(session, email_id)]
        result = enqueue_emails(reopened, res)
        click.echo(f"reopened {len(reopened)}, enqueued {len(result.sent)}")
        return
    with res.db.session() as session:
        rows = session.execute(
            select(PipelineRun.email_id, PipelineRun.attempts, PipelineRun.closed_at, PipelineRun.error)
            .where(PipelineRun.status == RunStatus.FAILED)
            .order_by(PipelineRun.closed_at.desc())
            .limit(limit)
        ).all()
    table = Table("email", "attempts", "failed at", "error", title="failed runs")
    for row in rows:
        table.add_row(str(row.email_id), str(row.attempts), str(row.closed_at), row.error or "")
    console.print(table)


@main.command("model-calls")
@click.argument("state", type=click.Choice(["on", "off"]), required=False)
def model_calls(state: str | None) -> None:
    """Show or switch model calls; workers read the switch per job, no restart needed."""
    from mailpipe import flags

    res = get_resources()
    if state is None:
        with res.db.session() as session:
            console.print("on" if flags.model_calls_enabled(session) else "off")
        return
    with res.db.transaction() as session:
        flags.set_model_calls(session, state == "on")
    console.print(f"model calls {state}")
    if state == "on":
        from mailpipe.tasks import sweep

        # Waiting runs should not wait for the next scheduled sweep.
        sweep.apply_async()
        console.print("sweep enqueued")


@main.command()
def sweep() -> None:
    """Run one sweep now, in this process, and print what it did."""
    from mailpipe.tasks import run_sweep

    result = run_sweep(get_resources())
    if not result.ran:
        console.print("another sweep is running; nothing done")
        return
    click.echo(json.dumps(result.summary()))


@main.command()
@click.argument("email_id", type=int)
def show(email_id: int) -> None:
    """An email's run, documents, labels, classification and history, as JSON."""
    from mailpipe.status import email_detail

    with get_resources().db.session() as session:
        detail = email_detail(session, email_id)
    if detail is None:
        raise click.ClickException(f"no email with id {email_id}")
    click.echo(json.dumps(detail, indent=2))


@main.command()
@click.option("--keep", is_flag=True, help="Keep the demo's folder instead of deleting it.")
def demo(keep: bool) -> None:
    """Run the bundled sample emails through a real prefork worker and summarise."""
    from mailpipe.demo import run_demo

    sys.exit(run_demo(console, keep=keep))
if __name__ == "__main__":
    main()
