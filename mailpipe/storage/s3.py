"""Blob storage in an S3 bucket, through boto3: the production implementation of `BlobStore`."""

from __future__ import annotations

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from mailpipe.errors import (
    BlobAccessDenied,
    BlobMissing,
    BlobUnavailable,
    InputRejected,
    PermanentError,
    describe,
)
from mailpipe.storage.keys import check_folder, check_key

_S3_CONFIG = Config(
    retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=30
)

# Codes with which S3 refuses a call: credentials, the bucket's policy or account, the bucket
# itself, or one object (its KMS key, its owner, a policy on its tags). Whether every object is
# refused or this one, the blob store's check says (mailpipe.pipeline.health). With s3:ListBucket
# granted (deploy/iam), a missing key is a 404, never an AccessDenied.
_REFUSED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "NoSuchBucket",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_BUSY_CODES = frozenset({"SlowDown", "RequestTimeout", "Throttling"})


class S3BlobStore:
    """An S3 bucket and prefix (``s3://bucket/prefix``), through boto3."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}"
        # endpoint_url None lets boto3 apply AWS_ENDPOINT_URL_S3 and the usual credential chain,
        # which reads the environment's credentials here (the rest when a call is signed).
        try:
            self.client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, config=_S3_CONFIG
            )
        except BotoCoreError as exc:
            raise _s3_error(exc, "client creation", self.url) from exc

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, "PutObject", key) from exc

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, "DeleteObject", key) from exc

    def delete_under(self, prefix: str) -> int:
        # A page of ListObjectsV2 holds at most 1,000 keys, as many as DeleteObjects takes.
        deleted = 0
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(check_folder(prefix))
            )
            for page in pages:
                keys = [{"Key": found["Key"]} for found in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True}
                    )
                    deleted += len(keys)
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, "DeleteObjects", prefix) from exc
        return deleted

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            size = response["ContentLength"]
            if max_bytes is not None and size > max_bytes:
                response["Body"].close()
                raise InputRejected(f"blob is {size} bytes, over the limit of {max_bytes}")
            return response["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, "GetObject", key) from exc


def _s3_error(exc: Exception, operation: str, key: str) -> Exception:
    """The taxonomy's error for a failed S3 call: its message names the operation, the key (a
    hash, nothing of the email) and S3's code."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return BlobAccessDenied(
            f"S3 {operation} of {key}: {type(exc).__name__} (no usable credentials)"
        )
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = error.get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _REFUSED_CODES or code.startswith("KMS.") or _names_kms(status, error):
            return BlobAccessDenied(f"S3 refused {operation} of {key}: {code} ({status})")
        if code in _MISSING_CODES:
            return BlobMissing(f"blob {key} not found")
        if status < 500 and code not in _BUSY_CODES:
            return PermanentError(f"S3 refused {operation} of {key}: {code} ({status})")
    return BlobUnavailable(f"S3 unavailable for {operation} of {key}: {describe(exc)}")


def _names_kms(status: int, error: dict) -> bool:
    """A 403 about the bucket's KMS key (its key disabled, deleted or not granted to the role)."""
    return status == 403 and "KMS" in f"{error.get('Code', '')} {error.get('Message', '')}"
