"""`mailpipe forget`: erase emails everywhere, by id, Message-ID, sender or mailbox
(`mailpipe/operations/erasure.py`, docs/decisions/erasure.md).

What a command needs beyond click, rich and the resources it imports when it runs: `main.py`
says why.
"""

from __future__ import annotations

from typing import Any

import click

from mailpipe.cli import context
from mailpipe.cli.exits import BadInput, NotFound
from mailpipe.cli.output import YES, asked, name_refused


@click.command()
@click.argument("email_ids", nargs=-1, type=click.IntRange(min=1), metavar="[EMAIL_ID]...")
@click.option("--message-id", metavar="ID", help="Every email with this Message-ID.")
@click.option(
    "--sender",
    metavar="ADDRESS",
    help="Every email whose From holds this address (whole, in any case).",
)
@click.option(
    "--mailbox",
    metavar="NAME",
    help="Every email of this mailbox (default: those without one), a customer's whole account.",
)
@click.option(
    "--dry-run", is_flag=True, help="List what it would delete (ids, counts); change nothing."
)
@YES
def forget(
    email_ids: tuple[int, ...],
    message_id: str | None,
    sender: str | None,
    mailbox: str | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Erase emails everywhere: their rows, blobs, documents, labels, history and Redis state.
    Their origins pass to their next copy (one in another mailbox, for --mailbox), which keeps
    their labels and runs the steps a copy skips; their jobs in flight are fenced off. Each
    leaves one audit line (who, its id, the SHA-256 of its Message-ID). It cannot be undone."""
    from mailpipe.enqueue import sender as jobs_sender
    from mailpipe.operations import actions
    from mailpipe.operations.erasure import selection
    from mailpipe.operations.search import BadSearch

    named = (message_id, sender, mailbox)
    if sum((bool(email_ids), *(given is not None for given in named))) != 1:
        raise BadInput("give email ids, --message-id, --sender or --mailbox: one of them")
    filt = None
    if not email_ids:
        try:
            filt = selection(message_id, sender, mailbox)
        except BadSearch as exc:
            raise BadInput(str(exc)) from None
    res = context.migrated()
    planned = actions.forget(
        res, email_ids or None, filt, enqueue=jobs_sender(res), user="", dry_run=True
    )
    if not planned.email_ids:
        if planned.refused:
            raise NotFound(f"no email with id {' '.join(map(str, planned.refused))}")
        note = "" if mailbox else " (Message-ID and sender find only emails a job has read)"
        click.echo("no email found" + note)
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
