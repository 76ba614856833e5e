"""What can go wrong in a job, sorted by what it says is wrong: the email, the fleet, or neither.

- `PermanentError` (input rejected): the email itself is at fault. Its run fails at once.
- `FleetFault`: the fleet is misconfigured. No run fails and no attempt is used; the job defers
  and enough of them pause the stage (mailpipe.coordination.pauses).
- `Throttled`: a shared limit said "not now". The job defers without using an attempt.
- Anything else (a service down, the soft time limit, a bug): a failed attempt, retried with
  backoff until the attempts are used up.
"""

from __future__ import annotations


class MailpipeError(Exception):
    """Base of mailpipe's own errors."""


class TransientError(MailpipeError):
    """Worth retrying: the cause is outside the email (a service down, busy or throttling).

    `retry_after` is a hint in seconds from whoever knows better than our backoff (a rate limiter,
    a `Retry-After` header); None means use the exponential backoff.
    """

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Throttled(TransientError):
    """A shared limit said "not now" (the fleet's rate limit, the model provider's quota).

    The job did no work worth counting: it is put back on the queue for `retry_after` seconds
    without using one of its attempts, so a throttled job waits its turn instead of failing.
    """


class PermanentError(MailpipeError):
    """Retrying cannot help: the email or the request itself is at fault."""


class InputRejected(PermanentError):
    """The email breaks a limit (size, nesting, part count) or cannot be read as an email."""


class BlobMissing(PermanentError):
    """The row points at a blob key that the store does not have."""


class FleetFault(MailpipeError):
    """The fleet, not the email, is wrong: credentials, permissions or a KMS key refused, a
    missing bucket, model access denied or an unknown model id, a database role without rights.
    Every email would fail the same way until an operator fixes it, so none is failed for it."""


class RunFailed(MailpipeError):
    """Raised by the task after its run was recorded as failed, so that Flower and task events
    list the job as FAILURE with the run's error (nothing is retried: the message is acked)."""


def is_transient(exc: BaseException) -> bool:
    """True for errors of the services around a job that are worth retrying.

    Library errors are named one by one: a database, Redis or S3 that cannot be reached or
    answered "busy". Anything not named here is a bug or bad input and is not retried; so is the
    soft time limit: every service call has a timeout far below it, so a job that reaches it is
    slow by itself and would be again (`is_soft_time_limit`).
    """
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ReadTimeoutError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from sqlalchemy.exc import DBAPIError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeoutError

    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, OperationalError | PoolTimeoutError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(
        exc, RedisConnectionError | RedisTimeoutError | BotoConnectionError | ReadTimeoutError
    )


# SQLSTATE classes and codes of a database that refuses the fleet's role, not one statement:
# 28 invalid authorization (a wrong password, a role that may not log in), 42501 insufficient
# privilege (a grant missing after a migration or a role change).
_FLEET_SQLSTATES = ("28", "42501")


def is_fleet_fault(exc: BaseException) -> bool:
    """True for errors that say the fleet, not the email, is wrong (`FleetFault`)."""
    if isinstance(exc, FleetFault):
        return True
    from sqlalchemy.exc import DBAPIError

    if isinstance(exc, DBAPIError):
        code = getattr(exc.orig, "sqlstate", None) or ""
        return any(code.startswith(prefix) for prefix in _FLEET_SQLSTATES)
    return False


def is_soft_time_limit(exc: BaseException) -> bool:
    """The job ran past MAILPIPE_TASK_SOFT_TIME_LIMIT (raised inside it by the pool)."""
    from billiard.exceptions import SoftTimeLimitExceeded

    return isinstance(exc, SoftTimeLimitExceeded)


def describe(exc: BaseException) -> str:
    """`exc` in one line that holds nothing of an email, for logs and a run's error.

    A database error is named by its classes and its SQLSTATE alone: its statement, its
    parameters and the server's message (a DETAIL quotes the values of a key) can hold an email's
    subject, sender or text. SQLite's errors have no SQLSTATE.
    """
    from sqlalchemy.exc import DBAPIError

    if isinstance(exc, DBAPIError):
        sqlstate = getattr(exc.orig, "sqlstate", None)
        where = f" (SQLSTATE {sqlstate})" if sqlstate else ""
        return f"{type(exc).__name__}: {type(exc.orig).__name__}{where}"
    return f"{type(exc).__name__}: {exc}"


def error_class(exc: BaseException) -> str:
    """The class `describe` names `exc` by, kept apart for the failed list's filter."""
    return type(exc).__name__
