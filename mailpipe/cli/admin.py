"""Setting mailpipe up and serving it: `mailpipe db upgrade`, `web`, `web-token` and `demo`.

What a command needs beyond click, rich and the resources it imports when it runs: `main.py`
says why.
"""

from __future__ import annotations

import hashlib
import secrets
import sys

import click

from mailpipe.cli.exits import BadInput
from mailpipe.cli.output import console
from mailpipe.resources import get_resources


@click.group()
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


@click.command()
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


@click.command("web-token")
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
    if not name.replace("-", "").replace("_", "").isalnum():
        raise BadInput("a token's name is letters, digits, - and _")
    token = secrets.token_urlsafe(32)
    click.echo(f"token (give it to the caller; it is not kept): {token}")
    click.echo(
        f"MAILPIPE_WEB_TOKENS entry: {name}:{role}:{hashlib.sha256(token.encode()).hexdigest()}"
    )


@click.command()
@click.option("--keep", is_flag=True, help="Keep the demo's folder instead of deleting it.")
def demo(keep: bool) -> None:
    """Run the bundled sample emails through a real prefork worker and summarise."""
    from mailpipe.cli.demo import run_demo

    sys.exit(run_demo(console, keep=keep))
