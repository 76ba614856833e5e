"""Step 7, last part: make the email's model labels match the classification.

Labels from other sources (people, upstream rules) are never touched: only rows with source
"model" are added, updated or removed here.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.orm import Session

from mailpipe.classifiers import LabelScore
from mailpipe.storage.db import insert_ignore
from mailpipe.storage.models import EmailLabel, table

MODEL_SOURCE = "model"
_LABEL = table(EmailLabel)
_LABELS_OF = select(_LABEL.c.label, _LABEL.c.source).where(
    _LABEL.c.email_id == bindparam("labels_email_id")
)


def sync_model_labels(session: Session, email_id: int, scores: Iterable[LabelScore]) -> None:
    wanted = {score.label: score.confidence for score in scores}
    rows = session.execute(_LABELS_OF, {"labels_email_id": email_id})
    existing = {label: source for label, source in rows}
    stale = [
        label
        for label, source in existing.items()
        if source == MODEL_SOURCE and label not in wanted
    ]
    if stale:
        session.execute(
            delete(_LABEL).where(_LABEL.c.email_id == email_id, _LABEL.c.label.in_(stale))
        )
    kept = [
        {"label_": label, "confidence": confidence}
        for label, confidence in wanted.items()
        if existing.get(label) == MODEL_SOURCE
    ]
    if kept:
        session.execute(
            update(_LABEL)
            .where(_LABEL.c.email_id == email_id, _LABEL.c.label == bindparam("label_"))
            .values(confidence=bindparam("confidence")),
            kept,
        )
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
