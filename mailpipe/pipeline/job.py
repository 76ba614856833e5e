"""One job, steps 2 to 7 of DESIGN: the whole of `process_email` that is not Celery.

`process_email` returns how the job ended, or raises:
- `RetryLater` after a transient error was recorded and attempts remain;
- `Deferred` when the job was throttled (no model-call slot, the provider's quota) and must come
  back later without its attempt being counted;
- `UnknownEmail` when there is no such email (nothing to record it on).
Permanent and unexpected errors and exhausted attempts end the run as `failed` with the error,
and return.
"""

from __future__ import annotations

import enum
import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from mailpipe import flags
from mailpipe.classifiers import ClassificationResult
from mailpipe.errors import PermanentError, Throttled, UnknownEmail, is_transient
from mailpipe.models import EmailMessage, PipelineRun, RunStatus
from mailpipe.pipeline import runs
from mailpipe.pipeline.classify import classify_remote, email_for_classifier, store_classification
from mailpipe.pipeline.documents import (
    convert_documents,
    document_rows,
    store_documents,
    texts_for_classifier,
)
from mailpipe.pipeline.labels import sync_model_labels
from mailpipe.pipeline.origin import record_origin
from mailpipe.pipeline.parse import ParseLimits, parse_email
from mailpipe.ratelimit import FleetRateLimiter
from mailpipe.resources import Resources

log = logging.getLogger(__name__)

# How long a job waits in its child for a model-call slot before it gives the child back and is
# re-queued instead.
SLOT_WAIT_S = 5.0


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    WAITING = "waiting"  # open: model calls are off
    FAILED = "failed"
    ALREADY_CLOSED = "already_closed"


class RetryLater(Exception):
    def __init__(self, error: str, attempt: int | None, retry_after: float | None = None) -> None:
        super().__init__(error)
        self.attempt = attempt
        self.retry_after = retry_after


class Deferred(Exception):
    def __init__(self, reason: str, delay: float) -> None:
        super().__init__(reason)
        self.delay = delay


def process_email(res: Resources, email_id: int) -> Outcome:
    settings = res.settings
    with res.db.transaction() as session:
        email = session.get(EmailMessage, email_id)
        if email is None:
            raise UnknownEmail(f"no email_message row with id {email_id}")
        blob_key = email.blob_key
        claim = runs.claim_attempt(session, email_id, settings.max_attempts)
    if claim.claim is runs.Claim.CLOSED:
        return Outcome.ALREADY_CLOSED
    if claim.claim is runs.Claim.EXHAUSTED:
        log.error("email %s: failed after %s attempts", email_id, claim.attempt)
        return Outcome.FAILED
    try:
        return _run_steps(res, email_id, blob_key)
    except Throttled as exc:
        with res.db.transaction() as session:
            runs.give_back_attempt(session, email_id)
        raise Deferred(str(exc), exc.retry_after or 1.0) from exc
    except PermanentError as exc:
        with res.db.transaction() as session:
            runs.close(session, email_id, RunStatus.FAILED, f"{type(exc).__name__}: {exc}")
        log.warning("email %s: failed: %s", email_id, exc)
        return Outcome.FAILED
    except Exception as exc:
        if is_transient(exc):
            return _after_transient(res, email_id, claim.attempt, exc)
        # A bug or an input no check foresaw: retrying cannot help. The run records it for the
        # failed list; the traceback goes to the log.
        log.exception("email %s: unexpected error", email_id)
        with res.db.transaction() as session:
            runs.close(session, email_id, RunStatus.FAILED, f"unexpected {type(exc).__name__}: {exc}")
        return Outcome.FAILED


def run_error(res: Resources, email_id: int) -> str | None:
    with res.db.session() as session:
        return session.scalar(select(PipelineRun.error).where(PipelineRun.email_id == email_id))


def _after_transient(res: Resources, email_id: int, attempt: int, exc: Exception) -> Outcome:
    error = f"{type(exc).__name__}: {exc}"
    retry_after = getattr(exc, "retry_after", None)
    try:
        with res.db.transaction() as session:
            may_retry = runs.record_failed_attempt(session, email_id, error, res.settings.max_attempts)
    except Exception as record_exc:
        if not is_transient(record_exc):
            raise
        # The database itself is out: retry on Celery's count; the sweeper covers the rest.
        raise RetryLater(error, None, retry_after) from exc
    if not may_retry:
        log.error("email %s: failed after %s attempts: %s", email_id, attempt, error)
        return Outcome.FAILED
    raise RetryLater(error, attempt, retry_after) from exc


def _run_steps(res: Resources, email_id: int, blob_key: str) -> Outcome:
    """Steps 3 to 7 in three transactions at most: origin, then documents with the outcome (with
    a local classifier), or documents, then the remote classifier's answer."""
    settings = res.settings
    raw = res.blobs.get(blob_key, max_bytes=settings.max_email_bytes)
    parsed = parse_email(
        raw,
        ParseLimits(
            max_bytes=settings.max_email_bytes,
            max_depth=settings.max_mime_depth,
            max_parts=settings.max_mime_parts,
            body_max_chars=settings.body_text_max_chars,
        ),
    )

    with res.db.transaction() as session:
        email = session.get_one(EmailMessage, email_id)
        origin = record_origin(session, email, parsed)
        if origin.duplicate_of is not None:
            runs.close(session, email_id, RunStatus.DUPLICATE)
            return Outcome.DUPLICATE

    documents = convert_documents(parsed, settings)
    rows = document_rows(res.blobs, email_id, documents, settings.doc_inline_text_bytes)
    email_text = email_for_classifier(parsed, texts_for_classifier(documents))
    with res.db.transaction() as session:
        store_documents(session, rows)
        if not flags.model_calls_enabled(session):
            runs.leave_open(session, email_id)
            return Outcome.WAITING
        if not res.classifier.remote:
            # A local classifier answers in well under a millisecond: no reason to hold the
            # documents' transaction open, nor to pay for a second one.
            _close_classified(session, email_id, res.classifier.classify(email_text))
            return Outcome.SUCCEEDED

    limiter = FleetRateLimiter(
        res.redis,
        rate_per_s=settings.model_rate_per_s,
        burst=settings.model_burst,
        max_in_flight=settings.model_max_in_flight,
    )
    result = classify_remote(res.classifier, email_text, limiter, wait=SLOT_WAIT_S)
    with res.db.transaction() as session:
        _close_classified(session, email_id, result)
    return Outcome.SUCCEEDED


def _close_classified(session: Session, email_id: int, result: ClassificationResult) -> None:
    run = runs.close(session, email_id, RunStatus.SUCCEEDED)
    store_classification(session, run.id, email_id, result)
    sync_model_labels(session, email_id, result.labels)
