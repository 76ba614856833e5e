"""What a run's facts mean when an attempt ends: plain functions from the facts to one
`Verdict`, which the state store (mailpipe.pipeline.runs) records in one fenced write.

The attempt and shutdown limits are read here and nowhere else under `pipeline/`: how many
attempts a run has (MAILPIPE_MAX_RETRIES + 1), how often a worker's shutdown may cut its job off
(MAILPIPE_MAX_SHUTDOWN_CUTOFFS). Nothing here touches a database, Redis or the clock, so every
branch is tested without a service (tests/unit/pipeline/test_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from mailpipe.settings import Settings
from mailpipe.storage.models import AttemptOutcome, ErrorClass


@dataclass(frozen=True)
class Limits:
    """The bounds a run's attempts are judged by."""

    max_attempts: int
    max_shutdown_cutoffs: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.max_attempts, settings.max_shutdown_cutoffs)


@dataclass(frozen=True)
class Failure:
    """The run fails for good, with this error class and error."""

    error_class: str
    error: str


@dataclass(frozen=True)
class Verdict:
    """How an attempt ends (its row in the run's history: `outcome`, `error_class`, `error`),
    the run's counts after it, and `failure` when the run fails with it (else it goes on, its
    error the attempt's)."""

    outcome: AttemptOutcome
    error_class: str | None
    error: str | None
    attempts: int
    cutoffs: int
    failure: Failure | None = None


def unfinished(
    attempts: int, cutoffs: int, limits: Limits, *, cut_off: float | None, shutdown: bool
) -> Verdict:
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
) -> Verdict:
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
) -> Verdict:
    # An attempt that fails its run is recorded as the attempt that failed it.
    shown = AttemptOutcome.FAILED if failure is not None else outcome
    return Verdict(shown, error_class, error, attempts, cutoffs, failure)
