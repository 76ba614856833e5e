"""Erasure: what `mailpipe forget` deletes of an email, and in which order
(docs/decisions/erasure.md). `mailpipe.operations.actions.forget` chooses the emails, takes them
in batches and leaves the audit line.

A batch is forgotten in five steps, each harmless to do again, so that a forget cut short is
finished by running it again:

1. The fence, in Redis (`mailpipe.coordination.forgotten`): a job in flight checks it before it
   writes a blob, and deletes what it wrote when it finds itself fenced off.
2. The runs closed, in a transaction of their own (`interventions.close_to_forget`), with the fence's
   row in the database (`forgotten_email`), which a job asks where Redis has no fence (a Redis
   restarted without its data): a delivery in flight is fenced off at its next write and none
   claims another attempt. Committed before the rows are locked for deletion, so that no
   delivery holds a run while it waits for those rows.
3. The blobs: each raw email that no other email is stored as (raw emails are stored by their
   hash, so a copy delivered twice shares one), and the folder of its document texts.
4. The rows, in one transaction: every table that names the email, its origin handed on to its
   next copy or deleted with its last one. The copy an origin passes to has only ever been a
   copy: it takes the labels of the email forgotten and its run is reopened (`interventions.reopen_copies`)
   to run the steps it skipped, its job sent once this commits. The stored filters of the
   release before's reprocesses are emptied (`reprocess.search`), as they may name the sender.
5. What Redis keeps of it, the fence aside.
"""

from __future__ import annotations

import email.parser
import email.policy
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from email.utils import getaddresses, parseaddr
from typing import Any, cast

from sqlalchemy import CursorResult, Delete, delete, func, select, update
from sqlalchemy.orm import Session

from mailpipe.broker.sending import Place
from mailpipe.coordination import forgotten
from mailpipe.errors import MailpipeError
from mailpipe.mail.headers import normalise_message_id
from mailpipe.operations.search import BadSearch, EmailFilter, read_search
from mailpipe.pipeline import emails, interventions
from mailpipe.resources import Resources
from mailpipe.storage.db import insert_ignore, upsert
from mailpipe.storage.keys import document_texts
from mailpipe.storage.models import (
    ORIGIN_SOURCE,
    Base,
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    ForgottenEmail,
    ModelBatchRecord,
    ModelInput,
    PipelineRun,
    Reprocess,
    RunAttempt,
    RunStatus,
    table,
    utcnow,
)

# What a run closed for a forget whose deletion did not follow says.
NOT_DELETED_YET = "closed to be forgotten, and not deleted yet: run `mailpipe forget` again"

# Every table whose rows name an email by `email_id`, in the order they are deleted (a run's
# attempts and answer before the run); then `email_origin` and the email's own row.
BY_EMAIL: tuple[type[Base], ...] = (
    RunAttempt,
    Classification,
    EmailLabel,
    Document,
    ModelInput,
    ModelBatchRecord,
    PipelineRun,
)


@dataclass
class Tally:
    """What is deleted (or, planned, would be)."""

    rows: Counter[str] = field(default_factory=Counter)  # per table
    blobs: int = 0
    redis: int = 0  # keys and sorted-set members
    handed_on: int = 0  # origins that pass to their next copy
    # The copies that become their origin's first email and run the steps a copy skips, each
    # with the labels of the email forgotten until its own answer replaces them.
    completed: list[int] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.rows.update(other.rows)
        self.blobs += other.blobs
        self.redis += other.redis
        self.handed_on += other.handed_on
        self.completed += other.completed


def selection(
    message_id: str | None = None, sender: str | None = None, mailbox: str | None = None
) -> EmailFilter:
    """The filter of a forget by Message-ID, by sender or by mailbox, one of them, read as the
    search reads them; a sender is one whole address, as a domain or a word would take far more
    than the one person's mail; a mailbox is a customer's whole account, its copies of emails
    that other mailboxes also hold among them. Raises BadSearch naming what is wrong."""
    if sum(given is not None for given in (message_id, sender, mailbox)) != 1:
        raise BadSearch("give a Message-ID, a sender's address or a mailbox, one of them")
    if mailbox is not None:
        filt = read_search({"mailbox": mailbox})[0]
    elif sender is not None:
        address = parseaddr(sender)[1]
        local, at, domain = address.partition("@")
        if address != sender.strip() or not (local and at and domain) or "@" in domain:
            raise BadSearch("sender is one whole address, as name@example.org")
        filt = read_search({"sender": address})[0]
    else:
        filt = read_search({"message_id": message_id or ""})[0]
    # Blank text is no filter, which would find every email.
    if filt == EmailFilter():
        raise BadSearch("the Message-ID, sender or mailbox given is blank")
    return filt


def chosen(
    session: Session, filt: EmailFilter, after: int, limit: int
) -> tuple[list[int], int | None]:
    """Of the next `limit` emails `filt` finds above id `after`, in id order, those to forget,
    and the last id read (None: there are no more). With a sender, only the emails whose From
    holds that address (the search's sender is text anywhere in the header)."""
    postgresql = session.get_bind().dialect.name == "postgresql"
    found = session.execute(
        select(EmailMessage.id, EmailMessage.sender)
        .where(*filt.where(full_text=postgresql), EmailMessage.id > after)
        .order_by(EmailMessage.id)
        .limit(limit)
    ).all()
    if not found:
        return [], None
    email_ids = [
        email_id
        for email_id, sender in found
        if filt.sender is None or from_address(sender or "", filt.sender)
    ]
    return email_ids, found[-1].id


def from_address(sender: str, address: str) -> bool:
    """Whether a From header holds `address`, as a whole address in any case."""
    return any(found.casefold() == address.casefold() for _, found in getaddresses([sender]))


def existing(session: Session, email_ids: list[int]) -> list[int]:
    return list(
        session.scalars(
            select(EmailMessage.id).where(EmailMessage.id.in_(email_ids)).order_by(EmailMessage.id)
        )
    )


def plan(res: Resources, email_ids: list[int], chosen_ids: set[int], batch: int) -> Tally:
    """What forgetting `email_ids` would delete, counted in batches: their rows, the origins that
    go with them (none of whose emails is left out of `chosen_ids`, every email to forget), the
    blobs their rows name, and what Redis keeps of them."""
    tally = Tally()
    for start in range(0, len(email_ids), batch):
        chunk = email_ids[start : start + batch]
        with res.db.session() as session:
            tally.rows["email_message"] += len(chunk)
            # A run each: forget creates the missing ones to close them, then deletes them.
            tally.rows["pipeline_run"] += len(chunk)
            for model in BY_EMAIL:
                if model is not PipelineRun:
                    column = table(model).c.email_id
                    tally.rows[model.__tablename__] += (
                        session.scalar(select(func.count()).where(column.in_(chunk))) or 0
                    )
            gone, heirs = _origins_ending(session, chunk, chosen_ids)
            tally.rows["email_origin"] += len(gone)
            tally.handed_on += len(heirs)
            tally.completed += _copies(session, heirs)
            stored = _stored(session, chunk, chosen_ids)
        tally.blobs += len(stored.raw_keys) + stored.texts
        tally.redis += forgotten.count(res.redis, chunk)
    return tally


@dataclass(frozen=True)
class Erased:
    email_ids: list[int]  # the emails forgotten, of those asked for
    tally: Tally
    # The SHA-256 of each one's Message-ID (normalised, as origins keep it), None for an email
    # without one: what the audit line keeps of it.
    message_ids: dict[int, str | None]
    places: dict[int, Place] = field(default_factory=dict)  # of each copy in `tally.completed`


def erase(res: Resources, email_ids: list[int], chosen_ids: set[int] | None = None) -> Erased:
    """Forget the emails among `email_ids` (a batch: their rows are locked in one transaction),
    in the module's five steps; `chosen_ids`: every email the forget takes, this batch's and
    later ones', none of which an origin is handed on to while another email is left."""
    forgotten.fence(res.redis, email_ids, forgotten.fence_ttl(res.settings))
    with res.db.transaction() as session:
        found = existing(session, email_ids)
        if found:
            now = utcnow()
            upsert(
                session,
                ForgottenEmail,
                [{"email_id": email_id, "forgotten_at": now} for email_id in found],
                ["email_id"],
            )
            interventions.close_to_forget(session, found, NOT_DELETED_YET)
    if not found:
        return Erased([], Tally(), {})
    tally = Tally()
    with res.db.session() as session:
        stored = _stored(session, found, set(found))
    message_ids = {
        email_id: _sha256(
            stored.message_ids[email_id]
            if email_id in stored.message_ids
            else _read_message_id(res, key)
        )
        for email_id, key in stored.blob_keys.items()
    }
    for key in stored.raw_keys:
        res.blobs.delete(key)
    tally.blobs = len(stored.raw_keys) + sum(
        res.blobs.delete_under(document_texts(email_id)) for email_id in found
    )
    with res.db.transaction() as session:
        tally.rows, tally.handed_on, tally.completed = _delete_rows(
            session, found, (chosen_ids or set()) | set(found)
        )
        places = emails.places(session, tally.completed)
    tally.redis = forgotten.clear(res.redis, found)
    return Erased(found, tally, message_ids, places)


@dataclass(frozen=True)
class _Stored:
    blob_keys: dict[int, str]  # each email's raw blob
    raw_keys: list[str]  # the raw blobs no email outside the chosen ones is stored as
    texts: int  # document texts the rows name
    message_ids: dict[int, str | None]  # the Message-ID of each email a job has read


def _stored(session: Session, email_ids: list[int], chosen_ids: set[int]) -> _Stored:
    email, origin = EmailMessage, EmailOrigin
    blob_keys = dict(
        session.execute(select(email.id, email.blob_key).where(email.id.in_(email_ids))).all()
    )
    shared = {
        key
        for email_id, key in session.execute(
            select(email.id, email.blob_key).where(email.blob_key.in_(set(blob_keys.values())))
        )
        if email_id not in chosen_ids
    }
    texts = session.scalar(
        select(func.count()).where(
            Document.email_id.in_(email_ids), Document.text_blob_key.is_not(None)
        )
    )
    message_ids: dict[int, str | None] = dict(
        session.execute(
            select(email.id, origin.message_id)
            .join(origin, origin.id == email.origin_id)
            .where(email.id.in_(email_ids))
        ).all()
    )
    return _Stored(blob_keys, sorted(set(blob_keys.values()) - shared), texts or 0, message_ids)


def _origins_ending(
    session: Session, email_ids: list[int], chosen_ids: set[int]
) -> tuple[list[int], list[int]]:
    """The origins of these emails that none of their emails outside `chosen_ids` is left to
    keep, and the emails the others pass to from one of these emails: their next copy."""
    ids = _origins_of(session, email_ids)
    left: dict[int, int] = {}
    for origin_id, email_id in session.execute(
        select(EmailMessage.origin_id, EmailMessage.id)
        .where(EmailMessage.origin_id.in_(ids), EmailMessage.id.not_in(chosen_ids))
        .order_by(EmailMessage.id)
    ):
        if origin_id is not None:
            left.setdefault(origin_id, email_id)
    firsts = dict(
        session.execute(
            select(EmailOrigin.id, EmailOrigin.first_email_id).where(EmailOrigin.id.in_(ids))
        ).all()
    )
    heirs = sorted(heir for i, heir in left.items() if firsts.get(i) in chosen_ids)
    return sorted(set(ids) - set(left)), heirs


def _copies(session: Session, email_ids: list[int]) -> list[int]:
    """The emails among these whose run ended as a copy's (`duplicate`)."""
    return sorted(
        session.scalars(
            select(PipelineRun.email_id).where(
                PipelineRun.email_id.in_(email_ids), PipelineRun.status == RunStatus.DUPLICATE
            )
        )
    )


def _origins_of(session: Session, email_ids: list[int]) -> list[int]:
    """The origins these emails belong to, or were first seen as."""
    belong = select(EmailMessage.origin_id).where(
        EmailMessage.id.in_(email_ids), EmailMessage.origin_id.is_not(None)
    )
    first = select(EmailOrigin.id).where(EmailOrigin.first_email_id.in_(email_ids))
    found = {i for i in session.scalars(belong) if i is not None}
    return sorted(found | set(session.scalars(first)))


def _delete_rows(
    session: Session, email_ids: list[int], chosen_ids: set[int]
) -> tuple[Counter[str], int, list[int]]:
    """Delete every row of the emails, their runs closed already (`interventions.close_to_forget`): an
    origin first seen as one of them passes to its next copy (the lowest id, of those not in
    `chosen_ids` if any is left), which the other copies then point at; one with no other email
    left is deleted. A copy an origin passes to whose run ended as a copy's takes the labels of
    the email forgotten and is reopened (`interventions.reopen_copies`): it runs the steps it skipped, and
    is never left without labels meanwhile. Returns the rows deleted per table, the origins
    handed on and the copies reopened.

    Locked in this order: the origins, then the emails. A job of another copy that links it to
    one of these origins holds that copy's row and waits for the origin, then for its first
    email; with the origin locked first, it waits before it holds anything this needs."""
    email, origin = EmailMessage, EmailOrigin
    origin_ids = _origins_of(session, email_ids)
    firsts = dict(
        session.execute(
            select(origin.id, origin.first_email_id)
            .where(origin.id.in_(origin_ids))
            .order_by(origin.id)
            .with_for_update()
        ).all()
    )
    session.execute(select(email.id).where(email.id.in_(email_ids)).with_for_update())
    left: dict[int, list[int]] = {}
    for origin_id, email_id in session.execute(
        select(email.origin_id, email.id)
        .where(email.origin_id.in_(origin_ids), email.id.not_in(email_ids))
        .order_by(email.id)
    ):
        if origin_id is not None:
            left.setdefault(origin_id, []).append(email_id)
    handed_on = [origin_id for origin_id in left if firsts.get(origin_id) in email_ids]
    heirs = {}
    for origin_id in handed_on:
        staying = [i for i in left[origin_id] if i not in chosen_ids]
        heirs[origin_id] = (staying or left[origin_id])[0]
    # Their runs locked before their rows are written, as every transaction that locks both.
    completed = interventions.reopen_copies(
        session, [i for i in heirs.values() if i not in chosen_ids]
    )
    for origin_id, first in heirs.items():
        if first in completed:
            _take_labels(session, firsts[origin_id], first)
        copies = [i for i in left[origin_id] if i != first]
        session.execute(update(origin).where(origin.id == origin_id).values(first_email_id=first))
        session.execute(update(email).where(email.id == first).values(duplicate_of=None))
        if copies:
            session.execute(update(email).where(email.id.in_(copies)).values(duplicate_of=first))
    # A copy's pointers go first: its origin may be deleted below.
    session.execute(
        update(email).where(email.id.in_(email_ids)).values(origin_id=None, duplicate_of=None)
    )
    deleted: Counter[str] = Counter()
    ended = [origin_id for origin_id in origin_ids if origin_id not in left]
    deleted["email_origin"] = _deleted(session, delete(origin).where(origin.id.in_(ended)))
    for model in BY_EMAIL:
        column = table(model).c.email_id
        deleted[model.__tablename__] = _deleted(session, delete(model).where(column.in_(email_ids)))
    deleted["email_message"] = _deleted(session, delete(email).where(email.id.in_(email_ids)))
    _empty_stored_filters(session)
    return deleted, len(handed_on), completed


def _take_labels(session: Session, forgotten_id: int, copy_id: int) -> None:
    """The labels the email forgotten showed, given to its copy: the same email's, in place of
    those the copy showed as its copy (`ORIGIN_SOURCE`, the same labels of the model's),
    until the copy's own answer replaces the model's (`labels.sync_model_labels`). The other
    copies, now the copy's, go on showing them: they are its model's labels now."""
    session.execute(
        delete(EmailLabel).where(EmailLabel.email_id == copy_id, EmailLabel.source == ORIGIN_SOURCE)
    )
    shown = session.execute(
        select(EmailLabel.label, EmailLabel.source, EmailLabel.confidence).where(
            EmailLabel.email_id == forgotten_id
        )
    ).all()
    rows = [
        {"email_id": copy_id, "label": label, "source": source, "confidence": confidence}
        for label, source, confidence in shown
    ]
    insert_ignore(session, EmailLabel, rows, ["email_id", "label"])


def _empty_stored_filters(session: Session) -> None:
    """Empty the filters the release before stored with its reprocesses, which may name a
    sender or a subject; the names of their fields are kept (`reprocess.filters`). This release
    stores none, and the table holds one row per operator's reprocess."""
    for reprocess_id, search, filters in session.execute(
        select(Reprocess.id, Reprocess.search, Reprocess.filters)
    ).all():
        if search:
            names = filters if filters is not None else sorted(k for k, v in search.items() if v)
            session.execute(
                update(Reprocess)
                .where(Reprocess.id == reprocess_id)
                .values(search={}, filters=names)
            )


def _deleted(session: Session, statement: Delete) -> int:
    return cast(CursorResult[Any], session.execute(statement)).rowcount


def _sha256(message_id: str | None) -> str | None:
    return None if message_id is None else hashlib.sha256(message_id.encode()).hexdigest()


def _read_message_id(res: Resources, blob_key: str) -> str | None:
    """The Message-ID of an email no job has read (it has no origin), from its raw header;
    None when it has none or its blob cannot be read."""
    try:
        raw = res.blobs.get(blob_key, max_bytes=res.settings.max_email_bytes)
    except MailpipeError:
        return None
    head = email.parser.BytesHeaderParser(policy=email.policy.compat32).parsebytes(raw)
    value = head.get("Message-ID")
    return None if value is None else normalise_message_id(str(value))
