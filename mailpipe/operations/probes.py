"""The probe of a paused stage: one real call of the kind the fault refused.

For the CPU stage, the blob read of an email that hit the fault; for the model stage, the model
call of one; for both, the lock a claim takes on the email's run. A probe whose call the service answered (even with a verdict on the email itself: a
missing blob, an email over a limit) shows that the fleet may use the service again, and ends
the pause; one refused the same way keeps it. This module never imports Celery.
"""

from __future__ import annotations

import enum
import logging

from sqlalchemy import select

from mailpipe.broker.queues import Stage
from mailpipe.classifiers import input_from_json
from mailpipe.coordination import pauses
from mailpipe.errors import PermanentError, describe, is_fleet_fault
from mailpipe.resources import Resources
from mailpipe.storage.models import EmailMessage, ModelInput, PipelineRun

log = logging.getLogger(__name__)


class ProbeResult(enum.StrEnum):
    PASSED = "passed"  # the service answered: the pause is ended
    REFUSED = "refused"  # a fleet-wide fault again: the pause stays
    INCONCLUSIVE = "inconclusive"  # nothing to try, or another error: the pause stays


def probe(res: Resources, stage: Stage) -> ProbeResult:
    """Probe `stage` with the email that hit its fault last; end its pause if the call passes."""
    emails = pauses.faulted_emails(res.redis, stage)
    if not emails:
        return ProbeResult.INCONCLUSIVE
    try:
        tried = _call(res, stage, emails[0])
    except PermanentError:
        tried = True  # answered, about the email: the service is open to the fleet again
    except Exception as exc:
        if is_fleet_fault(exc):
            log.warning("%s stage still paused: the probe was refused: %s", stage, describe(exc))
            return ProbeResult.REFUSED
        log.warning("%s stage probe inconclusive: %s", stage, describe(exc))
        return ProbeResult.INCONCLUSIVE
    if not tried:
        return ProbeResult.INCONCLUSIVE
    pauses.resume(res.redis, stage)
    log.warning("%s stage resumed: the probe passed", stage)
    return ProbeResult.PASSED


def _call(res: Resources, stage: Stage, email_id: int) -> bool:
    """The stage's real call for `email_id`; False when the email gives nothing to call with.

    The run's row is locked first, in a transaction that is rolled back: FOR UPDATE needs the
    UPDATE privilege a claim needs, so a database that refuses the fleet's role keeps the pause
    rather than letting each probe end it."""
    with res.db.session() as session:
        session.execute(
            select(PipelineRun.id).where(PipelineRun.email_id == email_id).with_for_update()
        )
        if stage is Stage.MODEL:
            stored = session.get(ModelInput, email_id)
            model_input = None if stored is None else input_from_json(stored.input)
        else:
            blob_key = session.scalar(
                select(EmailMessage.blob_key).where(EmailMessage.id == email_id)
            )
    if stage is Stage.MODEL:
        if model_input is None:
            return False
        res.classifier.classify(model_input)
        return True
    if blob_key is None:
        return False
    res.blobs.get(blob_key, max_bytes=res.settings.max_email_bytes)
    return True
