"""Step 7: classify the email and keep what the model said.

The model call happens outside any database transaction: it may take seconds, and a transaction
held open that long blocks SQLite writers and ties up a PostgreSQL connection.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from mailpipe.broker.queues import Lane
from mailpipe.classifiers import (
    ClassificationResult,
    Classifier,
    DocumentText,
    EmailForClassifier,
    LabelScore,
)
from mailpipe.classifiers.prompt import MAX_RECIPIENTS
from mailpipe.coordination.ratelimit import Ceiling, FleetRateLimiter
from mailpipe.mail.parse import ParsedEmail
from mailpipe.pipeline import emails
from mailpipe.storage.db import upsert
from mailpipe.storage.models import Classification, utcnow


def email_for_classifier(
    parsed: ParsedEmail, documents: tuple[DocumentText, ...], budget: int
) -> EmailForClassifier:
    """What a classifier reads. No text is longer than `budget` characters, the most a prompt
    takes of the email's text in all (MAILPIPE_CLASSIFIER_TEXT_BUDGET), and no more recipients
    are kept than a prompt lists, so what is kept between the stages stays small however large
    the email."""
    return EmailForClassifier(
        subject=parsed.subject[:budget],
        sender=parsed.sender[:budget],
        recipients=tuple(recipient[:budget] for recipient in parsed.recipients[:MAX_RECIPIENTS]),
        more_recipients=max(0, len(parsed.recipients) - MAX_RECIPIENTS),
        date=None if parsed.date is None else parsed.date[:budget],
        body_text=parsed.body_text[:budget],
        documents=tuple(
            DocumentText(d.filename, d.content_type, d.text[:budget]) for d in documents
        ),
    )


def classify_remote(
    classifier: Classifier,
    email: EmailForClassifier,
    limiter: FleetRateLimiter,
    wait: float,
    lane: Lane = Lane.LIVE,
    ceiling: Ceiling | None = None,
) -> ClassificationResult:
    """Call a remote classifier inside a fleet-wide rate-limit slot, taken in the call's `lane`
    and, with a `ceiling`, as its mailbox's ceiling allows.

    Raises `RateLimited` when no slot comes free within `wait` seconds, or the ceiling refuses.
    """
    with limiter.slot(wait=wait, lane=lane, ceiling=ceiling):
        return classifier.classify(email)


def store_classification(
    session: Session, run_id: int, email_id: int, result: ClassificationResult
) -> None:
    """One row per run: a re-run replaces the answer instead of adding a second one.

    An answer with entries left out (`dropped_labels`) puts the email up for review in the same
    transaction: the labels kept may miss one that fits. The reason gives the count, not the
    labels, which the email may have dictated; the row's `output` holds the answer as given.
    """
    upsert(
        session,
        Classification,
        [
            {
                "run_id": run_id,
                "email_id": email_id,
                "model_id": result.model_id,
                "prompt_version": result.prompt_version,
                "output": result.output,
                "labels": [[score.label, score.confidence] for score in result.labels],
                "input_tokens": result.input_tokens,
                "output_tokens": result.output_tokens,
                "latency_ms": result.latency_ms,
                "created_at": utcnow(),
            }
        ],
        ["run_id"],
    )
    if result.dropped_labels:
        emails.mark_for_review(
            session,
            [email_id],
            f"the model answered {result.dropped_labels} labels outside MAILPIPE_LABELS or "
            "without a confidence from 0 to 1; they were dropped and the rest kept",
        )


def stored_result(session: Session, run_id: int) -> ClassificationResult:
    """The answer an earlier attempt of the run stored, as the classifier gave it. Its count of
    dropped labels is not kept: the email was put up for review when the answer was stored."""
    row = session.scalars(select(Classification).where(Classification.run_id == run_id)).one()
    return ClassificationResult(
        labels=tuple(LabelScore(label, confidence) for label, confidence in row.labels or ()),
        model_id=row.model_id,
        prompt_version=row.prompt_version,
        output=row.output,
        input_tokens=row.input_tokens,
        output_tokens=row.output_tokens,
        latency_ms=row.latency_ms,
    )
