"""The process's connections to the outside: database, blob store, Redis and classifier.

Built lazily, once per process, and rebuilt after a fork (`worker_process_init` calls `reset`), so
no socket or thread is ever shared between a worker's children.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

from redis import Redis

from mailpipe.blobstore import BlobStore, open_blobstore
from mailpipe.classifiers import Classifier, make_classifier
from mailpipe.db import Database
from mailpipe.settings import Settings, get_settings


@dataclass
class Resources:
    settings: Settings
    pid: int = field(default_factory=os.getpid)

    @cached_property
    def db(self) -> Database:
        return Database(self.settings.database_url)

    @cached_property
    def blobs(self) -> BlobStore:
        return open_blobstore(self.settings.blob_url, self.settings.s3_endpoint_url)

    @cached_property
    def redis(self) -> Redis:
        # The broker's Redis also holds leases, dedup markers and locks: one service to run.
        return Redis.from_url(
            self.settings.broker_url,
            socket_timeout=10,
            socket_connect_timeout=5,
            health_check_interval=30,
        )

    @cached_property
    def classifier(self) -> Classifier:
        return make_classifier(self.settings)

    def close(self) -> None:
        if "db" in self.__dict__:
            self.db.dispose()
        if "redis" in self.__dict__:
            self.redis.close()


_current: Resources | None = None


def get_resources() -> Resources:
    global _current
    if _current is None or _current.pid != os.getpid():
        _current = Resources(get_settings())
    return _current


def reset() -> None:
    """Forget what the parent process built; the next `get_resources` builds anew."""
    global _current
    _current = None
