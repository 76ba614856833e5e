"""Whose fault an error is: which dependency's check judges it, and what viewers see of it:
`describe`, which keeps nothing of an email."""

from __future__ import annotations

from email.errors import HeaderParseError

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import IntegrityError, OperationalError

from mailpipe.errors import (
    BlobAccessDenied,
    BlobMissing,
    Dependency,
    InputRejected,
    ModelUnavailable,
    PermanentError,
    Throttled,
    TransientError,
    dependency_of,
    describe,
    error_class,
    input_rejections,
    mask_aws,
)


class _Refused(Exception):
    sqlstate = "42501"


class _Duplicate(Exception):
    sqlstate = "23505"


@pytest.mark.parametrize(
    ("error", "dependency"),
    [
        (BlobAccessDenied("S3 refused GetObject of raw/x: AccessDenied (403)"), Dependency.BLOBS),
        (ModelUnavailable("bedrock unavailable (503)"), Dependency.MODEL),
        (OperationalError("SELECT 1", {}, Exception("refused")), Dependency.DATABASE),
        (OperationalError("SELECT 1", {}, _Refused()), Dependency.DATABASE),
        (RedisConnectionError("refused"), Dependency.REDIS),
        # The email's own, or no dependency's: no check asked.
        (IntegrityError("INSERT", {}, _Duplicate()), None),
        (BlobMissing("blob raw/x not found"), None),
        (Throttled("slow down", retry_after=1.0), None),
        (TransientError("a service that has no check"), None),
        (KeyError("a bug"), None),
    ],
)
def test_each_error_is_judged_by_its_dependency(error: Exception, dependency: Dependency) -> None:
    assert dependency_of(error) is dependency


def test_account_ids_and_arns_are_masked() -> None:
    text = (
        "bedrock refused the call (AccessDeniedException): User: "
        "arn:aws:sts::123456789012:assumed-role/mailpipe-model/task is not authorized; "
        "KMS key arn:aws-us-gov:kms:us-gov-west-1:210987654321:key/abc, account 123456789012."
    )
    masked = mask_aws(text)
    assert "123456789012" not in masked and "210987654321" not in masked
    assert "mailpipe-model" not in masked
    assert masked.count("arn:aws:(masked)") == 2
    assert masked.endswith("account ************.")
    # Numbers of other lengths are left alone: a port, an HTTP status, a 13-digit timestamp.
    assert mask_aws("port 6379, 503, at 1733356800000") == "port 6379, 503, at 1733356800000"
    assert describe(ModelUnavailable(text)) == f"ModelUnavailable: {masked}"


# Words of an email that a parser's or a library's message could quote.
SUBJECT = "Salary review for Jane Roe"
BODY = "Jane's salary rises to 71,000"


def client_error(code: str, status: int, message: str, operation: str) -> ClientError:
    response = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "described"),
    [
        # mailpipe's own: written for an operator, from limits, counts and keys.
        (InputRejected("email is empty"), "InputRejected: email is empty"),
        (
            BlobMissing("blob raw/ab/ab12.eml not found"),
            "BlobMissing: blob raw/ab/ab12.eml not found",
        ),
        (
            Throttled("the fleet's model calls are at their rate"),
            "Throttled: the fleet's model calls are at their rate",
        ),
        (PermanentError(""), "PermanentError"),
        # A service's client telling why it could not reach it.
        (
            RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
            "ConnectionError: Error 111 connecting to 127.0.0.1:6379. Connection refused.",
        ),
        (
            EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b/raw/ab/ab12.eml"),
            'EndpointConnectionError: Could not connect to the endpoint URL: "http://127.0.0.1:9/b/raw/ab/ab12.eml"',
        ),
        (NoCredentialsError(), "NoCredentialsError: Unable to locate credentials"),
        # The rest: named by what their class says without its input.
        (
            client_error("AccessDenied", 403, f"denied: {SUBJECT}", "GetObject"),
            "ClientError: AccessDenied (403) in GetObject",
        ),
        (
            client_error("ValidationException", 400, BODY, "Converse"),
            "ClientError: ValidationException (400) in Converse",
        ),
        (
            OperationalError(f"SELECT '{SUBJECT}'", {"body": BODY}, _Refused()),
            "OperationalError: _Refused (SQLSTATE 42501)",
        ),
        (
            FileNotFoundError(2, "No such file or directory", f"/var/blobs/{SUBJECT}.eml"),
            "FileNotFoundError: [Errno 2] No such file or directory",
        ),
        (OSError(f"cannot read {SUBJECT}"), "OSError"),
        (ValueError(f"invalid header: Subject: {SUBJECT}"), "ValueError"),
        (KeyError(SUBJECT), "KeyError"),
        (
            UnicodeDecodeError("utf-8", BODY.encode(), 0, 1, "invalid start byte"),
            "UnicodeDecodeError",
        ),
        (HeaderParseError(f"expected ':' in {SUBJECT}"), "HeaderParseError (email.errors)"),
        (
            ParamValidationError(report=f"Invalid type for parameter Body, value: {BODY}"),
            "ParamValidationError (botocore.exceptions)",
        ),
        (SoftTimeLimitExceeded(), "SoftTimeLimitExceeded (billiard.exceptions)"),
    ],
)
def test_describe_keeps_a_message_only_when_its_class_writes_none_of_its_input(
    error: BaseException, described: str
) -> None:
    assert describe(error) == described
    assert "Jane" not in described and "71,000" not in described


def test_an_aws_error_is_masked_in_what_is_kept() -> None:
    error = client_error(
        "AccessDenied", 403, "arn:aws:iam::123456789012:role/x is not authorized", "GetObject"
    )
    assert describe(error) == "ClientError: AccessDenied (403) in GetObject"
    refused = BlobAccessDenied("S3 refused GetObject of raw/x: account 123456789012")
    assert (
        describe(refused) == "BlobAccessDenied: S3 refused GetObject of raw/x: account ************"
    )


def test_the_input_rejections_are_the_errors_of_an_email_a_retry_cannot_change() -> None:
    """A retry reads the same bytes: what broke a limit breaks it again. A missing blob can be
    put back, and a refused model call or object is the dependency's word on that call."""
    assert input_rejections() == ("InputRejected",)
    assert all(
        error_class(exc) not in input_rejections() for exc in (BlobMissing("k"), Throttled("t"))
    )
    assert error_class(InputRejected("email is empty")) in input_rejections()
