"""Queue and task names, used alike by code, the Procfile and the deploy files."""

from __future__ import annotations

import enum

from mailpipe.settings import Settings


class TaskName(str, enum.Enum):
    PROCESS_EMAIL = "mailpipe.process_email"
    SWEEP = "mailpipe.sweep"


def email_queue(settings: Settings) -> str:
    """One job per email; its depth and age are the fleet's backlog (MAILPIPE_QUEUE)."""
    return settings.queue


def control_queue(settings: Settings) -> str:
    """Sweeps and other housekeeping, on their own list so they never wait behind a backlog."""
    return f"{settings.queue}.control"
