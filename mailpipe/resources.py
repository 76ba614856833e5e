"""The process's connections to the outside: database, blob store, Redis and classifier.

Built lazily, once per process, and rebuilt after a fork (`worker_process_init` calls `reset`), so
no socket or thread is ever shared between a worker's children. Each is also imported when first
used: a process that only enqueues (upstream code) loads neither SQLAlchemy nor boto3.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from redis import Redis

from mailpipe.settings import Settings, get_settings

if TYPE_CHECKING:
    from mailpipe.broker.queues import Stage
    from mailpipe.classifiers import Classifier
    from mailpipe.coordination.pauses import CachedPauses, MailboxPause, Pause
    from mailpipe.storage.blobs import BlobStore
    from mailpipe.storage.db import Database
    from mailpipe.storage.flags import CachedModelCalls


@dataclass
class Resources:
    settings: Settings
    pid: int = field(default_factory=os.getpid)
    # False in a process that runs jobs, unless MAILPIPE_WORKER_SYNCHRONOUS_COMMIT says otherwise
    # (`for_jobs`).
    synchronous_commit: bool = True
    # The statement timeout of `db.reading()` and `searches.reading()` (milliseconds): the web
    # role's (`for_web`); None elsewhere, where a read may take what any statement may.
    read_timeout_ms: int | None = None

    @classmethod
    def for_jobs(cls, settings: Settings) -> Resources:
        """The resources of a process that runs jobs: every row it writes is derived from a
        stored email, so its commits need not wait for the disk (`worker_synchronous_commit`)."""
        return cls(settings, synchronous_commit=settings.worker_synchronous_commit)

    @classmethod
    def for_web(cls, settings: Settings) -> Resources:
        """The resources of the console and the API: their reads given up past
        MAILPIPE_WEB_STATEMENT_TIMEOUT_MS, their actions not."""
        return cls(settings, read_timeout_ms=settings.web_statement_timeout_ms)

    @cached_property
    def db(self) -> Database:
        return self._database(self.settings.db_pool_size)

    @cached_property
    def searches(self) -> Database:
        """The web role's searches: a connection for each search it runs at once
        (MAILPIPE_WEB_SEARCHES) and none in a burst, so that searches at their bound leave
        `db`'s connections to the pages and the actions."""
        return self._database(self.settings.web_searches, burst=0)

    def _database(self, pool_size: int, burst: int | None = None) -> Database:
        from mailpipe.storage.db import ConnectionLimits, Database

        settings = self.settings
        return Database(
            settings.database_url,
            ConnectionLimits(
                connect_timeout=settings.db_connect_timeout,
                statement_timeout=settings.db_statement_timeout,
                keepalives_idle=settings.db_keepalives_idle,
                pool_size=pool_size,
                burst=burst,
            ),
            synchronous_commit=self.synchronous_commit,
            transaction_pooling=settings.db_transaction_pooling,
            read_timeout_ms=self.read_timeout_ms,
        )

    @cached_property
    def blobs(self) -> BlobStore:
        from mailpipe.storage.blobs import open_blobstore

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
    def model_calls(self) -> CachedModelCalls:
        """Whether model calls are on, read from the database at most every few seconds."""
        from mailpipe.storage.flags import CachedModelCalls

        return CachedModelCalls(self.settings.model_calls_cache_seconds)

    @cached_property
    def pauses(self) -> CachedPauses[dict[Stage, Pause]]:
        """The paused stages, read from Redis at most once a second."""
        from mailpipe.coordination.pauses import CachedPauses

        return CachedPauses({}, 1.0)

    @cached_property
    def mailbox_pauses(self) -> CachedPauses[dict[str, MailboxPause]]:
        """The paused mailboxes, read from Redis at most once a second."""
        from mailpipe.coordination.pauses import CachedPauses

        return CachedPauses({}, 1.0)

    @cached_property
    def classifier(self) -> Classifier:
        from mailpipe.classifiers import make_classifier

        return make_classifier(self.settings)

    def with_standins(self, **parts: object) -> Resources:
        """These resources, with `parts` in place of what the properties of those names would
        build (`blobs=`, `classifier=`, `db=`): a test's fault injector, or a database shared
        with another set. Given before the part is first used: nothing built is replaced."""
        for name, part in parts.items():
            if not isinstance(vars(Resources).get(name), cached_property):
                raise TypeError(f"Resources has no part {name!r}")
            if name in self.__dict__:
                raise ValueError(f"the part {name!r} is built already")
            self.__dict__[name] = part
        return self

    def close(self) -> None:
        for built in ("db", "searches"):
            if built in self.__dict__:
                self.__dict__[built].dispose()
        if "redis" in self.__dict__:
            self.redis.close()


_current: Resources | None = None
_runs_jobs = False
# The model role runs jobs on threads: the first jobs of a process may ask at the same moment,
# and must share one set of connections, not build one each.
_building = threading.Lock()


def get_resources() -> Resources:
    global _current
    current = _current
    if current is None or current.pid != os.getpid():
        with _building:
            if _current is None or _current.pid != os.getpid():
                settings = get_settings()
                _current = Resources.for_jobs(settings) if _runs_jobs else Resources(settings)
            current = _current
    return current


def runs_jobs() -> None:
    """This process, and the children it forks, run jobs: `get_resources` builds theirs with
    `Resources.for_jobs`."""
    global _runs_jobs, _current
    _runs_jobs = True
    _current = None


def reset() -> None:
    """Forget what the parent process built; the next `get_resources` builds anew."""
    global _current
    _current = None
