"""Step 6: every attachment becomes a `document` row with its text.

Conversion runs outside any transaction (a document may take seconds); the rows are then upserted
by (email, part index) in one transaction, so running the step again leaves the same rows. Text
longer than `doc_inline_text_bytes` goes to blob storage under a key built from the ids.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from mailpipe.classifiers import DocumentText
from mailpipe.mail.documents import (
    ConvertedDocument,
    DocumentLimits,
    convert_attachment,
    document_for,
)
from mailpipe.mail.parse import Attachment, ParsedEmail
from mailpipe.settings import Settings
from mailpipe.storage.blobs import BlobStore
from mailpipe.storage.db import upsert
from mailpipe.storage.keys import document_text_key
from mailpipe.storage.models import Document, DocumentStatus, utcnow


def convert_documents(parsed: ParsedEmail, settings: Settings) -> list[ConvertedDocument]:
    limits = DocumentLimits.from_settings(settings)
    attachments = parsed.attachments[: settings.doc_max_per_email]
    converted = [convert_attachment(attachment, limits) for attachment in attachments]
    for attachment in parsed.attachments[settings.doc_max_per_email :]:
        converted.append(_over_count(attachment, settings.doc_max_per_email))
    return converted


def document_rows(
    blobs: BlobStore, email_id: int, documents: list[ConvertedDocument], inline_limit: int
) -> list[dict]:
    """The rows to store, long texts already written to blob storage (outside any transaction)."""
    rows = []
    for document in documents:
        text, text_key = document.text, None
        if text is not None and len(text.encode()) > inline_limit:
            text_key = document_text_key(email_id, document.part_index)
            blobs.put(text_key, text.encode())
            text = None
        rows.append(
            {
                "email_id": email_id,
                "part_index": document.part_index,
                "filename": document.safe_filename,
                "content_type": document.content_type[:255],
                "size": document.size,
                "sha256": document.sha256,
                "status": DocumentStatus(document.status),
                "text": text,
                "text_blob_key": text_key,
                "page_count": document.page_count,
                "error": document.error,
                "updated_at": utcnow(),
            }
        )
    return rows


def store_documents(session: Session, rows: list[dict]) -> None:
    upsert(session, Document, rows, ["email_id", "part_index"])


def texts_for_classifier(documents: list[ConvertedDocument]) -> tuple[DocumentText, ...]:
    return tuple(
        DocumentText(d.safe_filename, d.content_type, d.text)
        for d in documents
        if d.status == DocumentStatus.CONVERTED.value and d.text
    )


def _over_count(attachment: Attachment, max_per_email: int) -> ConvertedDocument:
    """Recorded, not converted: the email has more attachments than one job converts."""
    return document_for(
        attachment, "too_large", error=f"email has more than {max_per_email} attachments"
    )
