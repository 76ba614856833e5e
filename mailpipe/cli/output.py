"""What the commands print and ask alike: the console, times as the tables show them, the
confirmation (`--yes`, or the operator's answer), and an action's refusals as exit kinds."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import click
from rich.console import Console

from mailpipe.cli.exits import BadInput, NotFound

console = Console(stderr=False)
T = TypeVar("T")

YES = click.option("--yes", is_flag=True, help="Do not ask for confirmation.")


def to_second(iso: str | None) -> str:
    """A time of the JSON rows as tables show it: to the second, the width the errors need."""
    return "" if iso is None else iso[: len("YYYY-MM-DDTHH:MM:SS")].replace("T", " ")


def asked(question: str) -> bool:
    """The operator's answer to `question`: no says so and does nothing (exit 0); no answer at
    all (no terminal on stdin, end of input, Ctrl-C) is refused, since a script says --yes."""
    try:
        if click.confirm(question):
            return True
    except click.exceptions.Abort:
        raise BadInput("no answer, so nothing done: --yes acts without asking") from None
    click.echo("nothing done")
    return False


def as_confirmed(act: Callable[[], T]) -> T:
    """`act`, or BadInput when it refused, nothing done: what it takes changed since it was
    confirmed (look again, and confirm that), or its filter or count is refused now."""
    from mailpipe.operations import actions

    try:
        return act()
    except actions.Refused as refused:
        raise BadInput(f"{refused}, so nothing done") from None


def name_refused(refused: dict[int, str], act: str) -> None:
    """The emails an action refused, each named on stderr with the reason; any makes the exit
    code NotFound's."""
    for email_id, reason in refused.items():
        click.echo(f"email {email_id}: not {act}, {reason}", err=True)
    if refused:
        sys.exit(NotFound.exit_code)
