"""The `mailpipe` command line (docs/architecture.md; README: Command line): the group, and
the errors it turns into exit kinds (`exits.py`); the commands live in a module per area.

What an operator can act on (bad input, an unknown id, a service down, a database not migrated)
ends in one line on stderr and an exit code of its kind (listed in `mailpipe --help`), so that
scripts can tell them apart; only a bug prints a traceback.

Each command imports what it needs beyond click, rich and the resources when it runs: the
operations take half a second to import and the tasks two, so `mailpipe --help` loads none of
them and each command only what it uses (`tests/unit/test_layers.py` holds this module, and with
it every area module, to the base and the resources).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mailpipe.cli import admin, emails, failed, fleet, forget
from mailpipe.cli.exits import BadInput, NoSchema, Unavailable
from mailpipe.settings import get_settings


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
    # Imported here, as in `_as_failure`: kombu's and SQLAlchemy's imports are not free either.
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import OperationalError as DatabaseError

    from mailpipe.errors import TransientError
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


for command in (
    admin.db,
    emails.ingest,
    emails.lane,
    fleet.status,
    failed.failed,
    failed.dismiss,
    failed.review,
    emails.find,
    fleet.pause,
    fleet.resume,
    fleet.model_calls,
    fleet.sweep,
    fleet.housekeeping,
    emails.show,
    emails.reprocess,
    forget.forget,
    admin.web,
    admin.web_token,
    admin.demo,
):
    main.add_command(command)


if __name__ == "__main__":
    main(prog_name="mailpipe")
