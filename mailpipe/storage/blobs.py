"""Blob storage behind one interface: a local folder, or S3 through boto3 (`mailpipe.storage.s3`).

Keys are built and checked in `mailpipe.storage.keys`; no name found in an email ever becomes a
key or a path.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from mailpipe.errors import BlobMissing, InputRejected
from mailpipe.storage.keys import check_folder, check_key


class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The blob's bytes. Raises BlobMissing, a DependencyError, or InputRejected over
        max_bytes."""
        ...

    def delete(self, key: str) -> None:
        """Remove the blob; nothing happens when there is none."""
        ...

    def delete_under(self, prefix: str) -> int:
        """Remove every blob whose key starts with `prefix` (a folder: it ends with /); returns
        how many there were."""
        ...


class LocalBlobStore:
    """A folder on local disk: the embedded default and the demo's store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees half a blob.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_under(self, prefix: str) -> int:
        folder = self._path(check_folder(prefix))
        if not folder.is_dir():
            return 0
        files = [path for path in folder.rglob("*") if not path.is_dir()]
        for path in files:
            path.unlink(missing_ok=True)
        folders = sorted(path for path in folder.rglob("*") if path.is_dir())
        for path in [*reversed(folders), folder]:  # the deepest first
            try:
                path.rmdir()
            except OSError as exc:
                # A blob written meanwhile, whose writer deletes it again: its folder stays.
                if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):
                    raise
        return len(files)

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        try:
            size = path.stat().st_size
            if max_bytes is not None and size > max_bytes:
                raise InputRejected(f"blob is {size} bytes, over the limit of {max_bytes}")
            return path.read_bytes()
        except FileNotFoundError:
            raise BlobMissing(f"blob {key} not found in {self.url}") from None


# Retry mode "standard" retries throttling and 5xx inside boto3 before our own backoff sees them.
def open_blobstore(url: str, endpoint_url: str | None = None) -> BlobStore:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        # file://var/blobs is relative (netloc "var"); file:///srv/blobs is absolute.
        return LocalBlobStore(Path(parsed.netloc + parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"blob URL {url!r} names no bucket")
        # Imported here: boto3 costs a fraction of a second to import, which a process that only
        # enqueues, or uses a local folder, need not pay.
        from mailpipe.storage.s3 import S3BlobStore

        return S3BlobStore(parsed.netloc, parsed.path, endpoint_url)
    raise ValueError(f"blob URL {url!r}: use file://FOLDER or s3://BUCKET/PREFIX")
