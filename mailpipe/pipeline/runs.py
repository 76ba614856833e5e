"""The pipeline run of an email: its status, attempts and error, moved only through here.

This module records and answers facts; it decides nothing and logs nothing. How an ended
attempt is judged (counted, given back, the run failed) is the policy's
(mailpipe.pipeline.policy), which this module records in one write; what the rest means for the
job is decided in mailpipe.pipeline.job. A delivery claims an attempt with one call (`claim`): in
the usual case, a run that is new or ready for the stage, in one statement; in any other, by
locking the run and looking at it. It answers with the `Claim` to run the steps under, or with
why none was counted (`Refused`, or `Failed` when the claim failed the run). Each transaction of
the steps then writes through this module once, with one act: `mark_parsed`, `mark_converted`,
`mark_classified` or `close` (the one way a delivery closes its run), `lock_current` before it
reads, or after an error `give_back` or `record_failed_attempt`. `fail` fails a run from outside
any claim. What is done to runs from outside a delivery (an operator's retry, dismiss and
reprocess, the sweeper's, erasure's) is in mailpipe.pipeline.interventions.

Every transaction a delivery writes in after its claim is fenced by the run's status and the
delivery's claim, a token that grows by one at every claim and is never reset (`claims`), so a
stale delivery can never pass for a later one. It is fenced in one of two ways: its act locks
the run and checks that it is still open and still at this claim (`lock_current`); or its act is one
UPDATE on the same two conditions, which raises Superseded, rolling back the whole transaction,
when it finds no such row. A delivery whose lease lapsed while a later one claimed the run, or
one that finishes after the run was closed (by another delivery, by the sweeper), is thereby
fenced off: it writes nothing more. Either way the act comes before any write to the email row,
so the run is locked before the email row, the order of every transaction that locks both.

Each attempt of a stage leaves one row in the run's history (`RunAttempt`), written when it ends,
in the transaction that ends it: by the act that ends it (`close`, `converted`, `give_back`,
`record_failed_attempt`), or, for an attempt whose process died or was cut off, by the claim that
finds it so. A delivery fenced off writes no row, as it writes nothing else.

`attempts` is apart from the fence: the attempts of the current stage that count toward
MAILPIPE_MAX_RETRIES. A deferral and a shutdown's cut-off give theirs back; the model stage
starts with a fresh budget. `sweep_count` covers both stages and only a reopen resets it.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    ColumnElement,
    and_,
    bindparam,
    case,
    func,
    insert,
    literal,
    select,
    update,
)
from sqlalchemy.orm import Session

from mailpipe.broker.queues import Stage
from mailpipe.pipeline import policy
from mailpipe.storage.db import dialect_insert, insert_ignore
from mailpipe.storage.models import (
    AttemptOutcome,
    EmailMessage,
    ErrorClass,
    PipelineRun,
    RunAttempt,
    RunStatus,
    clip_error,
    table,
    utcnow,
)


@dataclass(frozen=True)
class Claim:
    """An attempt counted for this delivery: its steps run under it, and every write they make
    through this module is fenced by it (the email's run, at this claim's `token`)."""

    email_id: int
    attempt: int  # the stage's attempts, this one included
    token: int  # the fence every later write of this delivery is checked against
    run_id: int
    blob_key: str | None  # at the CPU stage: where the raw email is stored
    classified: bool  # the run holds the model's answer from an earlier attempt


class Refusal(enum.StrEnum):
    """Why a claim counted no attempt."""

    NO_EMAIL = "no_email"  # no email row with that id
    CLOSED = "closed"  # the run is closed
    CONVERTED = "converted"  # a CPU stage asked for, and it is done already
    NOT_CONVERTED = "not_converted"  # a model stage asked for before the CPU stage is done
    UNFINISHED = "unfinished"  # the last attempt died or hit the hard time limit: ended here


@dataclass(frozen=True)
class Refused:
    """No attempt was counted, for `reason`. UNFINISHED: `attempt` is the number of the attempt
    the claim ended, `error` how it ended."""

    reason: Refusal
    attempt: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Failed:
    """The run failed for good in this transaction, with `error`."""

    error: str


class Superseded(Exception):
    """The run is closed, or a later claim holds it: this delivery must write nothing."""


@dataclass(frozen=True)
class _AttemptEnd:
    """How an attempt ended, for its row in the run's history."""

    outcome: AttemptOutcome
    error_class: str | None = None
    error: str | None = None
    at: datetime | None = None  # the time the act also sets on the run (closed_at); else now


def claim(
    session: Session,
    email_id: int,
    limits: policy.Limits,
    *,
    stage: Stage = Stage.CPU,
    cut_off: float | None = None,
    shutdown_cut_off_at: Callable[[], float | None] = lambda: None,
) -> Claim | Refused | Failed:
    """Count one attempt of `stage` and return its `Claim`; or say why no attempt was counted
    (`Refused`); or fail the run, when the policy says its attempts or shutdown windows are used
    up (`Failed`).

    In the usual case (a run that is new, or open with no attempt running and attempts left, at
    `stage`) the claim is one statement. In any other, or when `cut_off` says the last attempt
    hit the hard time limit (its seconds), the run is locked and looked at, and
    `shutdown_cut_off_at` is asked when the email's job was last cut off at the end of its
    worker's shutdown window (unix time, or None): a last attempt that ended without a result
    and started before that is given back.

    An attempt is counted before any work, in its own commit, so that a try whose process dies
    still counts: a job that crashes its child every time stops after the policy's attempts.
    """
    if cut_off is None:
        ready = _claim_if_ready(session, email_id, limits, stage)
        if ready is not None:
            return ready
    # A delivery the hard time limit cut off knows how its last attempt ended.
    marked_at = shutdown_cut_off_at() if cut_off is None else None
    return _claim_locked(session, email_id, limits, stage, cut_off, marked_at)


def _claim_locked(
    session: Session,
    email_id: int,
    limits: policy.Limits,
    stage: Stage,
    cut_off: float | None,
    shutdown_cut_off_at: float | None,
) -> Claim | Refused | Failed:
    """The claim of a run that is not ready, or not known to be: locked, and looked at."""
    blob_key = session.execute(_BLOB_KEY, {"run_email_id": email_id}).scalar()
    if blob_key is None:
        return Refused(Refusal.NO_EMAIL)
    ensure_runs(session, [email_id])
    run = _locked_run(session, email_id)
    if run.status is not RunStatus.OPEN:
        return Refused(Refusal.CLOSED)
    converted = run.converted_at is not None
    if stage is Stage.CPU and converted:
        return Refused(Refusal.CONVERTED)
    if stage is Stage.MODEL and not converted:
        return Refused(Refusal.NOT_CONVERTED)
    if run.attempt_started_at is not None:
        shutdown = _cut_off_after(shutdown_cut_off_at, run.attempt_started_at)
        ending = policy.unfinished(
            run.attempts, run.cutoffs, limits, cut_off=cut_off, shutdown=shutdown
        )
        failed = _record_ending(session, run, ending)
        if failed is not None:
            return failed
        if run.error_class != ErrorClass.SHUTDOWN_CUTOFFS:
            return Refused(Refusal.UNFINISHED, run.attempts, run.error)
    elif past := policy.past_lowered_limit(run.attempts, limits, run.error_class, run.error):
        return _fail_run(run, past)
    run.attempts += 1
    run.claims += 1
    run.attempt_started_at = utcnow()
    run.waiting_since = None
    return Claim(
        email_id,
        run.attempts,
        token=run.claims,
        run_id=run.id,
        blob_key=blob_key,
        classified=run.classified_at is not None,
    )


def _record_ending(session: Session, run: PipelineRun, ending: policy.Ending) -> Failed | None:
    """Record how the locked run's attempt ended, as `ending` says: its row, while the run
    still holds the attempt, then the run's counts and error, or its failure (`Failed`)."""
    _record(session, run, _AttemptEnd(ending.outcome, ending.error_class, ending.error))
    run.attempt_started_at = None
    run.attempts, run.cutoffs = ending.attempts, ending.cutoffs
    if ending.failure is not None:
        return _fail_run(run, ending.failure)
    _set_error(run, ending.error_class, ending.error)
    return None


def _cut_off_after(marked_at: float | None, started: datetime) -> bool:
    if marked_at is None:
        return False
    started_at = started if started.tzinfo else started.replace(tzinfo=UTC)
    return marked_at >= started_at.timestamp()


def _claim_if_ready(
    session: Session, email_id: int, limits: policy.Limits, stage: Stage
) -> Claim | None:
    """Count an attempt of a run that is open, has no attempt running, has attempts left and is
    at `stage`, in one statement, and return its `Claim`; None when the run is in any other
    state (or missing, for the model stage; or when there is no such email): `_claim_locked`
    then looks at it. For the CPU stage a missing run is created with its first attempt counted,
    and the statement returns the email's blob key with the run."""
    given = {"run_email_id": email_id, "max_attempts": limits.max_attempts, "now": utcnow()}
    if stage is Stage.CPU:
        statement = _count_or_create(session.get_bind().dialect.name)
    else:
        statement = _COUNT_CONVERTED
    row = session.execute(statement, given).one_or_none()
    if row is None:
        return None
    run_id, attempts, claims, classified_at, blob_key = row
    if stage is Stage.CPU and claims == 1:
        # Created just now: the email is flagged as having a run, as `ensure_runs` does.
        session.execute(_FLAG_HAS_RUN, {"flag_email_id": email_id})
    return Claim(
        email_id,
        attempts,
        token=claims,
        run_id=run_id,
        blob_key=blob_key,
        classified=classified_at is not None,
    )


# The statements of a job's usual path, built once, with their values as parameters.
_RUN = table(PipelineRun)
_EMAIL = table(EmailMessage)


def _ready(stage: Stage) -> ColumnElement[bool]:
    return and_(
        _RUN.c.status == RunStatus.OPEN,
        _RUN.c.attempt_started_at.is_(None),
        _RUN.c.attempts < bindparam("max_attempts"),
        _RUN.c.converted_at.is_(None) if stage is Stage.CPU else _RUN.c.converted_at.is_not(None),
    )


_COUNTED = {
    "attempts": _RUN.c.attempts + 1,
    "claims": _RUN.c.claims + 1,
    "attempt_started_at": bindparam("now"),
    "waiting_since": None,
    "updated_at": bindparam("now"),
}
_BLOB_KEY = select(_EMAIL.c.blob_key).where(_EMAIL.c.id == bindparam("run_email_id"))
_CLAIMED = (
    _RUN.c.id,
    _RUN.c.attempts,
    _RUN.c.claims,
    _RUN.c.classified_at,
    _BLOB_KEY.scalar_subquery(),
)
_COUNT_CONVERTED = (
    update(_RUN)
    .where(_RUN.c.email_id == bindparam("run_email_id"), _ready(Stage.MODEL))
    .values(_COUNTED)
    .returning(*_CLAIMED)
)
_FLAG_HAS_RUN = (
    update(_EMAIL)
    .where(_EMAIL.c.id == bindparam("flag_email_id"), _EMAIL.c.has_run.is_(False))
    .values(has_run=True)
)
_AT_CLAIM = and_(
    _RUN.c.email_id == bindparam("fence_email_id"),
    _RUN.c.status == RunStatus.OPEN,
    _RUN.c.claims == bindparam("fence_token"),
)
# The columns to SET come from the parameters given with it.
_UPDATE_IF_AT_CLAIM = update(_RUN).where(_AT_CLAIM)

# The history. An attempt of the CPU stage runs before the run is converted, one of the model
# stage after: the row's stage is read from the run before the act that ends the attempt.
_ATTEMPT = table(RunAttempt)
_ENDED = ("ended_at", "outcome", "error_class", "error", "host")  # given with the statement
_RECORD = insert(_ATTEMPT)
_RECORD_IF_AT_CLAIM = insert(_ATTEMPT).from_select(
    ["run_id", "email_id", "stage", "attempt", "started_at", *_ENDED],
    select(
        _RUN.c.id,
        _RUN.c.email_id,
        case(
            (_RUN.c.converted_at.is_(None), literal(Stage.CPU.value)),
            else_=literal(Stage.MODEL.value),
        ),
        _RUN.c.attempts,
        _RUN.c.attempt_started_at,
        *(bindparam(name, type_=_ATTEMPT.c[name].type) for name in _ENDED),
    ).where(_AT_CLAIM),
)


@cache
def _count_or_create(dialect: str) -> Any:
    # INSERT ... SELECT from the email row: no row for an unknown email id, instead of a foreign
    # key error that would abort the transaction.
    new_run = select(
        _EMAIL.c.id,
        literal(1),
        literal(1),
        bindparam("now", type_=_RUN.c.attempt_started_at.type),
    ).where(_EMAIL.c.id == bindparam("run_email_id"))
    insert = dialect_insert(dialect)(_RUN).from_select(
        ["email_id", "attempts", "claims", "attempt_started_at"], new_run
    )
    return insert.on_conflict_do_update(
        index_elements=["email_id"], set_=_COUNTED, where=_ready(Stage.CPU)
    ).returning(*_CLAIMED)


def ensure_runs(session: Session, email_ids: list[int]) -> None:
    """Create the open runs of emails that have none yet (and flag those emails as having one)."""
    created = insert_ignore(
        session,
        PipelineRun,
        [{"email_id": i} for i in email_ids],
        ["email_id"],
        PipelineRun.email_id,
    )
    if created:
        session.execute(
            update(EmailMessage).where(EmailMessage.id.in_(created)).values(has_run=True)
        )


def lock_current(session: Session, claim: Claim) -> PipelineRun:
    """The run, locked, if it is still open at `claim`; raises Superseded otherwise."""
    return _lock_at(session, claim.email_id, claim.token)


def _lock_at(session: Session, email_id: int, token: int) -> PipelineRun:
    run = _locked_run(session, email_id)
    if run.status is not RunStatus.OPEN:
        raise Superseded(f"email {email_id}: the run is {run.status.value} already")
    if run.claims != token:
        raise Superseded(f"email {email_id}: claim {run.claims} holds the run, not {token}")
    return run


def mark_parsed(session: Session, claim: Claim, parse_defects: dict[str, Any] | None) -> None:
    """The email is parsed and is no copy: its documents are converted next, outside this
    transaction. Locks the run as `lock_current` does, and keeps what the parser got past."""
    run = lock_current(session, claim)
    if parse_defects is not None:
        run.parse_defects = parse_defects


def mark_converted(
    session: Session,
    claim: Claim,
    parse_defects: dict[str, Any] | None = None,
    *,
    model_calls: bool,
) -> None:
    """The CPU stage is done (the documents and the model's input are stored): the run waits
    for its classification stage, with a fresh attempt budget for it (its sweeps go on counting
    over both stages). Fenced as `close`. `model_calls`: the model stage is sent next (the
    attempt is `handed_off`), else the run waits for them (`waiting`)."""
    now = utcnow()
    values = {
        "converted_at": now,
        "attempts": 0,
        "attempt_started_at": None,
        "waiting_since": None if model_calls else now,
        "error": None,
        "error_class": None,
    }
    ended = _AttemptEnd(
        AttemptOutcome.HANDED_OFF if model_calls else AttemptOutcome.WAITING, at=now
    )
    _update_fenced(session, claim, values, parse_defects, ended)


def mark_classified(session: Session, claim: Claim) -> None:
    """The model's answer is stored in this transaction: a later attempt syncs the labels from
    it and never calls the model again. Fenced as `close`."""
    _update_fenced(session, claim, {"classified_at": utcnow()}, None, None)


def close(
    session: Session,
    claim: Claim,
    status: RunStatus,
    *,
    error: str | None = None,
    error_class: str | None = None,
    classified: bool = False,
    parse_defects: dict[str, Any] | None = None,
) -> None:
    """Close the run in this delivery's transaction, in one UPDATE fenced like `lock_current`: when
    the run is closed already or a later claim holds it, it updates nothing and raises
    Superseded, and the transaction rolls back every write the delivery made in it. `error`: why
    it failed, of `error_class`. `classified`: the model's answer is stored in this transaction.
    The attempt ends as the run does."""
    values = closed_columns(status, error, error_class)
    if classified:
        values["classified_at"] = values["closed_at"]
    ended = _AttemptEnd(_CLOSED_AS[status], error_class, error, values["closed_at"])
    _update_fenced(session, claim, values, parse_defects, ended)


_CLOSED_AS = {
    RunStatus.SUCCEEDED: AttemptOutcome.SUCCEEDED,
    RunStatus.DUPLICATE: AttemptOutcome.DUPLICATE,
    RunStatus.FAILED: AttemptOutcome.FAILED,
}


def _update_fenced(
    session: Session,
    claim: Claim,
    values: dict[str, Any],
    parse_defects: dict[str, Any] | None,
    ended: _AttemptEnd | None,
) -> None:
    """Set `values` on the run if it is open at claim `token`; raises Superseded otherwise.
    `ended`: the act ends the attempt, whose row is written first, read from the run as it was
    (a fenced-off delivery's row goes with the rollback Superseded brings)."""
    if parse_defects is not None:
        values["parse_defects"] = parse_defects
    fence = {"fence_email_id": claim.email_id, "fence_token": claim.token}
    connection = session.connection()
    if ended is not None:
        connection.execute(_RECORD_IF_AT_CLAIM, {**_ended_row(ended), **fence})
    if connection.execute(_UPDATE_IF_AT_CLAIM, {**values, **fence}).rowcount != 1:
        lock_current(session, claim)  # raises Superseded, saying why
        raise Superseded(f"email {claim.email_id}: the run is not at claim {claim.token}")


def give_back(
    session: Session,
    claim: Claim,
    *,
    error: str | None = None,
    error_class: str | None = None,
    waiting: bool = False,
) -> None:
    """Undo the count of an attempt that did no work worth counting (deferred: throttled,
    rate-limited, an outage, model calls switched off). `error`, of `error_class`: why,
    for the attempt's row; the run's error stays as it was. `waiting`: model calls are off, and
    the run waits for them with no job of its own."""
    run = lock_current(session, claim)
    if waiting:
        run.waiting_since = utcnow()
    ended = _AttemptEnd(AttemptOutcome.DEFERRED, error_class, error)
    if not _count_on_last_deferral(session, run, ended):
        _record(session, run, ended, deferrals=1)
    run.attempts = max(0, run.attempts - 1)
    run.attempt_started_at = None


def _count_on_last_deferral(session: Session, run: PipelineRun, ended: _AttemptEnd) -> bool:
    """Count a deferral on the run's last row when that row is a deferral of the same attempt
    (deferred again before anything else happened to it), so that a run deferred for hours
    keeps one row with a count, its last deferral's time, error and host; False if it is not."""
    last = (
        select(func.max(RunAttempt.id)).where(RunAttempt.email_id == run.email_id)
    ).scalar_subquery()
    counted = session.scalar(
        update(RunAttempt)
        .where(
            RunAttempt.id == last,
            RunAttempt.run_id == run.id,
            RunAttempt.outcome == AttemptOutcome.DEFERRED.value,
            RunAttempt.stage == _stage(run).value,
            RunAttempt.attempt == run.attempts,
            RunAttempt.deferrals.is_not(None),
        )
        .values(deferrals=RunAttempt.deferrals + 1, **_ended_row(ended))
        .returning(RunAttempt.id)
        .execution_options(synchronize_session=False)
    )
    return counted is not None


def record_failed_attempt(
    session: Session,
    claim: Claim,
    error: str,
    limits: policy.Limits,
    *,
    error_class: str,
) -> Failed | None:
    """Record a failed attempt as the policy judges it: the run goes on while attempts remain
    (None), and fails for good once none do (`Failed`). The attempt's row keeps its own error;
    a run failed here says its attempts are used up."""
    run = lock_current(session, claim)
    ending = policy.failed_attempt(run.attempts, run.cutoffs, limits, error_class, error)
    return _record_ending(session, run, ending)


def fail(session: Session, email_id: int, error: str, *, error_class: str) -> bool:
    """Fail the open run whatever its claim, from outside any delivery's claim (a job deferred
    or paused past its bound); False if it is closed already. It ends no attempt: none runs
    (the job waited outside its claim), or one does and is fenced off, writing nothing; the
    history gets no row, the run's error says why it failed."""
    run = _locked_run(session, email_id)
    if run.status is not RunStatus.OPEN:
        return False
    _fail(run, error, error_class)
    return True


def _locked_run(session: Session, email_id: int) -> PipelineRun:
    # FOR UPDATE on PostgreSQL serialises two deliveries that lost their lease; SQLite ignores
    # it and serialises every write transaction anyway (BEGIN IMMEDIATE).
    statement = select(PipelineRun).where(PipelineRun.email_id == email_id).with_for_update()
    run = session.scalars(statement).one_or_none()
    if run is None:  # deleted, with its email, by `mailpipe forget`
        raise Superseded(f"email {email_id}: the run is gone")
    return run


def closed_columns(
    status: RunStatus, error: str | None = None, error_class: str | None = None
) -> dict[str, Any]:
    """What a closed run holds, however it was closed: no attempt running, and the error it
    failed with and its class (none for a run that did not fail)."""
    return {
        "status": status,
        "error": clip_error(error) if error else None,
        "error_class": error_class if error else None,
        "attempt_started_at": None,
        "closed_at": utcnow(),
    }


def _set_error(run: PipelineRun, error_class: str | None, error: str | None) -> None:
    """The error of a locked run's last attempt, which it goes on from."""
    run.error = clip_error(error) if error else None
    run.error_class = error_class if error else None


def _fail(run: PipelineRun, error: str, error_class: str) -> None:
    """Fail a run locked in this transaction (`_locked_run`)."""
    for column, value in closed_columns(RunStatus.FAILED, error, error_class).items():
        setattr(run, column, value)


def _fail_run(run: PipelineRun, failure: policy.Failure) -> Failed:
    """Fail a locked run as the policy said (the row of an attempt that ends with it is written
    by the caller, before the run forgets the attempt)."""
    _fail(run, failure.error, failure.error_class)
    return Failed(run.error or failure.error)


def _record(
    session: Session, run: PipelineRun, ended: _AttemptEnd, *, deferrals: int | None = None
) -> None:
    """Write the row of the locked run's attempt that ends in this transaction; called while
    the run still holds the attempt (its number, when it started, its stage)."""
    attempt = {
        "run_id": run.id,
        "email_id": run.email_id,
        "stage": _stage(run).value,
        "attempt": run.attempts,
        "started_at": run.attempt_started_at,
        "deferrals": deferrals,
    }
    session.execute(_RECORD, {**attempt, **_ended_row(ended)})


def _stage(run: PipelineRun) -> Stage:
    return Stage.CPU if run.converted_at is None else Stage.MODEL


def _ended_row(ended: _AttemptEnd) -> dict[str, Any]:
    return {
        "ended_at": ended.at or utcnow(),
        "outcome": ended.outcome.value,
        "error_class": ended.error_class,
        "error": clip_error(ended.error) if ended.error else None,
        "host": _host(),
    }


@cache
def _host() -> str:
    return socket.gethostname()
