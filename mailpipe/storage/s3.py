"""Blob storage in an S3 bucket, through boto3: the production implementation of `BlobStore`."""

from __future__ import annotations

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from mailpipe.errors import BlobMissing, InputRejected, PermanentError, TransientError
from mailpipe.storage.blobs import check_key

_S3_CONFIG = Config(
    retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=30
)


class S3BlobStore:
    """An S3 bucket and prefix (``s3://bucket/prefix``), through boto3."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}"
        # endpoint_url None lets boto3 apply AWS_ENDPOINT_URL_S3 and the usual credential chain.
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, config=_S3_CONFIG
        )

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, key) from exc

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            size = response["ContentLength"]
            if max_bytes is not None and size > max_bytes:
                response["Body"].close()
                raise InputRejected(f"blob is {size} bytes, over the limit of {max_bytes}")
            return response["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, key) from exc


def _s3_error(exc: Exception, key: str) -> Exception:
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            return BlobMissing(f"blob {key} not found")
        if status < 500 and code not in ("SlowDown", "RequestTimeout", "Throttling"):
            return PermanentError(f"S3 refused {key}: {code}")
    return TransientError(f"S3 unavailable for {key}: {exc}")
