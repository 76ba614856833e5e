"""Step 7, last part: make the email's model labels match the classification.

Labels from other sources (people, upstream rules) are never touched: only rows with source
"model" are added, updated or removed here.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from mailpipe.classifiers import LabelScore
from mailpipe.storage.db import insert_ignore
from mailpipe.storage.models import EmailLabel

MODEL_SOURCE = "model"


def sync_model_labels(session: Session, email_id: int, scores: Iterable[LabelScore]) -> None:
    wanted = {score.label: score.confidence for score in scores}
    existing = {
        row.label: row
        for row in session.scalars(select(EmailLabel).where(EmailLabel.email_id == email_id))
    }
    stale = [
        label
        for label, row in existing.items()
        if row.source == MODEL_SOURCE and label not in wanted
    ]
    if stale:
        session.execute(
            delete(EmailLabel).where(EmailLabel.email_id == email_id, EmailLabel.label.in_(stale))
        )
    for label, confidence in wanted.items():
        row = existing.get(label)
        if row is not None and row.source == MODEL_SOURCE:
            row.confidence = confidence
    insert_ignore(
        session,
        EmailLabel,
        [
            {"email_id": email_id, "label": label, "source": MODEL_SOURCE, "confidence": confidence}
            for label, confidence in wanted.items()
            if label not in existing
        ],
        ["email_id", "label"],
    )
