from __future__ import annotations

from pathlib import Path

import pytest

from mailpipe.errors import BlobMissing, InputRejected, TransientError
from mailpipe.storage.blobs import LocalBlobStore, open_blobstore
from mailpipe.storage.keys import raw_email_key
from mailpipe.storage.s3 import S3BlobStore

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path: Path, services: None):  # type: ignore[no-untyped-def]
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    from mailpipe.settings import get_settings

    settings = get_settings()
    return open_blobstore(settings.blob_url, settings.s3_endpoint_url)


def test_round_trip_missing_and_size_limit(store) -> None:  # type: ignore[no-untyped-def]
    key = raw_email_key("ab" * 32)
    store.put(key, b"raw email bytes")
    assert store.get(key) == b"raw email bytes"
    with pytest.raises(InputRejected, match="over the limit"):
        store.get(key, max_bytes=3)
    with pytest.raises(BlobMissing):
        store.get(raw_email_key("cd" * 32))


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a/../../b", "Upper/Case", "with space"])
def test_keys_that_could_escape_are_refused(store, key: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="invalid blob key"):
        store.put(key, b"x")


def test_unreachable_s3_is_transient() -> None:
    store = S3BlobStore("bucket", "p", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(TransientError):
        store.get(raw_email_key("ef" * 32))


def test_blob_urls() -> None:
    local = open_blobstore("file://var/blobs")
    assert isinstance(local, LocalBlobStore) and local.root == Path("var/blobs")
    s3 = open_blobstore("s3://bucket/some/prefix", "http://127.0.0.1:1")
    assert isinstance(s3, S3BlobStore) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    with pytest.raises(ValueError):
        open_blobstore("ftp://x")
