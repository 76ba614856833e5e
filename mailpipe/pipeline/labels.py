"""Step 7, last part: make the email's model labels match the classification, and its copies'.

Labels from other sources (people, upstream rules) are never touched: only rows with source
"model" are added, updated or removed on the email, and only rows with source "origin" on its
copies. A copy (docs/mailboxes.md, "Copies in several mailboxes") is never classified: it shows
its origin's model labels as "origin" rows, given when its run ends `duplicate` (`copy_labels`)
and synced with the origin's whenever those change (`sync_model_labels`), each in one statement
per act however many copies there are.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

from sqlalchemy import ColumnElement, and_, bindparam, delete, exists, select, update
from sqlalchemy.orm import Session, aliased

from mailpipe.classifiers import LabelScore
from mailpipe.storage.db import dialect_insert, insert_ignore
from mailpipe.storage.models import (
    MODEL_SOURCE,
    ORIGIN_SOURCE,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    table,
    utcnow,
)

_LABEL = table(EmailLabel)
_EMAIL = table(EmailMessage)
_LABELS_OF = select(_LABEL.c.label, _LABEL.c.source).where(
    _LABEL.c.email_id == bindparam("labels_email_id")
)
# The origin the email is the first of, locked for the copies' sync: a copy's job locks it too
# when it finds it (`origin.find_origin`), so that either the copy is linked before the sync
# reads the copies, or the copy reads the labels after the sync wrote them.
_LOCK_ORIGIN = (
    select(table(EmailOrigin).c.id)
    .where(table(EmailOrigin).c.first_email_id == bindparam("origin_first_id"))
    .with_for_update(key_share=True)
)


def sync_model_labels(
    session: Session, email_id: int, scores: Iterable[LabelScore], *, copies: bool = True
) -> None:
    """Make the email's model labels the classification's, then its copies' (unless `copies`
    is False: its origin was recorded in this transaction, and no copy can be linked to it
    yet, as a copy's insert of the same fingerprint waits for this one to commit)."""
    if copies:
        has_origin = session.execute(_LOCK_ORIGIN, {"origin_first_id": email_id}).first()
        copies = has_origin is not None
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
    if copies:
        _sync_copies(session, email_id, None)


def copy_labels(session: Session, copy_id: int, first_email_id: int) -> None:
    """Give a copy whose run ends `duplicate` here its origin's labels, as they are now; its
    origin is locked already (`origin.find_origin`)."""
    _sync_copies(session, first_email_id, copy_id)


def _sync_copies(session: Session, first_email_id: int, copy_id: int | None) -> None:
    """Make the "origin" labels of the first email's copies (of the one `copy_id`, when given)
    model ones, in two statements: the stale removed, the missing added and the changed
    updated. A copy's label from another source is left as it is."""
    given = {"first_email_id": first_email_id, "copy_id": copy_id, "now": utcnow()}
    dialect = session.get_bind().dialect.name
    session.execute(_remove_stale(copy_id is not None), given)
    session.execute(_add_or_update(dialect, copy_id is not None), given)


def _copies(one: bool) -> list[ColumnElement[bool]]:
    copy = _EMAIL.c
    chosen = [copy.duplicate_of == bindparam("first_email_id")]
    if one:
        chosen.append(copy.id == bindparam("copy_id"))
    return chosen


@cache
def _remove_stale(one: bool) -> Any:
    shown = aliased(_LABEL)
    return delete(_LABEL).where(
        _LABEL.c.source == ORIGIN_SOURCE,
        _LABEL.c.email_id.in_(select(_EMAIL.c.id).where(*_copies(one))),
        ~exists().where(
            shown.c.email_id == bindparam("first_email_id"),
            shown.c.source == MODEL_SOURCE,
            shown.c.label == _LABEL.c.label,
        ),
    )


@cache
def _add_or_update(dialect: str, one: bool) -> Any:
    shown = aliased(_LABEL)
    rows = (
        select(
            _EMAIL.c.id,
            shown.c.label,
            bindparam("origin_source", ORIGIN_SOURCE),
            shown.c.confidence,
            bindparam("now", type_=_LABEL.c.created_at.type),
        )
        .join(shown, shown.c.email_id == _EMAIL.c.duplicate_of)
        .where(*_copies(one), shown.c.source == MODEL_SOURCE)
    )
    insert = dialect_insert(dialect)(_LABEL).from_select(
        ["email_id", "label", "source", "confidence", "created_at"], rows
    )
    return insert.on_conflict_do_update(
        index_elements=["email_id", "label"],
        set_={"confidence": insert.excluded.confidence},
        where=and_(
            _LABEL.c.source == ORIGIN_SOURCE,
            _LABEL.c.confidence.is_distinct_from(insert.excluded.confidence),
        ),
    )
