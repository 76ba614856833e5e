"""What can go wrong in a job, sorted by what it says is wrong: the email, a dependency, or
neither.

- `PermanentError` (input rejected): the email itself is at fault. Its run fails at once.
- An error of a dependency (`dependency_of`: S3, the model, the database, Redis): whose fault it
  is, the fleet's or the email's, is not read from the error. The dependency's own check decides
  (mailpipe.pipeline.health): when the check fails too, it is an outage or a refusal of the whole
  fleet, which fails no run and uses no attempt (the job waits, and enough of them pause the
  stage, mailpipe.coordination.pauses); when the check passes, it is the email's failed attempt.
- `Throttled`: a shared limit said "not now". The job defers without using an attempt.
- Anything else (the soft time limit, a bug): a failed attempt, retried with backoff until the
  attempts are used up.
"""

from __future__ import annotations

import enum
import re


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


class Dependency(enum.StrEnum):
    """A service a job depends on, each with a check the fleet owns (mailpipe.pipeline.health)."""

    BLOBS = "blobs"
    MODEL = "model"
    DATABASE = "database"
    REDIS = "redis"


class DependencyError(TransientError):
    """A call to a dependency failed: unavailable (5xx, a timeout, a refused connection) or
    refused (credentials, permissions, a KMS key, a missing bucket, model access). Whether the
    fleet or this one email is refused, only the dependency's check can say."""

    dependency: Dependency


class BlobUnavailable(DependencyError):
    dependency = Dependency.BLOBS


class BlobAccessDenied(DependencyError):
    """S3 refused the call: for every object (credentials, the bucket's policy, a missing
    bucket) or for this one (a KMS key the role lacks, an object another account owns, a deny
    on objects tagged by a malware scan)."""

    dependency = Dependency.BLOBS


class ModelUnavailable(DependencyError):
    dependency = Dependency.MODEL


class ModelAccessDenied(DependencyError):
    """The model service refused the call: access not granted, an unknown model id, an account
    quota, credentials."""

    dependency = Dependency.MODEL


class BatchUnanswered(TransientError):
    """A batch inference job left an email's record without an answer: that email's failed
    attempt, retried in a later batch."""


class RunFailed(MailpipeError):
    """Raised by the task after its run was recorded as failed, so that Flower and task events
    list the job as FAILURE with the run's error (nothing is retried: the message is acked)."""


class Unexpected(MailpipeError):
    """An exception no one caught, as it leaves a task: in `describe`'s words, with the
    original's traceback, so that Celery's log line, its task events and Flower say nothing of
    the email its message may have quoted."""


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


# SQLSTATE classes and codes of a database that refuses a role: 28 invalid authorization (a
# wrong password, a role that may not log in), 42501 insufficient privilege (a grant missing
# after a migration or a role change). The database's check says whether it refuses the fleet.
_REFUSED_SQLSTATES = ("28", "42501")


def dependency_of(exc: BaseException) -> Dependency | None:
    """The dependency whose call raised `exc`, when its check is to judge whose fault it is;
    None for the email's own errors, throttling, and errors of no dependency."""
    if isinstance(exc, Throttled):
        return None
    if isinstance(exc, DependencyError):
        return exc.dependency
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from sqlalchemy.exc import DBAPIError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeoutError

    if isinstance(exc, OperationalError | PoolTimeoutError):
        return Dependency.DATABASE
    if isinstance(exc, DBAPIError):
        code = getattr(exc.orig, "sqlstate", None) or ""
        if exc.connection_invalidated or code.startswith(_REFUSED_SQLSTATES):
            return Dependency.DATABASE
        return None
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return Dependency.REDIS
    return None


def is_soft_time_limit(exc: BaseException) -> bool:
    """The job ran past MAILPIPE_TASK_SOFT_TIME_LIMIT (raised inside it by the pool)."""
    from billiard.exceptions import SoftTimeLimitExceeded

    return isinstance(exc, SoftTimeLimitExceeded)


# SQLSTATE 57014, query_canceled: a statement past its statement timeout, or cancelled by an
# operator (pg_cancel_backend).
_CANCELED_SQLSTATE = "57014"


def is_statement_timeout(exc: BaseException) -> bool:
    """PostgreSQL gave up a statement: past its statement timeout (the web role's reads:
    MAILPIPE_WEB_STATEMENT_TIMEOUT_MS), or cancelled."""
    from sqlalchemy.exc import DBAPIError

    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) == _CANCELED_SQLSTATE


def describe(exc: BaseException) -> str:
    """`exc` in one line that holds nothing of an email: what a run's error, an attempt's, a
    log line and Celery's view of a task (Flower, task events) say of it.

    An exception's message is kept only when its class is known to write none of its input:
    mailpipe's own errors, whose messages name limits, counts, codes and keys (hashes), and
    the errors of a service's client that name the service (`_own_words`). Of the others:

    - a database error: its classes and its SQLSTATE; its statement, its parameters and the
      server's message (a DETAIL quotes the values of a key) can hold an email's subject,
      sender or text. SQLite's errors have no SQLSTATE;
    - botocore's `ClientError`: the service's error code, the HTTP status and the operation,
      not the service's message, which may quote the request;
    - an `OSError`: its errno and strerror, not its file names (a blob's path);
    - anything else (a ValueError from a header, a KeyError, a library's parse error): its
      class alone, with its module when it is not a builtin, as its message may quote the
      text it could not read.
    """
    name = type(exc).__name__
    detail = _detail(exc)
    if detail is None:
        module = type(exc).__module__
        return name if module == "builtins" else f"{name} ({module})"
    return mask_aws(f"{name}: {detail}" if detail else name)


def _detail(exc: BaseException) -> str | None:
    """What `describe` keeps after the class's name; None when only the class may be named."""
    from botocore.exceptions import ClientError
    from sqlalchemy.exc import DBAPIError

    if isinstance(exc, DBAPIError):
        sqlstate = getattr(exc.orig, "sqlstate", None)
        return type(exc.orig).__name__ + (f" (SQLSTATE {sqlstate})" if sqlstate else "")
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code") or "no code"
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{code}{f' ({status})' if status else ''} in {exc.operation_name}"
    if isinstance(exc, OSError):
        if exc.errno is None:
            return None
        return f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else f"[Errno {exc.errno}]"
    if isinstance(exc, _own_words()):
        return str(exc)
    return None


def _own_words() -> tuple[type[BaseException], ...]:
    """Classes whose messages are written from what they know of themselves, never from their
    input: mailpipe's own, and the clients of Redis, the broker, the database's pool and AWS
    telling why they could not reach or sign in to their service."""
    from botocore.exceptions import (
        ConnectionClosedError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from kombu.exceptions import OperationalError as BrokerUnavailable
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from sqlalchemy.exc import TimeoutError as PoolTimeoutError

    return (
        MailpipeError,
        RedisConnectionError,
        RedisTimeoutError,
        BrokerUnavailable,
        PoolTimeoutError,
        BotoConnectionError,
        ConnectionClosedError,
        ReadTimeoutError,
        NoCredentialsError,
        PartialCredentialsError,
    )


# An ARN names an account and a role or key; a bare 12-digit number is an account id. Neither
# is for viewers of the console, the API or `status`.
_ARN = re.compile(r"arn:aws[a-z-]*:[^\s\"',;)]*")
_ACCOUNT_ID = re.compile(r"(?<![0-9])[0-9]{12}(?![0-9])")


def mask_aws(text: str) -> str:
    """`text` with AWS ARNs and account ids masked."""
    return _ACCOUNT_ID.sub("************", _ARN.sub("arn:aws:(masked)", text))


def error_class(exc: BaseException) -> str:
    """The class `describe` names `exc` by, kept apart for the failed list's filter."""
    return type(exc).__name__


def input_rejections() -> tuple[str, ...]:
    """The error classes (`error_class`) of a run failed because its email breaks a limit or is
    no email (`InputRejected` and its subclasses): a retry reads the same bytes and fails again.
    A missing blob is not one of them: put back, its email runs."""
    found, classes = [], [InputRejected]
    while classes:
        cls = classes.pop()
        found.append(cls.__name__)
        classes.extend(cls.__subclasses__())
    return tuple(sorted(found))
