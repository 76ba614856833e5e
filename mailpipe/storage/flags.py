"""Durable runtime switches, kept in the database so that a broker flush cannot flip them: model
calls on or off, and the stages and mailboxes an operator paused."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from mailpipe.storage.db import insert_ignore, upsert
from mailpipe.storage.models import MailboxPause, OperatorPause, RuntimeFlag, utcnow

MODEL_CALLS = "model_calls"


def model_calls_enabled(session: Session) -> bool:
    """Read at job time, so `mailpipe model-calls on` needs no restart. Off until switched on."""
    enabled = session.scalar(select(RuntimeFlag.enabled).where(RuntimeFlag.name == MODEL_CALLS))
    return bool(enabled)


def set_model_calls(session: Session, enabled: bool) -> None:
    upsert(
        session,
        RuntimeFlag,
        [{"name": MODEL_CALLS, "enabled": enabled, "updated_at": utcnow()}],
        ["name"],
    )


def operator_pauses(session: Session, *, hold: bool = False) -> dict[str, tuple[str, float]]:
    """The stages an operator paused: each stage's reason and since when (unix time). `hold`
    keeps a resume of any of them waiting until the session ends: what is written from them
    then cannot outlive the resume."""
    query = select(OperatorPause.stage, OperatorPause.reason, OperatorPause.since)
    if hold:
        query = query.with_for_update(read=True)
    return {
        stage: (reason, since.replace(tzinfo=UTC).timestamp())
        for stage, reason, since in session.execute(query)
    }


def set_operator_pause(session: Session, stage: str, reason: str, since: float) -> None:
    """Keep `stage`'s operator pause (`since`: unix time); one kept already stays as it is."""
    started = datetime.fromtimestamp(since, UTC).replace(tzinfo=None)
    insert_ignore(
        session, OperatorPause, [{"stage": stage, "reason": reason, "since": started}], ["stage"]
    )


def clear_operator_pause(session: Session, stage: str) -> None:
    session.execute(delete(OperatorPause).where(OperatorPause.stage == stage))


def mailbox_pauses(session: Session, *, hold: bool = False) -> dict[str, tuple[str, float]]:
    """The mailboxes an operator paused, by the name shown: each one's reason and since when
    (unix time). `hold` as for `operator_pauses`."""
    query = select(MailboxPause.mailbox, MailboxPause.reason, MailboxPause.since)
    if hold:
        query = query.with_for_update(read=True)
    return {
        mailbox: (reason, since.replace(tzinfo=UTC).timestamp())
        for mailbox, reason, since in session.execute(query)
    }


def set_mailbox_pause(session: Session, mailbox: str, reason: str, since: float) -> float:
    """Keep the pause of `mailbox` (the name shown); one kept already stays as it is. Returns
    the kept pause's start (unix time)."""
    started = datetime.fromtimestamp(since, UTC).replace(tzinfo=None)
    insert_ignore(
        session,
        MailboxPause,
        [{"mailbox": mailbox, "reason": reason, "since": started}],
        ["mailbox"],
    )
    kept = session.scalar(select(MailboxPause.since).where(MailboxPause.mailbox == mailbox))
    assert kept is not None
    return kept.replace(tzinfo=UTC).timestamp()


def clear_mailbox_pause(session: Session, mailbox: str) -> bool:
    """End the kept pause of `mailbox`; False when none was kept."""
    deleted = session.execute(
        delete(MailboxPause).where(MailboxPause.mailbox == mailbox).returning(MailboxPause.mailbox)
    )
    return deleted.first() is not None


class CachedModelCalls:
    """The model-calls flag as a job process sees it: read at most every `max_age` seconds
    (MAILPIPE_MODEL_CALLS_CACHE_SECONDS), so that most jobs send one statement fewer."""

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self._value = False
        self._read_at: float | None = None

    def __call__(self, session: Session) -> bool:
        if self._read_at is None or time.monotonic() - self._read_at >= self.max_age:
            return self.fresh(session)
        return self._value

    def fresh(self, session: Session) -> bool:
        """The flag read now, whatever the cache's age; the cache keeps it."""
        self._value = model_calls_enabled(session)
        self._read_at = time.monotonic()
        return self._value
