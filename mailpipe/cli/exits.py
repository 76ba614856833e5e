"""The exit kinds: what an operator can act on ends in one line on stderr ("Error: ...") and the
exit code of its kind (0 is done, 1 a bug, printed with its traceback), listed in `mailpipe
--help`. `main.py` maps the errors of settings and services to them; the commands raise them."""

from __future__ import annotations

import click


class BadInput(click.ClickException):
    exit_code = 2  # click's own code for a usage error


class NotFound(click.ClickException):
    exit_code = 3


class Unavailable(click.ClickException):
    exit_code = 4


class NoSchema(click.ClickException):
    exit_code = 5
