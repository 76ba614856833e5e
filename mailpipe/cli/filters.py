"""The options that choose failed runs and emails, given as text and read by
`mailpipe/operations/search.py` as the console's query is, so that every face refuses the same
values with the same reason."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from mailpipe.cli.exits import BadInput

# As the console's forms say it; `search.TIME_FORMAT` is the error's wording.
TIME = "an ISO 8601 date, or date and time: UTC unless it has an offset or Z"


def failed_filters(command: Any) -> Any:
    """The options that choose failed runs, for listing and acting alike: text, read by
    `search.read_failed` as the console's query is (`failed_filter`)."""
    for option in reversed(
        (
            click.option("--error-class", metavar="NAME", help="Only runs failed with this class."),
            click.option(
                "--stage",
                metavar="STAGE",
                help="Only runs failed at this stage: cpu (before the documents were stored) "
                "or model.",
            ),
            click.option(
                "--since", metavar="TIME", help=f"Only runs failed at or after this time ({TIME})."
            ),
            click.option(
                "--until", metavar="TIME", help=f"Only runs failed before this time ({TIME})."
            ),
            click.option(
                "--mailbox",
                metavar="NAME",
                help="Only runs of emails in this mailbox (default: those without one).",
            ),
        )
    ):
        command = option(command)
    return command


def failed_filter(ids: Sequence[int], options: dict[str, Any], dismissed: bool = False) -> Any:
    """The filter the options give, or BadInput saying why not, in the console's words; refused
    beside email ids, which name the runs already."""
    from mailpipe.operations import search
    from mailpipe.operations.status import FailedFilter

    given = {name: value for name, value in options.items() if value is not None}
    if dismissed:
        given["view"] = "dismissed"
    try:
        filt = search.read_failed(given)
    except search.BadSearch as exc:
        raise BadInput(str(exc)) from None
    if ids and filt != FailedFilter(dismissed=filt.dismissed):
        raise BadInput("email ids name the runs: the filters go with --retry-all or --all")
    return filt


def email_filters(command: Any) -> Any:
    """The search's filters, for finding emails and acting on what they find alike."""
    for option in reversed(
        (
            click.argument("text", required=False),
            click.option(
                "--message-id", metavar="ID", help="Only the emails with this Message-ID."
            ),
            click.option(
                "--sender", metavar="TEXT", help="Only emails whose From holds this (any case)."
            ),
            click.option(
                "--subject",
                metavar="WORDS",
                help="Only emails whose subject holds each word (any case).",
            ),
            click.option(
                "--since", metavar="TIME", help=f"Only emails received at or after this ({TIME})."
            ),
            click.option(
                "--until", metavar="TIME", help=f"Only emails received before this ({TIME})."
            ),
            click.option(
                "--state",
                metavar="STATE",
                help="Only emails whose run is in this state: no_run, open, succeeded, "
                "duplicate, failed (not dismissed), dismissed.",
            ),
            click.option(
                "--error-class", metavar="NAME", help="Only emails whose run has this error class."
            ),
            click.option("--label", metavar="LABEL", help="Only emails with this label."),
            click.option("--lane", metavar="LANE", help="Only emails in this lane: live or bulk."),
            click.option(
                "--review/--no-review",
                default=None,
                help="Only emails marked for review, or only those not marked.",
            ),
            click.option(
                "--mailbox",
                metavar="NAME",
                help="Only emails in this mailbox (default: those without one).",
            ),
        )
    ):
        command = option(command)
    return command


def email_filter(text: str | None, review: bool | None, options: dict[str, Any]) -> Any:
    """The search's filter and page position the options give, or BadInput saying why not."""
    from mailpipe.operations import search

    given = {name: value for name, value in options.items() if value is not None}
    if text is not None:
        given["q"] = text
    if review is not None:
        given["review"] = "yes" if review else "no"
    try:
        return search.read_search(given)
    except search.BadSearch as exc:
        raise BadInput(str(exc)) from None
