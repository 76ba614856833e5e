"""Whose fault an error is: which dependency's check judges it, and what viewers see of it."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import IntegrityError, OperationalError

from mailpipe.errors import (
    BlobAccessDenied,
    BlobMissing,
    Dependency,
    ModelUnavailable,
    Throttled,
    TransientError,
    dependency_of,
    describe,
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
