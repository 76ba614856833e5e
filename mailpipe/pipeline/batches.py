"""The bulk lane's model stage through Bedrock batch inference (docs/batch.md).

- **Waiting.** A model-stage delivery of the bulk lane, with batches on, calls no model: its
  claim is given back and a `model_batch_record` row says the run waits for a batch
  (`waits_for_batch`, the one call job.py makes). The run has no job of its own; the sweeper
  leaves it alone.
- **Forming and submitting.** Beat's leader (`tick`) forms batches of the waiting records, up to
  MAILPIPE_MODEL_BATCH_SIZE, once that many wait or the oldest has waited
  MAILPIPE_MODEL_BATCH_WAIT, never fewer than MAILPIPE_MODEL_BATCH_MIN; writes each batch's
  JSONL under the blob prefix's `batch/` and creates its job, with a token of its own so that a
  leader that dies between the two and its successor create one job. A leftover under the
  minimum that has waited MAILPIPE_MODEL_BATCH_MAX_WAIT goes through real-time Converse: its
  model stage is sent as any other, and its record says so. Nothing is submitted while model
  calls are off or the model stage is paused, and no email of a paused mailbox.
- **Following and applying.** The leader reads each job's status. A completed job's records are
  applied one email at a time, as a `converse` answer is: under the email's lease and a claim of
  the run (mailpipe.pipeline.runs), the classification stored, the labels synced, the run closed
  and the record deleted, in one transaction. A leader that dies mid-apply, or two at once,
  apply nothing twice: an applied email has no record left in the batch, and a claim fences off
  any other writer. A record without an answer is its email's failed attempt, and the record
  waits for the next batch. A job that failed, stopped or expired sends its records back to
  wait; no run fails for it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from redis import RedisError
from sqlalchemy import ColumnElement, delete, exists, func, or_, select, update
from sqlalchemy.orm import Session

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane, Stage, TaskName
from mailpipe.broker.sending import Enqueue, Place, in_lanes
from mailpipe.classifiers import input_from_json
from mailpipe.classifiers.batch import COMPLETED, ENDED, BatchModel, job_id
from mailpipe.coordination import leases
from mailpipe.coordination.leases import LeaseHeld
from mailpipe.errors import BatchUnanswered, MailpipeError, PermanentError, describe, error_class
from mailpipe.pipeline import mailbox_pauses, policy, runs, stage_pauses
from mailpipe.pipeline.classify import store_classification
from mailpipe.pipeline.labels import sync_model_labels
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import (
    BatchState,
    EmailMessage,
    ModelBatch,
    ModelBatchRecord,
    ModelInput,
    PipelineRun,
    RunStatus,
    utcnow,
)

log = logging.getLogger(__name__)

INPUT_NAME = "records.jsonl"
_OPEN = (BatchState.FORMING, BatchState.SUBMITTED, BatchState.APPLYING)
_RECORD = ModelBatchRecord


def waits_for_batch(res: Resources, session: Session, claim: runs.Claim, lane: Lane) -> bool:
    """Whether this model-stage delivery's run waits for a batch rather than calling the model;
    if so, its claim is given back in `session`'s transaction. Live mail never waits, nor a run
    whose leftover was sent through real-time."""
    if lane is not Lane.BULK or not res.settings.model_batch_on or not res.classifier.remote:
        return False
    record = session.get(_RECORD, claim.email_id, with_for_update=True)
    if record is None:
        session.add(_RECORD(email_id=claim.email_id, realtime=False, since=utcnow()))
    elif record.realtime:
        return False
    elif record.batch_id is not None and _batch_state(session, record.batch_id) not in _OPEN:
        record.batch_id = None  # a run reopened after its batch: it waits for the next one
    runs.give_back(session, claim, error="waits for a model batch")
    return True


@dataclass
class TickResult:
    """What one pass of the leader did."""

    formed: int = 0
    submitted: int = 0
    applied: int = 0  # emails whose answer was applied
    unanswered: int = 0  # emails whose record had no answer: a failed attempt each
    ended: int = 0  # jobs that failed, stopped or expired
    realtime: int = 0  # leftovers sent through real-time


def tick(res: Resources, enqueue: Enqueue, model: BatchModel) -> TickResult:
    """One pass of beat's leader: follow the jobs out, apply those completed, submit the batches
    formed, form new ones. Idempotent; a pass cut short is finished by the next."""
    result = TickResult()
    _forget_closed(res)
    with res.db.session() as session:
        open_batches = session.execute(
            select(ModelBatch.id, ModelBatch.state)
            .where(ModelBatch.state.in_(_OPEN))
            .order_by(ModelBatch.id)
        ).all()
    for batch_id, state in open_batches:
        if state is BatchState.SUBMITTED:
            _follow(res, model, batch_id, result)
        elif state is BatchState.APPLYING:
            _apply(res, model, batch_id, result)
    if not _may_submit(res):
        return result
    for batch_id, state in open_batches:
        if state is not BatchState.FORMING:
            continue
        if res.settings.model_batch_on:
            _submit(res, model, batch_id, result)
        else:
            _end(res, batch_id, None, "never submitted: batches were switched off")
    _form(res, model, enqueue, result)
    return result


def _may_submit(res: Resources) -> bool:
    """Batches are submitted, and leftovers sent, only with model calls on and the model stage
    not paused."""
    with res.db.session() as session:
        if not flags.model_calls_enabled(session):
            return False
    return Stage.MODEL not in stage_pauses.in_force(res)


def _forget_closed(res: Resources) -> None:
    """Records of runs closed by other means (a real-time leftover answered, an operator's
    dismiss, a delivery of the release before) wait for nothing."""
    with res.db.transaction() as session:
        session.execute(
            delete(_RECORD)
            .where(
                exists().where(
                    PipelineRun.email_id == _RECORD.email_id,
                    PipelineRun.status != RunStatus.OPEN,
                )
            )
            .execution_options(synchronize_session=False)
        )


def _form(res: Resources, model: BatchModel, enqueue: Enqueue, result: TickResult) -> None:
    """Form batches of the waiting records while enough wait, or send a leftover through
    real-time; with batches switched off, every waiting record goes through real-time."""
    settings = res.settings
    now = utcnow()
    unheld = _of_mailboxes_not_paused(res)
    while True:
        leftover: list[int] = []
        with res.db.transaction() as session:
            waiting = session.execute(
                select(_RECORD.email_id, _RECORD.since)
                .join(EmailMessage, EmailMessage.id == _RECORD.email_id)
                .where(_RECORD.batch_id.is_(None), _RECORD.realtime.is_(False), *unheld)
                .order_by(_RECORD.since, _RECORD.email_id)
                .limit(settings.model_batch_size)
                .with_for_update(of=_RECORD, skip_locked=True)
            ).all()
            if not waiting:
                return
            waited = (now - waiting[0].since).total_seconds()
            enough = len(waiting) >= settings.model_batch_min
            if not settings.model_batch_on or (
                not enough and waited >= settings.model_batch_max_wait
            ):
                leftover = [row.email_id for row in waiting]
                places = _realtime(session, leftover)
            elif len(waiting) >= settings.model_batch_size or (
                enough and waited >= settings.model_batch_wait
            ):
                batch_id = _formed(session, [row.email_id for row in waiting])
            else:
                return
        if leftover:
            # After the commit that says so: a leftover's model stage is sent through real-time.
            result.realtime += len(in_lanes(enqueue, leftover, places, TaskName.CLASSIFY_EMAIL))
            if len(leftover) < settings.model_batch_size:
                return
        else:
            result.formed += 1
            _submit(res, model, batch_id, result)


def _of_mailboxes_not_paused(res: Resources) -> list[ColumnElement[bool]]:
    """What keeps the emails of paused mailboxes out of a batch: their work waits for the
    resume, as their jobs do."""
    held = {mailboxes.stored(name) for name in mailbox_pauses.in_force(res)}
    column = EmailMessage.mailbox
    named = sorted(name for name in held if name is not None)
    unheld = [or_(column.is_(None), column.not_in(named))] if named else []
    return [*unheld, column.is_not(None)] if None in held else unheld


def _formed(session: Session, email_ids: list[int]) -> int:
    """A batch of these records, to be submitted."""
    batch = ModelBatch(
        state=BatchState.FORMING, input_key="", output_key="", records=len(email_ids)
    )
    session.add(batch)
    session.flush()
    batch.input_key = f"batch/{batch.id}/input/{INPUT_NAME}"
    batch.output_key = f"batch/{batch.id}/output/"
    session.execute(
        update(_RECORD).where(_RECORD.email_id.in_(email_ids)).values(batch_id=batch.id)
    )
    return batch.id


def _realtime(session: Session, email_ids: list[int]) -> dict[int, Place]:
    """Mark the leftovers for real-time, and where their jobs go."""
    session.execute(update(_RECORD).where(_RECORD.email_id.in_(email_ids)).values(realtime=True))
    rows = session.execute(
        select(EmailMessage.id, EmailMessage.lane, EmailMessage.mailbox).where(
            EmailMessage.id.in_(email_ids)
        )
    )
    return {row.id: Place(row.lane, row.mailbox) for row in rows}


def _submit(res: Resources, model: BatchModel, batch_id: int, result: TickResult) -> None:
    """Write the batch's input and create its job; a batch whose job could not be created stays
    formed, and the next pass tries again with the same token."""
    with res.db.session() as session:
        batch = session.get_one(ModelBatch, batch_id)
        inputs = session.execute(
            select(_RECORD.email_id, ModelInput.input)
            .join(ModelInput, ModelInput.email_id == _RECORD.email_id)
            .where(_RECORD.batch_id == batch_id)
            .order_by(_RECORD.email_id)
        ).all()
        input_key, output_key, created = batch.input_key, batch.output_key, batch.created_at
    lines = [
        json.dumps(
            {
                "recordId": record_id(email_id),
                "modelInput": model.model_input(input_from_json(data)),
            }
        )
        for email_id, data in inputs
    ]
    stamp = int(created.timestamp())
    try:
        res.blobs.put(input_key, ("\n".join(lines) + "\n").encode())
        arn = model.submit(
            name=f"mailpipe-batch-{batch_id}-{stamp}",
            token=f"mailpipe-batch-{batch_id}-{stamp}",
            input_uri=_uri(res, input_key),
            output_uri=_uri(res, output_key),
        )
    except (ClientError, BotoCoreError, MailpipeError) as exc:
        log.warning(
            "model batch %s: not submitted, the next pass tries again: %s", batch_id, describe(exc)
        )
        return
    with res.db.transaction() as session:
        session.execute(
            update(ModelBatch)
            .where(ModelBatch.id == batch_id, ModelBatch.state == BatchState.FORMING)
            .values(state=BatchState.SUBMITTED, job_arn=arn, submitted_at=utcnow())
        )
    log.info("model batch %s: submitted as job %s, %d records", batch_id, job_id(arn), len(lines))
    result.submitted += 1


def _follow(res: Resources, model: BatchModel, batch_id: int, result: TickResult) -> None:
    with res.db.session() as session:
        batch = session.get_one(ModelBatch, batch_id)
        arn = batch.job_arn
        left = session.scalar(select(func.count()).where(_RECORD.batch_id == batch_id))
    assert arn is not None
    try:
        if not left:
            # Every run of the batch was closed by other means: its answers are of no use.
            _stop(model, batch_id, arn)
            _end(res, batch_id, "Stopped", "no run waits for its answers")
            result.ended += 1
            return
        status = model.status(arn)
    except (ClientError, BotoCoreError) as exc:
        log.warning("model batch %s: job %s not read: %s", batch_id, job_id(arn), describe(exc))
        return
    if status.status in ENDED:
        _end(res, batch_id, status.status, status.message)
        result.ended += 1
        return
    state = BatchState.APPLYING if status.status in COMPLETED else BatchState.SUBMITTED
    with res.db.transaction() as session:
        session.execute(
            update(ModelBatch)
            .where(ModelBatch.id == batch_id, ModelBatch.state == BatchState.SUBMITTED)
            .values(state=state, job_status=status.status)
        )
    if state is BatchState.APPLYING:
        _apply(res, model, batch_id, result)


def _stop(model: BatchModel, batch_id: int, arn: str) -> None:
    """Stop a job whose answers nobody waits for; one that ended meanwhile needs no stop."""
    try:
        model.stop(arn)
    except (ClientError, BotoCoreError) as exc:
        log.warning("model batch %s: job %s not stopped: %s", batch_id, job_id(arn), describe(exc))


def _end(res: Resources, batch_id: int, status: str | None, message: str | None) -> None:
    """A job that failed, stopped or expired, or a batch never submitted (`status` None): its
    records wait for the next batch, as they were (their wait still counts from when it
    began), and its objects are deleted."""
    with res.db.transaction() as session:
        batch = session.get_one(ModelBatch, batch_id, with_for_update=True)
        if batch.state not in (BatchState.FORMING, BatchState.SUBMITTED):
            return
        session.execute(update(_RECORD).where(_RECORD.batch_id == batch_id).values(batch_id=None))
        batch.state, batch.job_status, batch.error = BatchState.ENDED, status, message
        batch.finished_at = utcnow()
        keys = batch.input_key, batch.output_key
    log.warning("model batch %s: the job ended %s; its records wait again", batch_id, status)
    _delete_objects(res, batch_id, *keys)


def _apply(res: Resources, model: BatchModel, batch_id: int, result: TickResult) -> None:
    """Apply a completed job's answers; the batch is done once no record is left in it."""
    with res.db.session() as session:
        batch = session.get_one(ModelBatch, batch_id)
        arn, input_key, output_key = batch.job_arn, batch.input_key, batch.output_key
        members = list(
            session.scalars(select(_RECORD.email_id).where(_RECORD.batch_id == batch_id))
        )
    assert arn is not None
    try:
        output = res.blobs.get(f"{output_key}{job_id(arn)}/{INPUT_NAME}.out")
    except MailpipeError as exc:
        if not isinstance(exc, PermanentError):
            log.warning("model batch %s: output not read: %s", batch_id, describe(exc))
            return
        output = b""  # no output at all: every record is unanswered
    answers = _answers(output)
    left = False
    for email_id in members:
        outcome = _apply_one(res, model, batch_id, email_id, answers.get(email_id))
        if outcome is None:
            left = True
        elif outcome:
            result.applied += 1
        else:
            result.unanswered += 1
    if left:
        return  # a lease held, a dead attempt ended: the next pass applies the rest
    with res.db.transaction() as session:
        batch = session.get_one(ModelBatch, batch_id, with_for_update=True)
        if batch.state is not BatchState.APPLYING:
            return
        batch.state, batch.finished_at = BatchState.DONE, utcnow()
        batch.answered = sum(1 for line in answers.values() if "modelOutput" in line)
        batch.unanswered = batch.records - batch.answered
    log.info("model batch %s: applied", batch_id)
    _delete_objects(res, batch_id, input_key, output_key)


def _answers(output: bytes) -> dict[int, dict[str, Any]]:
    """The output's lines by email id; a line that cannot be read counts as no answer."""
    found: dict[int, dict[str, Any]] = {}
    for raw in output.splitlines():
        try:
            line = json.loads(raw)
            email_id = int(line["recordId"])
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(line, dict):
            found[email_id] = line
    return found


def _apply_one(
    res: Resources,
    model: BatchModel,
    batch_id: int,
    email_id: int,
    line: dict[str, Any] | None,
) -> bool | None:
    """Apply one record, as a model-stage delivery would its answer: True when its answer was
    applied (or the run needs none any more), False when it had none (a failed attempt), None
    when it cannot be applied yet."""
    settings = res.settings
    limits = policy.Limits.of(settings)
    try:
        with leases.hold(res.redis, email_id, settings.lease_ttl, settings.dedup_ttl):
            with res.db.transaction() as session:
                record = session.get(_RECORD, email_id, with_for_update=True)
                if record is None or record.batch_id != batch_id:
                    return True  # applied already, by this leader or another
                claim = runs.claim(session, email_id, limits, stage=Stage.MODEL)
                if isinstance(claim, runs.Refused) and claim.reason is runs.Refusal.UNFINISHED:
                    return None  # the claim ended a dead attempt; the next pass claims
                if not isinstance(claim, runs.Claim):
                    session.delete(record)  # closed, failed or gone: nothing to apply
                    return True
                output = None if line is None else line.get("modelOutput")
                if isinstance(output, dict):
                    _answer(session, model, claim, output)
                    session.delete(record)
                    return True
                if runs.record_failed_attempt(
                    session,
                    claim,
                    _unanswered(batch_id, line),
                    limits,
                    error_class=BatchUnanswered.__name__,
                ):
                    session.delete(record)  # its attempts are used up: the run failed
                else:
                    record.batch_id = None  # it waits for the next batch
                return False
    except (LeaseHeld, RedisError, runs.Superseded):
        return None


def _answer(session: Session, model: BatchModel, claim: runs.Claim, output: dict[str, Any]) -> None:
    """The record's answer, stored and synced as a `converse` answer is; an answer that cannot
    be read fails the run, as it does there."""
    try:
        result = model.result(output)
    except PermanentError as exc:
        runs.close(
            session, claim, RunStatus.FAILED, error=describe(exc), error_class=error_class(exc)
        )
        return
    runs.mark_classified(session, claim)
    store_classification(session, claim.run_id, claim.email_id, result)
    runs.close(session, claim, RunStatus.SUCCEEDED)
    sync_model_labels(session, claim.email_id, result.labels)


def _unanswered(batch_id: int, line: dict[str, Any] | None) -> str:
    """Why a record has no answer, by the error's code only: its message may quote the input."""
    error = None if line is None else line.get("error")
    code = error.get("errorCode") if isinstance(error, dict) else None
    if line is None:
        return f"model batch {batch_id}: its record has no line in the job's output"
    return f"model batch {batch_id}: its record has no answer (error code {code})"


def _delete_objects(res: Resources, batch_id: int, input_key: str, output_key: str) -> None:
    """The batch's input and output hold the emails' text: deleted once they are of no use."""
    try:
        res.blobs.delete(input_key)
        res.blobs.delete_under(output_key)
    except MailpipeError as exc:
        log.warning("model batch %s: objects not deleted: %s", batch_id, describe(exc))


def _batch_state(session: Session, batch_id: int) -> BatchState | None:
    return session.scalar(select(ModelBatch.state).where(ModelBatch.id == batch_id))


def _uri(res: Resources, key: str) -> str:
    return f"{res.settings.blob_url.rstrip('/')}/{key}"


def record_id(email_id: int) -> str:
    """A record's id in the JSONL: the email's id, as the 11 characters Bedrock documents."""
    return f"{email_id:011d}"
