"""What is left of a forgotten email (`mailpipe forget`): in every table, in the blob store and in
Redis, each looked for by the email's id rather than by a list of what forget deletes."""

from __future__ import annotations

import os
import uuid

from sqlalchemy import func, select

from mailpipe.resources import Resources
from mailpipe.storage.blobs import LocalBlobStore
from mailpipe.storage.models import Base, EmailMessage
from tests.support.emails import raw_email

# A document's text longer than MAILPIPE_DOC_INLINE_TEXT_BYTES (64 KiB) is stored as a blob.
LONG_TEXT = "pay by the end of the month. " * 3000


def with_document(
    sender: str = "billing@acme.example", subject: str = "Invoice", name: str = "Billing"
) -> bytes:
    """An email whose attached document's text goes to a blob of its own."""
    tag = uuid.uuid4().hex[:12]
    return raw_email(
        f"{subject} {tag}",
        sender=f"{name} <{sender}>",
        message_id=f"{tag}@acme.example",
        body="Amount due: 12 EUR, see the invoice",
        attachments=[("terms.txt", "text/plain", LONG_TEXT.encode())],
    )


def rows_naming(res: Resources, email_id: int) -> dict[str, int]:
    """Rows of every table that name the email: its own, and each row whose column refers to
    an email (a foreign key to `email_message.id`) with its id."""
    email_id_column = EmailMessage.__table__.c.id  # type: ignore[attr-defined]
    found: dict[str, int] = {}
    with res.db.session() as session:
        for table in Base.metadata.sorted_tables:
            for column in table.columns:
                names_email = column is email_id_column or any(
                    key.column is email_id_column for key in column.foreign_keys
                )
                if not names_email:
                    continue
                n = session.scalar(select(func.count()).where(column == email_id)) or 0
                if n:
                    found[f"{table.name}.{column.name}"] = n
    return found


def stored_keys(res: Resources) -> set[str]:
    """Every key in the blob store (the S3 bucket under its prefix, or the local folder)."""
    blobs = res.blobs
    if isinstance(blobs, LocalBlobStore):
        root = blobs.root
        return {os.path.relpath(path, root) for path in root.rglob("*") if path.is_file()}
    from mailpipe.storage.s3 import S3BlobStore

    assert isinstance(blobs, S3BlobStore)
    keys = set()
    pages = blobs.client.get_paginator("list_objects_v2").paginate(
        Bucket=blobs.bucket, Prefix=f"{blobs.prefix}/"
    )
    for page in pages:
        keys |= {
            found["Key"].removeprefix(f"{blobs.prefix}/") for found in page.get("Contents", [])
        }
    return keys


def redis_naming(res: Resources, email_id: int) -> set[str]:
    """This run's Redis keys named for the email (the tests' own fault keys aside), and the
    sorted sets that hold it as a member."""
    from mailpipe.coordination import redis_keys

    prefix = redis_keys.key("")
    named = set()
    for raw in res.redis.scan_iter(match=f"{prefix}*", count=1000):
        key = raw.decode()
        name = key.removeprefix(prefix)
        if name.startswith("test:"):
            continue
        parts = name.split(":")
        if str(email_id) in parts:
            named.add(name)
        elif res.redis.type(raw) == b"zset" and res.redis.zscore(raw, str(email_id)) is not None:
            named.add(f"{name} (member)")
    return named
