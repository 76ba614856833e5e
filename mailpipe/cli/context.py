"""What a command runs with: this process's resources, once the database is known to be there
and migrated, and the operator who acts, as the actions' audit lines name them."""

from __future__ import annotations

import getpass
import logging

from mailpipe.resources import Resources, get_resources
from mailpipe.settings import get_settings


def migrated() -> Resources:
    """This process's resources, once the database is known to be there and migrated: a
    command finds out before it connects, so that no command but `db upgrade` creates one."""
    from mailpipe.storage.migrate import check_schema

    res = get_resources()
    check_schema(res.db)
    return res


def user() -> str:
    """Who acts, as the actions' audit lines name them (`cli:` and the OS user); the lines go to
    stderr, in the settings' log format, as the console's go to its log."""
    from mailpipe.app.logs import to_stderr

    to_stderr(logging.getLogger("mailpipe.operations.actions"), get_settings().log_format)
    return f"cli:{getpass.getuser()}"
