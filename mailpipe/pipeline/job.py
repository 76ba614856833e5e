"""One email's job, the whole of it that is not Celery (docs/architecture.md).

The job has two stages, each a task of its own. `process_email` is the CPU stage: it parses the
email, records its origin, converts its documents and stores them with what the model will read.
`classify_email` is the model stage: it calls the model, stores the answer and syncs the labels.
A remote model is called only from the model stage, on the model role's threads, so that no
CPU-sized process waits on the model; a local classifier (`rules`) answers in the CPU stage at
once, as a hand-off would cost more than the answer. Each stage takes the email's lease, claims an
attempt, runs its steps and returns a `Verdict` (mailpipe.pipeline.policy): what happened, and for a retry, a deferral or a
hand-off what comes next. It raises nothing the task shell has to interpret; the shell maps the
verdict to Celery's actions in one place.

- Rejected input (`PermanentError`: no such email, not an email, over a limit, no blob) fails
  the run at once.
- A dependency's error (S3, the model, the database, Redis) is judged by that dependency's own
  check (mailpipe.pipeline.health). When the check fails too, it is an outage or a refusal of
  the whole fleet: the attempt is given back, the fault recorded in Redis, and the job waits;
  enough of them pause the stage (mailpipe.coordination.pauses), and a job of a paused stage
  goes back to its queue untouched. No run fails for an outage, however long. When the check
  passes, the error is the email's own: a failed attempt, below.
- Any other failed attempt (the email's own dependency error, the soft time limit, a bug no one
  foresaw) is recorded on the run and retried after an exponential backoff with jitter, until
  the attempts are used up; the hard time limit and a killed child count the same way, and
  wait out the same backoff, at the next claim.
- A job of a paused mailbox (`mailpipe pause --mailbox`) ends at once, claiming nothing: its
  marker is released, its run stays as it was, and the mailbox's resume sends it again
  (mailpipe.pipeline.mailbox_pauses). It never goes round the queues while it waits.
- A deferral (the lease held by a live delivery, the fleet's rate limit, the provider's
  throttling) waits without using an attempt, never longer than `MAILPIPE_RETRY_BACKOFF_MAX` at a
  time (so never past the visibility timeout), and fails the run once it has waited
  `MAILPIPE_MAX_DEFERRAL` in all.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

from redis import RedisError
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane, Stage, stage_queue
from mailpipe.classifiers import ClassificationResult, input_as_json, input_from_json
from mailpipe.coordination import deferrals, forgotten, leases, markers, pauses, shutdowns
from mailpipe.coordination.leases import LeaseHeld
from mailpipe.coordination.ratelimit import Ceiling, FleetRateLimiter, RateLimited
from mailpipe.errors import (
    Dependency,
    Throttled,
    dependency_of,
    describe,
    error_class,
    is_soft_time_limit,
    is_transient,
)
from mailpipe.mail.parse import ParsedEmail, ParseLimits, parse_email
from mailpipe.pipeline import (
    batches,
    emails,
    health,
    mailbox_pauses,
    policy,
    runs,
    stage_pauses,
)
from mailpipe.pipeline.classify import (
    classify_remote,
    email_for_classifier,
    store_classification,
    stored_result,
)
from mailpipe.pipeline.documents import (
    convert_documents,
    document_rows,
    store_documents,
    texts_for_classifier,
)
from mailpipe.pipeline.labels import copy_labels, sync_model_labels
from mailpipe.pipeline.origin import OriginResult, find_origin, link_to_origin
from mailpipe.pipeline.policy import Fault, Kind, Verdict
from mailpipe.resources import Resources
from mailpipe.storage.db import once_more_if_disconnected, upsert
from mailpipe.storage.models import ModelInput, RunStatus, utcnow

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ModelCall:
    """What a model-stage message says of its call's mailbox: its name as shown (None: not
    named) and the slot of its mailbox's ceiling the job holds (Redis time), if any."""

    mailbox: str | None = None
    mailbox_slot: float | None = None


def process_email(
    res: Resources,
    email_id: int,
    *,
    lane: Lane = Lane.LIVE,
    cut_off: float | None = None,
    deferred_since: float | None = None,
    mailbox: str | None = None,
) -> Verdict:
    """Run one delivery of the email's CPU stage.

    `lane`: the lane the delivery came in (its deferral is counted on that lane's queue).
    `cut_off`: this delivery replaces one killed by the hard time limit (its seconds).
    `deferred_since`: when the job was first deferred, carried by each deferred delivery.
    `mailbox`: the email's mailbox as the message names it (None: not named, read from the row
    when some mailbox is paused).
    """
    return _deliver(res, email_id, Stage.CPU, lane, cut_off, deferred_since, mailbox)


def classify_email(
    res: Resources,
    email_id: int,
    *,
    lane: Lane = Lane.LIVE,
    deferred_since: float | None = None,
    mailbox: str | None = None,
    mailbox_slot: float | None = None,
) -> Verdict:
    """Run one delivery of the email's model stage; `lane`: also the model call's lane at the
    fleet's rate limit.
    `mailbox`: the email's mailbox as the message names it (shown; None: not named, read from
    the row when a mailbox's ceiling is set); `mailbox_slot`: the slot of its mailbox's ceiling
    an earlier delivery was handed, which every follow-up keeps until it is given a new one."""
    call = ModelCall(mailbox, mailbox_slot)
    verdict = _deliver(res, email_id, Stage.MODEL, lane, None, deferred_since, mailbox, call)
    if verdict.follows_up and verdict.mailbox_slot is None and mailbox_slot is not None:
        return replace(verdict, mailbox_slot=mailbox_slot)
    return verdict


def _deliver(
    res: Resources,
    email_id: int,
    stage: Stage,
    lane: Lane,
    cut_off: float | None,
    deferred_since: float | None,
    mailbox: str | None,
    call: ModelCall | None = None,
) -> Verdict:
    """`call`: the model stage's, what its message says of the call's mailbox."""
    settings = res.settings
    if _mailbox_held(res, email_id, mailbox):
        return Verdict(Kind.HELD, error="its mailbox is paused")
    pause = _pause_in_force(res, stage)
    if pause is not None:
        # Taken before its worker stopped consuming the stage: back to the queue, untouched.
        return Verdict(
            Kind.PAUSED,
            error=f"the {stage} stage is paused: {pause.error}",
            deferred_since=deferred_since or time.time(),
        )
    try:
        with leases.hold(res.redis, email_id, settings.lease_ttl, settings.dedup_ttl) as lease:
            verdict = run_claimed(res, email_id, cut_off, stage, lane, deferred_since, call)
            lease.keep_marker = verdict.follows_up
    except LeaseHeld as held:
        verdict = Verdict(Kind.DEFER, held.wait, str(held))
    except RedisError as exc:
        verdict = Verdict(
            Kind.DEFER,
            _deferral_delay(res, deferred_since),
            f"Redis unavailable: {describe(exc)}",
            outage=Dependency.REDIS,
        )
    if verdict.kind is Kind.DEFER:
        return _deferral(res, email_id, stage_queue(stage, settings, lane), verdict, deferred_since)
    if verdict.kind is Kind.WAITING and _switched_on_since(res):
        return Verdict(Kind.HANDED_OFF)
    return verdict


def _switched_on_since(res: Resources) -> bool:
    """Whether model calls are on now, read afresh once the run waits for them and the lease is
    released. The run's last write read the switch through the cache and may have missed it
    being switched on: the switch's sweep then ran before this run waited and never saw it.
    Read after the lease, either this read sees the switch on, or the switch (and its sweep)
    came later and the sweep finds the run waiting with no lease held."""
    try:
        with res.db.session() as session:
            return res.model_calls.fresh(session)
    except DBAPIError:
        log.warning("whether model calls were switched on is unknown", exc_info=True)
        return False  # the run waits; the next sweep with model calls on starts it


def _mailbox_held(res: Resources, email_id: int, mailbox: str | None) -> bool:
    """Whether the delivery is of a paused mailbox and ends here, its marker released. The cached
    read is asked first; a delivery it finds paused releases its marker and then asks Redis
    afresh, so that a resume in between either sees no marker and sends the job again, or is
    seen here and the job runs."""

    def read() -> dict[str, pauses.MailboxPause]:
        return res.mailbox_pauses(lambda: mailbox_pauses.in_force(res))

    try:
        paused = read()
        if not paused:
            return False
        if mailbox is None:
            found = emails.mailbox_of(res, email_id)
            if found is None:
                return False  # no such email: it fails as any other
            mailbox = mailboxes.shown(found.mailbox)
        if mailbox not in paused:
            return False
        markers.release(res.redis, [email_id])
        res.mailbox_pauses.forget()
        return mailbox in read()
    except (RedisError, DBAPIError):
        return False  # the lease or the claim cannot be taken either: the job defers there


def _pause_in_force(res: Resources, stage: Stage) -> pauses.Pause | None:
    """The stage's pause: an operator's until resumed, an outage's until its check passes."""
    try:
        return res.pauses(lambda: stage_pauses.in_force(res)).get(stage)
    except RedisError:
        return None  # the lease cannot be taken either: the job defers below
    except DBAPIError:
        # Redis lost the kept pauses and the database cannot put them back: the claim cannot
        # be written either, and the job defers there.
        return None


def _retry(
    res: Resources, attempt: int, error: str | None, exc: Exception | None = None
) -> Verdict:
    """The verdict RETRY for a failed attempt, after its backoff."""
    return policy.retry(
        policy.Limits.of(res.settings),
        attempt,
        error,
        error_class=None if exc is None else error_class(exc),
        jitter=random.random(),
        retry_after=getattr(exc, "retry_after", None),
    )


def run_claimed(
    res: Resources,
    email_id: int,
    cut_off: float | None = None,
    stage: Stage = Stage.CPU,
    lane: Lane = Lane.LIVE,
    deferred_since: float | None = None,
    call: ModelCall | None = None,
) -> Verdict:
    """A stage once its lease is held: claim an attempt, run the steps. Every write is fenced by
    the claim, so two of these at once for one email (what a lapsed lease allows) leave the
    rows one would."""
    settings = res.settings
    try:
        claim = once_more_if_disconnected(lambda: _claim(res, email_id, stage, cut_off))
    except runs.Superseded as exc:  # the run was deleted under the claim
        log.warning("%s; this delivery stops without writing", exc)
        return Verdict(Kind.CLOSED, error=str(exc))
    except Exception as exc:
        if isinstance(exc, IntegrityError):
            # The claim met the forget's deletion: it waited on the run's row, and the run it
            # then inserted found the email gone. Any other integrity error is the email's.
            gone = _if_forgotten(res, email_id)
            if gone is not None:
                log.warning("email %s: the claim met its deletion: %s", email_id, describe(exc))
                return gone
        outage = _outage(res, exc)
        if outage is not None:
            return _after_outage(res, email_id, stage, exc, outage, deferred_since)
        if not is_transient(exc):
            raise
        # Nothing was counted: wait like a deferral, bounded the same way.
        return Verdict(
            Kind.DEFER,
            policy.Limits.of(settings).defer_base,
            f"could not claim an attempt: {describe(exc)}",
        )
    if not isinstance(claim, runs.Claim):
        return claim
    try:
        if stage is Stage.CPU:
            return _run_steps(res, email_id, claim)
        return _classify_steps(res, email_id, claim, lane, call or ModelCall())
    except runs.Superseded as exc:
        log.warning("%s; this delivery stops without writing", exc)
        return Verdict(Kind.CLOSED, error=str(exc))
    except Exception as exc:
        return _after_error(res, email_id, claim, stage, exc, deferred_since)


def _claim(
    res: Resources, email_id: int, stage: Stage, cut_off: float | None
) -> runs.Claim | Verdict:
    """Claim an attempt in a transaction of its own: its `Claim`, or what a claim that counted
    none means for the job."""
    settings = res.settings
    limits = policy.Limits.of(settings)
    with res.db.transaction() as session:
        claim = runs.claim(
            session,
            email_id,
            limits,
            stage=stage,
            cut_off=cut_off,
            # Asked only of a run that is not ready: the shutdown mark that tells a last
            # attempt cut off by its worker's shutdown from one whose process died.
            shutdown_cut_off_at=lambda: shutdowns.cut_off_at(res.redis, email_id),
        )
        if isinstance(claim, runs.Refused) and claim.reason is runs.Refusal.CONVERTED:
            # A second delivery of a CPU stage already done (redelivered, or sent again once
            # model calls are on): the model stage is next, sent again in case the first
            # hand-off was lost with its worker. Two of them run once: the lease and the claim
            # see to it.
            return Verdict(Kind.HANDED_OFF if res.model_calls(session) else Kind.WAITING)
    if isinstance(claim, runs.Claim):
        return claim
    if isinstance(claim, runs.Failed):
        log.error("email %s: failed: %s", email_id, claim.error)
        return Verdict(Kind.FAILED, error=claim.error)
    if claim.reason is runs.Refusal.UNFINISHED:
        # Killed by the hard time limit, or its process died: a failed attempt like any other,
        # which waits out its backoff before the next one.
        return _retry(res, claim.attempt, claim.error)
    if claim.reason is runs.Refusal.NO_EMAIL:
        gone = _if_forgotten(res, email_id)
        return gone or Verdict(Kind.FAILED, error=f"no email_message row with id {email_id}")
    if claim.reason is runs.Refusal.NOT_CONVERTED:
        return Verdict(Kind.CLOSED, error="not converted yet: the CPU stage comes first")
    return Verdict(Kind.CLOSED)


def _outage(res: Resources, exc: Exception) -> Dependency | None:
    """The dependency whose error `exc` is, when its own check fails too: an outage or a refusal
    of the whole fleet, not the email's error."""
    dependency = dependency_of(exc)
    if dependency is None or health.passes(res, dependency):
        return None
    return dependency


def _run_steps(res: Resources, email_id: int, claim: runs.Claim) -> Verdict:
    """The CPU stage after the claim: origin, documents, and with a local classifier the labels.
    Each transaction asks `runs` once, with a write fenced by the claim that comes before any
    write to the email row: it finds the run still open at this claim, or raises Superseded and
    rolls back the whole transaction.

    An email without attachments takes one transaction for all of it. With attachments, the
    origin is recorded in a transaction of its own first, so that a copy stops before its
    documents are converted."""
    settings = res.settings
    assert claim.blob_key is not None  # a claim of the CPU stage says where the email is
    raw = res.blobs.get(claim.blob_key, max_bytes=settings.max_email_bytes)
    parsed = parse_email(
        raw,
        ParseLimits(
            max_bytes=settings.max_email_bytes,
            max_depth=settings.max_mime_depth,
            max_parts=settings.max_mime_parts,
            body_max_chars=settings.body_text_max_chars,
        ),
    )
    defects = _defects(parsed)

    to_link = None  # the origin, when the last transaction below finds it
    if parsed.attachments:
        with res.db.transaction() as session:
            origin = _origin_unless_copy(session, claim, parsed, defects)
            if origin is None:
                return Verdict(Kind.DUPLICATE)
            runs.mark_parsed(session, claim, defects)
            link_to_origin(session, email_id, parsed, origin)

    documents = convert_documents(parsed, settings)
    # Redis's fence alone: the database's is read only where a write failed (`_if_forgotten`),
    # so that no job pays a query for it. Blobs written past a fence Redis lost are deleted by
    # the forget when written before its deletion, and by `_blobs_unless_forgotten` after it.
    if documents and forgotten.fenced(res.redis, email_id):
        raise runs.Superseded(f"email {email_id}: it is being forgotten")
    rows = document_rows(res.blobs, email_id, documents, settings.doc_inline_text_bytes)
    email_text = email_for_classifier(
        parsed, texts_for_classifier(documents), settings.classifier_text_budget
    )
    with _blobs_unless_forgotten(res, email_id, rows), res.db.transaction() as session:
        if not parsed.attachments:
            to_link = _origin_unless_copy(session, claim, parsed, defects)
            if to_link is None:
                return Verdict(Kind.DUPLICATE)
        store_documents(session, rows)
        model_calls = res.model_calls(session)
        # A local classifier answers in well under a millisecond: in this transaction, with no
        # hand-off and no second one.
        classified_here = model_calls and not res.classifier.remote
        if classified_here:
            result = res.classifier.classify(email_text)
            runs.close(
                session,
                claim,
                RunStatus.SUCCEEDED,
                classified=True,
                parse_defects=defects,
            )
            store_classification(session, claim.run_id, email_id, result)
            # An origin recorded in this transaction has no copy yet to sync.
            recorded = to_link is not None and to_link.recorded
            sync_model_labels(session, email_id, result.labels, copies=not recorded)
        else:
            runs.mark_converted(session, claim, defects, model_calls=model_calls)
            # What the model will read is kept, so that its stage never parses the email again.
            upsert(
                session,
                ModelInput,
                [
                    {
                        "email_id": email_id,
                        "input": input_as_json(email_text),
                        "created_at": utcnow(),
                    }
                ],
                ["email_id"],
            )
        if to_link is not None:
            link_to_origin(session, email_id, parsed, to_link)
    if classified_here:
        return Verdict(Kind.SUCCEEDED)
    return Verdict(Kind.HANDED_OFF if model_calls else Kind.WAITING)


@contextmanager
def _blobs_unless_forgotten(res: Resources, email_id: int, rows: list[dict]) -> Iterator[None]:
    """Around the transaction that stores the rows of the document texts written to blobs
    before it: when it fails and the email is being forgotten, those blobs are deleted too, as
    `mailpipe forget` may have deleted the email's blobs before they were written."""
    try:
        yield
    except Exception:
        keys = [row["text_blob_key"] for row in rows if row["text_blob_key"]]
        if keys and _if_forgotten(res, email_id) is not None:
            try:
                for key in keys:
                    res.blobs.delete(key)
            except Exception:
                log.exception(
                    "email %s: forgotten, but blobs %s could not be deleted", email_id, keys
                )
        raise


def _if_forgotten(res: Resources, email_id: int, *, ask_database: bool = True) -> Verdict | None:
    """CLOSED when `mailpipe forget` fenced the email off: its rows are gone or going, whatever
    else went wrong, and the delivery writes nothing more. The fence is Redis's, or where Redis
    has none (a Redis restarted without its data, or unreachable) the database's, unless
    `ask_database` is False (the error was the database's own). None when neither can say."""
    fenced = False
    try:
        fenced = forgotten.fenced(res.redis, email_id)
    except RedisError as exc:
        log.warning(
            "email %s: Redis cannot say if it is being forgotten: %s", email_id, describe(exc)
        )
    if not fenced and ask_database:
        try:
            with res.db.session() as session:
                fenced = emails.being_forgotten(session, email_id)
        except DBAPIError as exc:
            log.warning(
                "email %s: if it is being forgotten is unknown: %s", email_id, describe(exc)
            )
            return None
    return Verdict(Kind.CLOSED, error="the email is being forgotten") if fenced else None


def _origin_unless_copy(
    session: Session,
    claim: runs.Claim,
    parsed: ParsedEmail,
    defects: dict[str, object] | None,
) -> OriginResult | None:
    """The email's origin, found or recorded (which locks neither the run nor the email row),
    to link once the run is locked. None for a copy: its run is closed `duplicate` here, it is
    linked to the first email and given the first email's labels as they are now (the first
    email's classification syncs them from then on)."""
    origin = find_origin(session, claim.email_id, parsed)
    if origin.duplicate_of is None:
        return origin
    runs.close(session, claim, RunStatus.DUPLICATE, parse_defects=defects)
    link_to_origin(session, claim.email_id, parsed, origin)
    copy_labels(session, claim.email_id, origin.duplicate_of)
    return None


def _defects(parsed: ParsedEmail) -> dict[str, object] | None:
    """What the parser got past (a malformed header line skipped, a broken part), for the run;
    None when it read cleanly."""
    if not parsed.defect_count:
        return None
    return {
        "count": parsed.defect_count,
        "skipped_header_lines": list(parsed.skipped_header_lines),
    }


def _classify_steps(
    res: Resources, email_id: int, claim: runs.Claim, lane: Lane, call: ModelCall
) -> Verdict:
    """The model stage after the claim: the model's answer, kept at once, then the labels."""
    settings = res.settings
    mailbox = call.mailbox
    with res.db.transaction() as session:
        if not res.model_calls(session):
            runs.give_back(session, claim, waiting=True)
            return Verdict(Kind.WAITING)
        if claim.classified:
            # An earlier attempt stored the model's answer and died before the labels: no
            # second call, the labels come from the stored answer.
            _close_with_labels(session, claim, stored_result(session, claim.run_id))
            return Verdict(Kind.SUCCEEDED)
        if batches.waits_for_batch(res, session, claim, lane):
            return Verdict(Kind.BATCHED)
        runs.lock_current(session, claim)  # a delivery fenced off calls no model
        email_text = input_from_json(session.get_one(ModelInput, email_id).input)
        capped = settings.mailbox_model_rate > 0 or bool(settings.mailbox_model_rates)
        if mailbox is None and capped and res.classifier.remote:
            # A message sent without its mailbox (upstream's, with no shard queues): its row's.
            mailbox = mailboxes.shown(emails.mailbox_in(session, email_id))

    if res.classifier.remote:
        limiter = FleetRateLimiter.for_model_calls(res.redis, settings)
        ceiling = None
        if mailbox is not None:
            rate = settings.mailbox_model_rate_of(mailbox)
            ceiling = Ceiling(mailbox, rate, call.mailbox_slot) if rate > 0 else None
        # A thread waits its turn here, cheaply; past the wait the job is deferred. A call its
        # mailbox's ceiling refuses is deferred at once, until the slot it was handed.
        result = classify_remote(
            res.classifier,
            email_text,
            limiter,
            wait=settings.model_slot_wait,
            lane=lane,
            ceiling=ceiling,
        )
    else:
        result = res.classifier.classify(email_text)
    # The answer is kept before anything else: a job that dies after the call never pays for it
    # twice (the sweeper re-adds such a run after MAILPIPE_STALL_AFTER).
    with res.db.transaction() as session:
        _store_classification(session, claim, result)
    with res.db.transaction() as session:
        _close_with_labels(session, claim, result)
    return Verdict(Kind.SUCCEEDED)


def _store_classification(
    session: Session, claim: runs.Claim, result: ClassificationResult
) -> None:
    runs.mark_classified(session, claim)
    store_classification(session, claim.run_id, claim.email_id, result)


def _close_with_labels(session: Session, claim: runs.Claim, result: ClassificationResult) -> None:
    runs.close(session, claim, RunStatus.SUCCEEDED)
    sync_model_labels(session, claim.email_id, result.labels)


def _after_error(
    res: Resources,
    email_id: int,
    claim: runs.Claim,
    stage: Stage,
    exc: Exception,
    deferred_since: float | None,
) -> Verdict:
    """An attempt that raised, by whose fault it was (mailpipe.errors)."""
    gone = _if_forgotten(res, email_id, ask_database=dependency_of(exc) is not Dependency.DATABASE)
    if gone is not None:
        return gone
    # A throttle is the provider's answer, not a fault to check it for.
    outage = None if isinstance(exc, Throttled) else _outage(res, exc)
    fault = policy.fault_of(exc, outage)
    if fault is Fault.OUTAGE or fault is Fault.THROTTLED:
        # Not the email's attempt to lose: given back, then deferred or paused.
        def give_back(session: Session) -> bool:
            runs.give_back(session, claim, error=describe(exc), error_class=error_class(exc))
            return True

        given_back = _write(res, give_back, False)
        if isinstance(given_back, Verdict):
            return given_back
        if given_back is False:
            # The database is out too: the next claim gives the attempt back, as for a job its
            # worker cut off.
            _mark_cut_off(res, email_id)
        if outage is not None:
            return _after_outage(res, email_id, stage, exc, outage, deferred_since)
        limited = exc if isinstance(exc, RateLimited) else None
        return Verdict(
            Kind.DEFER,
            getattr(exc, "retry_after", None) or 1.0,
            str(exc),
            mailbox_slot=None if limited is None else limited.mailbox_slot,
            for_slot=limited is not None and limited.by_ceiling,
        )
    if fault is Fault.ATTEMPT:
        return _after_failed_attempt(res, email_id, claim, exc)
    # Rejected input: trying again cannot help.
    error = describe(exc)
    log.warning("email %s: rejected: %s", email_id, error)

    def fail(session: Session) -> Verdict:
        runs.close(session, claim, RunStatus.FAILED, error=error, error_class=error_class(exc))
        return Verdict(Kind.FAILED, error=error, error_class=error_class(exc))

    # The database is out: the attempt stays counted, the next one records how it ended.
    return _write(res, fail, _retry(res, claim.attempt, error, exc))


def _after_failed_attempt(
    res: Resources, email_id: int, claim: runs.Claim, exc: Exception
) -> Verdict:
    """A failed attempt that is not the email's fault: recorded, and retried while attempts
    remain."""
    settings = res.settings
    attempt = claim.attempt
    error, unforeseen = policy.attempt_error(exc, settings.task_soft_time_limit)
    if is_soft_time_limit(exc):
        log.warning("email %s: attempt %s: %s", email_id, attempt, error)
    elif unforeseen:
        # A bug or a library error no one classified: the run records what it was, the log its
        # traceback, except a database error's, whose text can quote an email's values.
        if isinstance(exc, DBAPIError):
            log.error("email %s: attempt %s: %s", email_id, attempt, error)
        else:
            log.exception("email %s: attempt %s: unexpected error", email_id, attempt)
    # Retried, whether or not the error could be recorded: the attempt was counted at the claim.
    failed = _write(
        res,
        lambda session: runs.record_failed_attempt(
            session,
            claim,
            error,
            policy.Limits.of(settings),
            error_class=error_class(exc),
        ),
        None,
    )
    if isinstance(failed, Verdict):
        return failed
    if failed is not None:
        log.error("email %s: failed: %s", email_id, failed.error)
        return Verdict(Kind.FAILED, error=failed.error, error_class=error_class(exc))
    verdict = _retry(res, attempt, error, exc)
    log.info(
        "email %s: attempt %s failed, retrying in %.1fs: %s",
        email_id,
        attempt,
        verdict.delay,
        error,
    )
    return verdict


def _after_outage(
    res: Resources,
    email_id: int,
    stage: Stage,
    exc: Exception,
    dependency: Dependency,
    deferred_since: float | None,
) -> Verdict:
    """An outage of `dependency`, or its refusal of the whole fleet (the email's attempt, if
    one was counted, given back): counted toward the stage's pause. The job goes back to its
    queue when the stage is paused, and waits as a deferral until then, with no bound."""
    settings = res.settings
    error = describe(exc)
    since = deferred_since or time.time()
    try:
        pause = pauses.record_fault(
            res.redis,
            stage,
            email_id,
            error,
            dependency=dependency,
            threshold=settings.pause_after_emails,
            window=settings.pause_window,
        )
    except RedisError:
        pause = None
    if pause is None:
        log.warning("email %s: %s outage at the %s stage: %s", email_id, dependency, stage, error)
        return Verdict(
            Kind.DEFER, _deferral_delay(res, deferred_since), error, since, outage=dependency
        )
    return Verdict(
        Kind.PAUSED, error=f"the {stage} stage is paused: {pause.error}", deferred_since=since
    )


def _mark_cut_off(res: Resources, email_id: int) -> None:
    try:
        shutdowns.mark_cut_off(res.redis, [email_id])
    except RedisError:
        log.warning("email %s: its attempt could not be given back", email_id)


def _fail_unclaimed(res: Resources, email_id: int, error: str, bound: str) -> Verdict:
    """Fail the run from outside a claim: its job waited past `bound`."""

    def fail(session: Session) -> bool:
        runs.fail(session, email_id, error, error_class=bound)
        return True

    failed = _write(res, fail, False)
    log.error("email %s: %s%s", email_id, error, "" if failed else " (the run could not be failed)")
    return Verdict(Kind.FAILED, error=error)


def _write(res: Resources, write: Callable[[Session], T], unwritten: T) -> T | Verdict:
    """Run `write` in a transaction and return what it returns: the verdict CLOSED when this
    delivery was superseded, `unwritten` when the database could not take it (a transient
    error, logged)."""
    try:
        with res.db.transaction() as session:
            written = write(session)
        return written
    except runs.Superseded as exc:
        log.warning("%s; this delivery stops without writing", exc)
        return Verdict(Kind.CLOSED, error="superseded")
    except Exception as exc:
        if not is_transient(exc):
            raise
        log.warning("could not record the verdict: %s", describe(exc))
        return unwritten


def _deferral(
    res: Resources, email_id: int, queue: str, wanted: Verdict, deferred_since: float | None
) -> Verdict:
    """Count the deferral, as the policy bounds it; or fail the run, when the policy says the
    job has waited past MAILPIPE_MAX_DEFERRAL in all."""
    now = time.time()
    verdict = policy.deferred(
        policy.Limits.of(res.settings), replace(wanted, deferred_since=deferred_since), now
    )
    if verdict.kind is Kind.FAILED:
        assert verdict.error is not None and verdict.error_class is not None
        return _fail_unclaimed(res, email_id, verdict.error, verdict.error_class)
    try:
        deferrals.record(res.redis, queue, email_id, now + verdict.delay)
    except RedisError:
        log.warning("email %s: deferral not counted in the metrics", email_id, exc_info=True)
    log.info("email %s: deferred %.1fs: %s", email_id, verdict.delay, verdict.error)
    return verdict


def _deferral_delay(res: Resources, deferred_since: float | None) -> float:
    waited = time.time() - deferred_since if deferred_since else 0.0
    return policy.deferral_delay(policy.Limits.of(res.settings), waited)
