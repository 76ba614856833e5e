"""`mailpipe pause` and `resume` on the command line (click's runner, in this process): a stage
or a mailbox, one of them; a mailbox's name that no mailbox can have is refused without it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from mailpipe.cli import main as cli
from mailpipe.pipeline import mailbox_pauses

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def run(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def test_a_stage_or_a_mailbox_one_of_them(res) -> None:  # type: ignore[no-untyped-def]
    for command in ("pause", "resume"):
        for args in ((), ("cpu", "--mailbox", "acme")):
            refused = run(command, *args)
            assert refused.exit_code == 2, (command, args)
            assert refused.stderr == "Error: give a STAGE or --mailbox NAME, one of them\n"
    assert mailbox_pauses.in_force(res) == {}


def test_a_mailbox_is_paused_and_resumed_by_name(res) -> None:  # type: ignore[no-untyped-def]
    paused = run("pause", "--mailbox", "acme", "--reason", "runaway import")
    assert paused.exit_code == 0, paused.output
    assert paused.stdout == "mailbox acme paused: runaway import\n"
    assert set(mailbox_pauses.in_force(res)) == {"acme"}
    resumed = run("resume", "--mailbox", "acme")
    assert resumed.stdout == "mailbox acme resumed; 0 job(s) sent\n"
    assert mailbox_pauses.in_force(res) == {}

    bad = "x" * 201
    refused = run("pause", "--mailbox", bad)
    assert refused.exit_code == 2
    assert refused.stderr == "Error: a mailbox's name is over 200 characters\n"
