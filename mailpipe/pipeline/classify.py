"""Step 7: classify the email and keep what the model said.

The model call happens outside any database transaction: it may take seconds, and a transaction
held open that long blocks SQLite writers and ties up a PostgreSQL connection.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from mailpipe.classifiers import ClassificationResult, Classifier, DocumentText, EmailForClassifier
from mailpipe.db import upsert
from mailpipe.models import Classification, utcnow
from mailpipe.pipeline.parse import ParsedEmail
from mailpipe.ratelimit import FleetRateLimiter


def email_for_classifier(
    parsed: ParsedEmail, documents: tuple[DocumentText, ...]
) -> EmailForClassifier:
    return EmailForClassifier(
        subject=parsed.subject,
        sender=parsed.sender,
        recipients=parsed.recipients,
        date=parsed.date,
        body_text=parsed.body_text,
        documents=documents,
    )


def classify_remote(
    classifier: Classifier, email: EmailForClassifier, limiter: FleetRateLimiter, wait: float
) -> ClassificationResult:
    """Call a remote classifier inside a fleet-wide rate-limit slot.

    Raises `RateLimited` when no slot comes free within `wait` seconds.
    """
    with limiter.slot(wait=wait):
        return classifier.classify(email)


def store_classification(
    session: Session, run_id: int, email_id: int, result: ClassificationResult
) -> None:
    """One row per run: a re-run replaces the answer instead of adding a second one."""
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
                "input_tokens": result.input_tokens,
                "output_tokens": result.output_tokens,
                "latency_ms": result.latency_ms,
                "created_at": utcnow(),
            }
        ],
        ["run_id"],
    )
