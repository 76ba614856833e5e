"""What a delivery's facts mean: plain functions from a run's facts (and the error, and the
dependency's own check) to what comes next.

- `Verdict` is what one delivery of a job comes to: what happened, and for a retry or a
  deferral when the next delivery is due. The task shell maps it to Celery's actions in one
  place (`EmailJobTask.follow`); the state store (mailpipe.pipeline.runs) records it.
- `Ending` is how an attempt the next claim finds unfinished ended, for its row in the run's
  history and the run's counts after it, which the state store writes in one fenced write.

The attempt, shutdown and deferral limits are read here and nowhere else under `pipeline/`: how
many attempts a run has (MAILPIPE_MAX_RETRIES + 1), how often a worker's shutdown may cut its job
off (MAILPIPE_MAX_SHUTDOWN_CUTOFFS), how long a retry waits (MAILPIPE_RETRY_BACKOFF_*), how a
deferral grows and how long a job may be deferred in all (MAILPIPE_DEFER_*,
MAILPIPE_MAX_DEFERRAL). Nothing here touches a database, Redis, the clock or a random source:
the caller hands in the time and the jitter, so every branch is tested without a service
(tests/unit/pipeline/test_policy.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mailpipe.errors import (
    Dependency,
    PermanentError,
    Throttled,
    dependency_of,
    describe,
    is_soft_time_limit,
    is_transient,
)
from mailpipe.settings import Settings
from mailpipe.storage.models import AttemptOutcome, ErrorClass


class Kind(enum.StrEnum):
    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    WAITING = "waiting"  # open: the documents are stored, model calls are off
    CLOSED = "already_closed"  # nothing done: the run was closed, or a later claim holds it
    FAILED = "failed"
    RETRY = "retry"  # an attempt failed and attempts remain: send again after `delay`
    DEFER = "deferred"  # not an attempt: send again after `delay`
    PAUSED = "paused"  # not an attempt: the stage is paused, the job goes back to its queue
    HANDED_OFF = "handed_off"  # the CPU stage is done: send the model stage
    HELD = "held"  # nothing claimed: its mailbox is paused, and its resume sends the job again
    BATCHED = "waiting_for_batch"  # open: the model stage waits for a batch (pipeline.batches)


@dataclass(frozen=True)
class Verdict:
    """What one delivery comes to."""

    kind: Kind
    delay: float = 0.0  # RETRY, DEFER: seconds before the next delivery
    error: str | None = None  # why, for FAILED, RETRY, DEFER and PAUSED
    # DEFER, PAUSED: when this job was first deferred or sent back by a pause (unix time)
    deferred_since: float | None = None
    outage: Dependency | None = None  # DEFER: the dependency whose outage it waits out
    error_class: str | None = None  # FAILED, RETRY: the class of `error`, as the run keeps it
    # DEFER, PAUSED: the slot of its mailbox's ceiling on model calls the job holds (Redis time),
    # carried by its next delivery so that it passes the ceiling without taking another.
    mailbox_slot: float | None = None
    # DEFER: the job waits for that slot, the time its mailbox's ceiling handed it.
    for_slot: bool = False

    @property
    def follows_up(self) -> bool:
        """Another delivery of the job is to be sent."""
        return self.kind in (Kind.RETRY, Kind.DEFER, Kind.PAUSED, Kind.HANDED_OFF)


_DEFAULTS = Settings.model_fields


@dataclass(frozen=True)
class Limits:
    """The bounds a run's attempts and a job's deferrals are judged by."""

    max_attempts: int
    max_shutdown_cutoffs: int
    # Unless given, as the settings' defaults are.
    retry_backoff_base: float = _DEFAULTS["retry_backoff_base"].default
    retry_backoff_max: float = _DEFAULTS["retry_backoff_max"].default
    defer_base: float = _DEFAULTS["defer_base"].default
    defer_max: float = _DEFAULTS["defer_max"].default
    max_deferral: float = _DEFAULTS["max_deferral"].default

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            settings.max_attempts,
            settings.max_shutdown_cutoffs,
            retry_backoff_base=settings.retry_backoff_base,
            retry_backoff_max=settings.retry_backoff_max,
            defer_base=settings.defer_base,
            defer_max=settings.defer_max,
            max_deferral=settings.max_deferral,
        )


@dataclass(frozen=True)
class Failure:
    """The run fails for good, with this error class and error."""

    error_class: str
    error: str


@dataclass(frozen=True)
class Ending:
    """How an attempt ends (its row in the run's history: `outcome`, `error_class`, `error`),
    the run's counts after it, and `failure` when the run fails with it (else it goes on, its
    error the attempt's)."""

    outcome: AttemptOutcome
    error_class: str | None
    error: str | None
    attempts: int
    cutoffs: int
    failure: Failure | None = None


class Fault(enum.Enum):
    """Whose an attempt's error is, which decides what the job does with it."""

    OUTAGE = "outage"  # the dependency's own check fails too: given back, toward a pause
    THROTTLED = "throttled"  # the provider asked to slow down: given back, deferred
    REJECTED = "rejected"  # the input cannot succeed: the run fails at once
    ATTEMPT = "attempt"  # the email's own failed attempt: retried while attempts remain


def fault_of(exc: BaseException, outage: Dependency | None) -> Fault:
    """Whose `exc` is; `outage`: the dependency whose check failed after the error, if any."""
    if isinstance(exc, Throttled):
        return Fault.THROTTLED
    if outage is not None:
        return Fault.OUTAGE
    if isinstance(exc, PermanentError):
        return Fault.REJECTED
    return Fault.ATTEMPT


def attempt_error(exc: BaseException, soft_time_limit: float) -> tuple[str, bool]:
    """What a failed attempt's error is recorded as, and whether it is unforeseen (a bug or a
    library error no one classified, worth its traceback in the log)."""
    if is_soft_time_limit(exc):
        return f"soft time limit ({soft_time_limit} s) exceeded", False
    if is_transient(exc) or dependency_of(exc) is not None:
        return describe(exc), False
    return f"unexpected {describe(exc)}", True


def retry_delay(
    limits: Limits, attempt: int, jitter: float, retry_after: float | None = None
) -> float:
    """Exponential backoff with equal jitter: c/2 + jitter * c/2 for `jitter` in [0, 1], c =
    min(max, base * 2**(attempt-1)), or the service's own `retry_after` hint when it gave one;
    never more than the maximum.

    Half of each backoff is certain, so that the retries of an email span a known least time
    (MAILPIPE_RETRY_BACKOFF_BASE); the other half spreads the retries of jobs that failed
    together. Celery's own helper draws whole seconds of full jitter only.
    """
    if retry_after is not None:
        return min(retry_after, limits.retry_backoff_max)
    ceiling = min(limits.retry_backoff_max, limits.retry_backoff_base * 2 ** (attempt - 1))
    return ceiling / 2 + jitter * ceiling / 2


def retry(
    limits: Limits,
    attempt: int,
    error: str | None,
    *,
    error_class: str | None,
    jitter: float,
    retry_after: float | None = None,
) -> Verdict:
    """A failed attempt the run goes on from: sent again after its backoff."""
    delay = retry_delay(limits, attempt, jitter, retry_after)
    return Verdict(Kind.RETRY, delay, error, error_class=error_class)


def deferral_delay(limits: Limits, waited: float) -> float:
    """How long a job that has waited `waited` seconds already waits next: doubles with the time
    waited, from MAILPIPE_DEFER_BASE up to MAILPIPE_DEFER_MAX."""
    return min(limits.defer_max, limits.defer_base + waited)


def deferred(limits: Limits, wanted: Verdict, now: float) -> Verdict:
    """A deferral (`wanted`, of kind DEFER) as it goes out at `now`: its delay held within half
    a second and MAILPIPE_RETRY_BACKOFF_MAX (so never past the visibility timeout), its first
    deferral's time kept; or FAILED once the job would have waited past MAILPIPE_MAX_DEFERRAL in
    all, unless it waits out an outage, which has no bound. A wait for the slot its mailbox's
    ceiling handed it (`for_slot`) has no bound either, and starts no clock: the slot is a known
    time, which a backlog of the mailbox's own sets, and a slot further off than the longest
    deferral is waited for in several."""
    delay = min(max(wanted.delay, 0.5), limits.retry_backoff_max)
    if wanted.for_slot:
        return Verdict(
            Kind.DEFER,
            delay,
            wanted.error,
            wanted.deferred_since,
            mailbox_slot=wanted.mailbox_slot,
            for_slot=True,
        )
    since = wanted.deferred_since or now
    if wanted.outage is None and now + delay - since > limits.max_deferral:
        error = (
            f"deferred for {now - since:.0f} s in all, past MAILPIPE_MAX_DEFERRAL "
            f"({limits.max_deferral} s): {wanted.error}"
        )
        return Verdict(Kind.FAILED, error=error, error_class=ErrorClass.DEFERRED_TOO_LONG)
    return Verdict(
        Kind.DEFER,
        delay,
        wanted.error,
        since,
        outage=wanted.outage,
        mailbox_slot=wanted.mailbox_slot,
    )


def unfinished(
    attempts: int, cutoffs: int, limits: Limits, *, cut_off: float | None, shutdown: bool
) -> Ending:
    """The run's last attempt ended without a result, found so by the next claim: cut off by the
    hard time limit (`cut_off`, its seconds), cut off by its worker's shutdown (`shutdown`: the
    attempt is given back, up to the shutdown bound), or else lost (its process died, or its
    lease lapsed)."""
    if cut_off is not None:
        ended = (
            AttemptOutcome.CUT_OFF,
            ErrorClass.HARD_TIME_LIMIT,
            f"attempt {attempts} was cut off by the hard time limit ({cut_off:g} s)",
        )
    elif shutdown:
        attempts, cutoffs = max(0, attempts - 1), cutoffs + 1
        ended = (
            AttemptOutcome.CUT_OFF,
            ErrorClass.SHUTDOWN_CUTOFFS,
            f"cut off by shutdown ({cutoffs} of at most {limits.max_shutdown_cutoffs}): its "
            "worker stopped before the job ended; the attempt was given back",
        )
    else:
        ended = (
            AttemptOutcome.LOST,
            ErrorClass.LOST,
            f"attempt {attempts} ended without a result: its worker process died or was "
            "killed, or stopped renewing its lease",
        )
    outcome, error_class, error = ended
    failure = None
    if shutdown and cut_off is None and cutoffs >= limits.max_shutdown_cutoffs:
        failure = Failure(
            ErrorClass.SHUTDOWN_CUTOFFS,
            f"cut off by shutdown {cutoffs} times: the job runs longer than any worker's "
            "soft-shutdown window (MAILPIPE_SOFT_SHUTDOWN_TIMEOUT) lets it",
        )
    elif attempts >= limits.max_attempts:
        failure = Failure(error_class, used_up(attempts, error))
    return _ends(outcome, error_class, error, attempts, cutoffs, failure)


def failed_attempt(
    attempts: int, cutoffs: int, limits: Limits, error_class: str, error: str
) -> Ending:
    """An attempt failed with an error that is worth another: retried while attempts remain,
    the run failed once none do."""
    failure = None
    if attempts >= limits.max_attempts:
        failure = Failure(error_class, used_up(attempts, error))
    return _ends(AttemptOutcome.RETRYING, error_class, error, attempts, cutoffs, failure)


def past_lowered_limit(
    attempts: int, limits: Limits, error_class: str | None, error: str | None
) -> Failure | None:
    """A claim of a run whose last attempt ended with attempts left under a limit lowered since:
    the run fails without another attempt; None when attempts remain."""
    if attempts < limits.max_attempts:
        return None
    return Failure(error_class or ErrorClass.ATTEMPTS_USED_UP, used_up(attempts, error))


def used_up(attempts: int, error: str | None) -> str:
    return f"gave up after {attempts} attempts: {error or 'no error recorded'}"


def _ends(
    outcome: AttemptOutcome,
    error_class: str | None,
    error: str | None,
    attempts: int,
    cutoffs: int,
    failure: Failure | None,
) -> Ending:
    # An attempt that fails its run is recorded as the attempt that failed it.
    shown = AttemptOutcome.FAILED if failure is not None else outcome
    return Ending(shown, error_class, error, attempts, cutoffs, failure)
