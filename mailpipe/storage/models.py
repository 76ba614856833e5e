"""The data model (docs/architecture.md), as SQLAlchemy 2.0 typed models.

The database is the source of truth: the broker keeps nothing that cannot be rebuilt from these
rows, which is what lets the sweeper turn lost jobs back into work.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    column,
    func,
    literal_column,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints make Alembic migrations deterministic on every dialect.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
Id = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    """Now in UTC, without tzinfo: every time in the database is UTC, on SQLite and PostgreSQL."""
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# Errors and review reasons are for operators: long tracebacks belong in the log, not the row.
MAX_ERROR_CHARS = 2000


def clip_error(text: str) -> str:
    """`text` cut to what an error or review reason column keeps."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def table(model: type[Base]) -> Table:
    """A model's table, for Core statements: they skip the ORM's work on each execution."""
    return cast(Table, model.__table__)


class RunStatus(enum.StrEnum):
    OPEN = "open"
    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    FAILED = "failed"


class AttemptOutcome(enum.StrEnum):
    """How one attempt of a run's stage ended (`run_attempt.outcome`)."""

    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    HANDED_OFF = "handed_off"  # the CPU stage is done, the model stage is next
    WAITING = "waiting"  # the CPU stage is done, model calls are off
    DEFERRED = "deferred"  # given back: throttled, an outage, model calls off
    RETRYING = "retrying"  # failed, retried while attempts remain
    FAILED = "failed"  # failed for good: rejected input, or the run's bound reached
    LOST = "lost"  # its process died or its lease lapsed: written by the next claim
    CUT_OFF = "cut_off"  # the hard time limit or a shutdown: written by the next claim


class ErrorClass(enum.StrEnum):
    """The error classes that name no exception: what ended an attempt without one, or the
    bound a run reached. An exception's error class is its class name (`errors.error_class`)."""

    ATTEMPTS_USED_UP = "AttemptsUsedUp"
    LOST = "Lost"
    HARD_TIME_LIMIT = "HardTimeLimit"
    SHUTDOWN_CUTOFFS = "ShutdownCutoffs"
    STALLED = "Stalled"
    DEFERRED_TOO_LONG = "DeferredTooLong"
    PAUSED_TOO_LONG = "PausedTooLong"
    FORGOTTEN = "Forgotten"  # closed by `mailpipe forget`, which deletes it next


class DocumentStatus(enum.StrEnum):
    CONVERTED = "converted"
    UNSUPPORTED = "unsupported"
    TOO_LARGE = "too_large"
    FAILED = "failed"


def _enum(cls: type[enum.Enum], name: str) -> Enum:
    # Stored as the lowercase values operators read in SQL, checked by a constraint everywhere.
    return Enum(
        cls, name=name, values_callable=lambda e: [m.value for m in e], create_constraint=True
    )


def subject_words(subject: Any) -> Any:
    """The subject's words as the search matches them and their index holds them (PostgreSQL's
    full text in its `simple` configuration: lowercase words, none stemmed or left out)."""
    return func.to_tsvector(literal_column("'simple'::regconfig"), subject)


def sender_words(sender: Any) -> Any:
    """The sender's words likewise, and once more with each address cut at its @ (and its
    brackets blanked, which the parser would read as a markup tag), so that its domain and its
    local part are words as well as the whole address."""
    split = func.translate(sender, literal_column("'@<>'"), literal_column("'   '"))
    return subject_words(sender.concat(literal_column("' '")).concat(split))


class EmailMessage(Base):
    __tablename__ = "email_message"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    blob_key: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    received_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    needs_review: Mapped[bool] = mapped_column(default=False, server_default=text("false"))
    review_reason: Mapped[str | None] = mapped_column(Text)
    origin_id: Mapped[int | None] = mapped_column(ForeignKey("email_origin.id"))
    duplicate_of: Mapped[int | None] = mapped_column(ForeignKey("email_message.id"))
    subject: Mapped[str | None] = mapped_column(Text)
    sender: Mapped[str | None] = mapped_column(Text)
    # False until a job or the sweeper creates the email's run; the partial index over the false
    # rows lets the sweeper find emails with no run without reading every email.
    has_run: Mapped[bool] = mapped_column(default=False, server_default=text("false"))
    # The lane its jobs go in (mailpipe.broker.queues.Lane): "live" or "bulk".
    lane: Mapped[str] = mapped_column(String(8), default="live", server_default=text("'live'"))
    # The mailbox it was delivered to (a customer, a user, a shared inbox); None is the default
    # mailbox. Each mailbox with waiting work gets its share of each stage (docs/mailboxes.md).
    mailbox: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_email_message_duplicate_of", "duplicate_of"),
        # An origin's emails, which `mailpipe forget` hands it on to, and which deleting an
        # origin checks for (docs/decisions/erasure.md).
        Index(
            "ix_email_message_origin_id",
            "origin_id",
            postgresql_where=text("origin_id IS NOT NULL"),
            sqlite_where=text("origin_id IS NOT NULL"),
        ),
        Index(
            "ix_email_message_no_run",
            "id",
            postgresql_where=text("NOT has_run"),
            sqlite_where=text("NOT has_run"),
        ),
        Index(
            "ix_email_message_needs_review",
            "id",
            postgresql_where=text("needs_review"),
            sqlite_where=text("needs_review"),
        ),
        # The search's filters (docs/decisions/search-indexes.md): a received time range (with
        # the ids, which a range's search reads from the index alone), the bulk lane, and the
        # words of the subject and the sender (PostgreSQL only: a search on SQLite reads the
        # columns).
        Index("ix_email_message_received_at", "received_at", "id"),
        Index(
            "ix_email_message_bulk",
            "id",
            postgresql_where=text("lane = 'bulk'"),
            sqlite_where=text("lane = 'bulk'"),
        ),
        Index(
            "ix_email_message_mailbox",
            "mailbox",
            "id",
            postgresql_where=text("mailbox IS NOT NULL"),
            sqlite_where=text("mailbox IS NOT NULL"),
        ),
        Index(
            "ix_email_message_subject_words",
            subject_words(column("subject")),
            postgresql_using="gin",
        ).ddl_if(dialect="postgresql"),
        Index(
            "ix_email_message_sender_words",
            sender_words(column("sender")),
            postgresql_using="gin",
        ).ddl_if(dialect="postgresql"),
        # An id is never given twice, the id of an email forgotten included (migration 0018):
        # a job's fence is by id. PostgreSQL's sequence never gives one twice anyway.
        {"sqlite_autoincrement": True},
    )


class EmailOrigin(Base):
    """One row per distinct email; copies point at it through `email_message.origin_id`."""

    __tablename__ = "email_origin"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), unique=True)
    message_id: Mapped[str | None] = mapped_column(Text)
    first_email_id: Mapped[int] = mapped_column(
        ForeignKey("email_message.id", use_alter=True, name="fk_email_origin_first_email")
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (
        # The search by Message-ID: the origins with it, then their first emails and copies.
        Index(
            "ix_email_origin_message_id",
            "message_id",
            postgresql_where=text("message_id IS NOT NULL"),
            sqlite_where=text("message_id IS NOT NULL"),
        ),
        # The origins first seen as an email: deleting the email checks for them.
        Index("ix_email_origin_first_email_id", "first_email_id"),
    )


# The failed runs the failed list shows: an operator dismissed none of them.
_LISTED = "status = 'failed' AND dismissed_at IS NULL"


class PipelineRun(Base):
    __tablename__ = "pipeline_run"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"), unique=True)
    status: Mapped[RunStatus] = mapped_column(
        _enum(RunStatus, "run_status"), default=RunStatus.OPEN
    )
    # Attempts of the current stage that count toward MAILPIPE_MAX_RETRIES; a new stage, a
    # deferral and a shutdown's cut-off give theirs back.
    attempts: Mapped[int] = mapped_column(default=0)
    # The fence: one more at every claim, never less. A delivery writes only while the run is
    # still at its claim, so a stale delivery can never pass for a later one.
    claims: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    # Attempts cut off by a worker's shutdown window (a deploy, a scale-in).
    cutoffs: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    # Set when an attempt starts, cleared when it ends in any way the job itself controls; still
    # set at the next attempt means the last one died with its process.
    attempt_started_at: Mapped[datetime | None]
    sweep_count: Mapped[int] = mapped_column(default=0)
    last_swept_at: Mapped[datetime | None]
    # When the CPU stage had stored the documents and the model's input: from then on the run
    # needs only its classification stage (the model role), never the parse again.
    converted_at: Mapped[datetime | None]
    # When the model's answer was stored, before the labels were synced from it.
    classified_at: Mapped[datetime | None]
    # Since when the run, past its CPU stage, waits for model calls to be switched on: no job is
    # meant to exist for it, so starting its model stage is no re-add of a lost job. Cleared by
    # the claim of an attempt and by the sweep that starts the stage.
    waiting_since: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    # What kind of error `error` is, for the failed list's filter: an exception's class name
    # (BlobMissing, OperationalError) or the name of a bound the run hit (AttemptsUsedUp, Stalled).
    error_class: Mapped[str | None] = mapped_column(String(64))
    # When an operator gave up on the failed run: it stays failed, off the failed list, and no
    # sweep or retry-all reopens it.
    dismissed_at: Mapped[datetime | None]
    # What the parser had to get past in this email: {"count": n, "skipped_header_lines": [...]},
    # or None when it read cleanly.
    parse_defects: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    closed_at: Mapped[datetime | None]
    # When an ended run was last opened again (a retry, a reprocess): its waiting work is aged
    # from then (mailpipe.operations.waiting). None on a run never reopened.
    reopened_at: Mapped[datetime | None]
    # The operator's reprocess that last reopened the run (`Reprocess`), for its progress.
    reprocess_id: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        # A reprocess's progress: its runs by status.
        Index(
            "ix_pipeline_run_reprocess",
            "reprocess_id",
            "status",
            postgresql_where=text("reprocess_id IS NOT NULL"),
            sqlite_where=text("reprocess_id IS NOT NULL"),
        ),
        # The sweeper's candidates: open runs only, in id order (keyset batches).
        Index(
            "ix_pipeline_run_open",
            "id",
            postgresql_where=text("status = 'open'"),
            sqlite_where=text("status = 'open'"),
        ),
        # The overview's count of duplicate runs: a bounded count reads this many entries at most,
        # where a scan for a rare status would read the whole table.
        Index(
            "ix_pipeline_run_duplicate",
            "id",
            postgresql_where=text("status = 'duplicate'"),
            sqlite_where=text("status = 'duplicate'"),
        ),
        # The failed list (newest first) and the FailedRuns metric (failed since a time).
        Index(
            "ix_pipeline_run_failed",
            "closed_at",
            postgresql_where=text("status = 'failed'"),
            sqlite_where=text("status = 'failed'"),
        ),
        # The failed list's pages, newest first, whole or by error class: the runs it lists.
        Index(
            "ix_pipeline_run_listed",
            "closed_at",
            "id",
            postgresql_where=text(_LISTED),
            sqlite_where=text(_LISTED),
        ),
        Index(
            "ix_pipeline_run_listed_class",
            "error_class",
            "closed_at",
            "id",
            postgresql_where=text(_LISTED),
            sqlite_where=text(_LISTED),
        ),
        # The search by run state and by error class, newest email first.
        Index("ix_pipeline_run_status", "status", "email_id"),
        Index(
            "ix_pipeline_run_dismissed",
            "email_id",
            postgresql_where=text("dismissed_at IS NOT NULL"),
            sqlite_where=text("dismissed_at IS NOT NULL"),
        ),
        Index(
            "ix_pipeline_run_error_class",
            "error_class",
            "email_id",
            postgresql_where=text("error_class IS NOT NULL"),
            sqlite_where=text("error_class IS NOT NULL"),
        ),
    )


class RunAttempt(Base):
    """One attempt of a run's stage, written when it ends, in the transaction that ends it (an
    attempt whose process died is written by the claim that finds it so)."""

    __tablename__ = "run_attempt"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("pipeline_run.id"))
    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"))
    stage: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int]  # the stage's attempt number, as `pipeline_run.attempts` counted it
    started_at: Mapped[datetime | None]
    ended_at: Mapped[datetime] = mapped_column(default=utcnow)
    outcome: Mapped[str] = mapped_column(String(32))  # an AttemptOutcome
    error_class: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(String(255))
    # A deferral's row: the deferrals in a row it stands for, the last one's time, error and
    # host in its other columns. NULL on other rows, and on a deferral written by 0.2.0.
    deferrals: Mapped[int | None]

    __table_args__ = (
        # An email's history, in order.
        Index("ix_run_attempt_email_id", "email_id", "id"),
        # The metrics report: the attempts that ended since the last one.
        Index("ix_run_attempt_ended_at", "ended_at"),
        # A run's attempts: deleting the run checks for them.
        Index("ix_run_attempt_run_id", "run_id"),
    )


class Document(Base):
    __tablename__ = "document"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"))
    part_index: Mapped[int]
    filename: Mapped[str] = mapped_column(String(255))
    content_type: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[DocumentStatus] = mapped_column(_enum(DocumentStatus, "document_status"))
    text: Mapped[str | None] = mapped_column(Text)
    text_blob_key: Mapped[str | None] = mapped_column(String(255))
    page_count: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    __table_args__ = (UniqueConstraint("email_id", "part_index"),)


# An email's label from its own classification, synced with each answer; a copy's label from
# its origin's classification, synced with the origin's (mailpipe.pipeline.labels). Labels of
# any other source (people, upstream rules) are kept as they are.
MODEL_SOURCE = "model"
ORIGIN_SOURCE = "origin"


class EmailLabel(Base):
    __tablename__ = "email_label"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"))
    label: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(32))  # MODEL_SOURCE, ORIGIN_SOURCE or another
    confidence: Mapped[float | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (
        UniqueConstraint("email_id", "label"),
        # The search by label, newest email first.
        Index("ix_email_label_label", "label", "email_id"),
    )


class Classification(Base):
    """The model's answer for one run; a re-run replaces it rather than adding another."""

    __tablename__ = "classification"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("pipeline_run.id"), unique=True)
    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"))
    model_id: Mapped[str] = mapped_column(String(255))
    prompt_version: Mapped[str] = mapped_column(String(64))
    output: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The labels as [label, confidence] pairs: what a later attempt syncs without calling again.
    labels: Mapped[list[list[Any]] | None] = mapped_column(JSON)
    input_tokens: Mapped[int | None]
    output_tokens: Mapped[int | None]
    latency_ms: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    # An email's answers: deleting the email checks for them.
    __table_args__ = (Index("ix_classification_email_id", "email_id"),)


class ModelInput(Base):
    """What the classifier reads of an email, kept by the CPU stage for the classification stage,
    which thereby never parses the email or converts its documents again."""

    __tablename__ = "model_input"

    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"), primary_key=True)
    input: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BatchState(enum.StrEnum):
    """Where a batch of the bulk lane's model calls is (mailpipe.pipeline.batches)."""

    FORMING = "forming"  # its records are chosen; its input is written and submitted next
    SUBMITTED = "submitted"  # Bedrock has the job; the leader follows it
    APPLYING = "applying"  # the job completed; its answers are being applied
    DONE = "done"  # every record applied, or sent back to wait; its objects deleted
    ENDED = "ended"  # the job failed, stopped or expired: its records wait again


class ModelBatch(Base):
    """One Bedrock batch inference job of the bulk lane's model stage."""

    __tablename__ = "model_batch"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    state: Mapped[BatchState] = mapped_column(_enum(BatchState, "batch_state"))
    job_arn: Mapped[str | None] = mapped_column(Text)
    # The provider's status as last read (Submitted, InProgress, Completed, Failed, ...).
    job_status: Mapped[str | None] = mapped_column(String(32))
    input_key: Mapped[str] = mapped_column(Text)  # blob key of the JSONL input
    output_key: Mapped[str] = mapped_column(Text)  # blob key of the folder Bedrock writes under
    records: Mapped[int]
    answered: Mapped[int | None]  # records applied with an answer
    unanswered: Mapped[int | None]  # records without one: each a failed attempt of its email
    error: Mapped[str | None] = mapped_column(Text)  # the provider's message for a job that ended
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    submitted_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_model_batch_state", "state"),)


class ModelBatchRecord(Base):
    """An email whose model stage waits for a batch: formed into none yet (`batch_id` NULL),
    or one record of batch `batch_id`. `realtime`: it waited past MAILPIPE_MODEL_BATCH_MAX_WAIT
    below the batch minimum, and its model stage was sent through real-time Converse."""

    __tablename__ = "model_batch_record"

    email_id: Mapped[int] = mapped_column(ForeignKey("email_message.id"), primary_key=True)
    batch_id: Mapped[int | None] = mapped_column(ForeignKey("model_batch.id"))
    realtime: Mapped[bool] = mapped_column(default=False)
    since: Mapped[datetime] = mapped_column(default=utcnow)  # waiting for a batch since

    __table_args__ = (
        Index("ix_model_batch_record_batch_id", "batch_id"),
        Index("ix_model_batch_record_since", "since"),
    )


class Reprocess(Base):
    """An operator's re-run of ended emails from one step (`mailpipe reprocess`): what it took,
    by whom, and how many; its runs name it (`PipelineRun.reprocess_id`)."""

    __tablename__ = "reprocess"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))
    from_step: Mapped[str] = mapped_column(String(16))  # classify, documents or parse
    lane: Mapped[str] = mapped_column(String(8))
    # Written empty: the filter's values may be an email's sender or subject, which a forget
    # must leave nowhere. The release before wrote the filter as the search's fields here.
    search: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The names of the filter's fields (["sender", "subject"]), what its progress shows of it;
    # NULL on a reprocess of the release before.
    filters: Mapped[list[str] | None] = mapped_column(JSON)
    emails: Mapped[int]  # what its plan counted, which it takes at most
    # The runs it reopened, counted in each batch's transaction; NULL on a reprocess of the
    # release before, which took `emails`.
    taken: Mapped[int | None]


class ForgottenEmail(Base):
    """An email being forgotten (`mailpipe forget`): the fence its jobs check, beside Redis's,
    written with its run's closing and kept as long as Redis keeps its fence (housekeeping),
    so that a Redis that restarts without its data takes no fence with it."""

    __tablename__ = "forgotten_email"

    email_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    forgotten_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_forgotten_email_forgotten_at", "forgotten_at"),)


class OperatorPause(Base):
    """A stage an operator paused (`mailpipe pause`), kept here so that a flushed or restarted
    Redis cannot end it: the workers put it back (mailpipe.pipeline.stage_pauses). An outage's
    pause is not kept: its own check sets it again if the outage lasts."""

    __tablename__ = "operator_pause"

    stage: Mapped[str] = mapped_column(String(16), primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    since: Mapped[datetime] = mapped_column(default=utcnow)


class MailboxPause(Base):
    """A mailbox an operator paused (`mailpipe pause --mailbox`), named as shown ("default" for
    the default mailbox), kept here so that a flushed or restarted Redis cannot end it: the
    workers put it back (mailpipe.pipeline.mailbox_pauses)."""

    __tablename__ = "mailbox_pause"

    mailbox: Mapped[str] = mapped_column(Text, primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    since: Mapped[datetime] = mapped_column(default=utcnow)


class RuntimeFlag(Base):
    """Durable runtime switches (model calls on/off) that workers read at job time."""

    __tablename__ = "runtime_flag"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    enabled: Mapped[bool]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class SweepReport(Base):
    """What each sweep found, for `mailpipe status` and the operator's history."""

    __tablename__ = "sweep_report"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    readded_no_run: Mapped[int] = mapped_column(default=0)
    readded_stalled: Mapped[int] = mapped_column(default=0)
    skipped_queued: Mapped[int] = mapped_column(default=0)
    marked_for_review: Mapped[int] = mapped_column(default=0)
    # Runs that waited for model calls and whose model stage the sweep started (no re-add);
    # NULL on a report of the release before.
    started_waiting: Mapped[int | None]
    queue_depth: Mapped[int | None]
    backlog_per_task: Mapped[float | None]


class QueueSample(Base):
    """One lane's depth and oldest job as a metrics report read them, for the console's charts
    (mailpipe.operations.activity): a row per lane per report, kept a day."""

    __tablename__ = "queue_sample"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    measured_at: Mapped[datetime]
    queue: Mapped[str] = mapped_column(String(255))  # the stage's queue (`Queue` dimension)
    lane: Mapped[str] = mapped_column(String(8))
    depth: Mapped[int]
    oldest_age_s: Mapped[float]
    deferred: Mapped[int | None]  # the lane's deferrals since the report before

    __table_args__ = (Index("ix_queue_sample_measured_at", "measured_at"),)


class HealthCheck(Base):
    """The row the database's health check writes (mailpipe.pipeline.health): a write the fleet
    owns, so that a database that takes no writes is told apart from one email's error."""

    __tablename__ = "health_check"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    checked_at: Mapped[datetime] = mapped_column(default=utcnow)
