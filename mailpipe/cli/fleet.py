"""The fleet: `mailpipe status`, `pause` and `resume` of a stage or a mailbox, the
`model-calls` switch, and one `sweep` or `housekeeping` pass now.

What a command needs beyond click, rich and the resources it imports when it runs: `main.py`
says why.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.table import Table
from rich.text import Text

from mailpipe.cli import context
from mailpipe.cli.exits import BadInput
from mailpipe.cli.output import console
from mailpipe.resources import get_resources


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object (the status contract).")
def status(as_json: bool) -> None:
    """Emails, runs by status, review count, each queue, the live workers, the last sweep and
    the mailboxes with the most waiting work."""
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
    for held in data["paused_mailboxes"]:
        table.add_row(
            f"mailbox {held['mailbox']}",
            f"PAUSED since {held['since']}: {held['reason']}; {held['waiting']} waiting",
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
    waiting = data["mailboxes"]
    if waiting["top"]:
        mailboxes = Table(
            title=f"mailboxes with waiting work: {waiting['waiting']}, the most first",
            title_justify="left",
        )
        mailboxes.add_column("mailbox")
        mailboxes.add_column("waiting", justify="right")
        mailboxes.add_column("oldest", justify="right")
        for row in waiting["top"]:
            # A name as given upstream, never read as rich's markup.
            mailboxes.add_row(
                Text(row["mailbox"]), str(row["waiting"]), f"{row['oldest_age_s']:.0f} s"
            )
        console.print(mailboxes)


def _count(n: int, estimated: bool) -> str:
    return f"about {n} (PostgreSQL's estimate)" if estimated else str(n)


_STAGES = click.Choice(["cpu", "model"])


_MAILBOX = click.option(
    "--mailbox",
    help='A mailbox instead of a stage, by name ("default" for the default mailbox).',
)


def _one_of(stage: str | None, mailbox: str | None) -> None:
    if (stage is None) == (mailbox is None):
        raise BadInput("give a STAGE or --mailbox NAME, one of them")


@click.command()
@click.argument("stage", type=_STAGES, required=False)
@_MAILBOX
@click.option(
    "--reason",
    default="paused by an operator",
    show_default=True,
    help="Why, as status shows it.",
)
def pause(stage: str | None, mailbox: str | None, reason: str) -> None:
    """Pause a stage: its workers stop taking its work until `mailpipe resume STAGE`. Or pause a
    mailbox (`--mailbox NAME`): its jobs wait, claiming nothing, until `mailpipe resume
    --mailbox NAME` sends them again; the other mailboxes' go on."""
    from mailpipe.broker.queues import Stage
    from mailpipe.operations import actions

    _one_of(stage, mailbox)
    if mailbox is not None:
        try:
            kept = actions.pause_mailbox(context.migrated(), mailbox, reason, user=context.user())
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        console.print(f"mailbox {kept.mailbox} paused: {kept.reason}")
        return
    assert stage is not None
    held = actions.pause(get_resources(), Stage(stage), reason, user=context.user())
    console.print(f"{stage} stage paused ({held.by}): {held.error}")


@click.command()
@click.argument("stage", type=_STAGES, required=False)
@_MAILBOX
def resume(stage: str | None, mailbox: str | None) -> None:
    """End a stage's pause, an operator's or one an outage caused; or a mailbox's
    (`--mailbox NAME`), sending its waiting jobs again."""
    from mailpipe.broker.queues import Stage
    from mailpipe.enqueue import sender
    from mailpipe.operations import actions

    _one_of(stage, mailbox)
    if mailbox is not None:
        res = context.migrated()
        try:
            done = actions.resume_mailbox(res, mailbox, enqueue=sender(res), user=context.user())
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        was = "resumed" if done.was_paused else "was not paused"
        console.print(f"mailbox {mailbox} {was}; {done.enqueued} job(s) sent")
        return
    assert stage is not None
    ended = actions.resume(get_resources(), Stage(stage), user=context.user())
    console.print(f"{stage} stage resumed" if ended else f"{stage} stage was not paused")


@click.command("model-calls")
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


@click.command()
def sweep() -> None:
    """Run one sweep now, in this process, and print what it did (JSON)."""
    from mailpipe.app.tasks import run_sweep

    result = run_sweep(context.migrated())
    if not result.ran:
        console.print("another sweep is running; nothing done")
        return
    click.echo(json.dumps(result.summary()))


@click.command()
def housekeeping() -> None:
    """Run one housekeeping pass now, in this process, and print what it deleted (JSON): what
    beat's lock holder does every MAILPIPE_HOUSEKEEPING_INTERVAL seconds."""
    from mailpipe.operations.housekeeping import prune

    click.echo(json.dumps(asdict(prune(context.migrated()))))
