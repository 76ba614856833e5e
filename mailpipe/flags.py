"""Durable runtime switches, kept in the database so that a broker flush cannot flip them."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from mailpipe.db import upsert
from mailpipe.models import RuntimeFlag, utcnow

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
