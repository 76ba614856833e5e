"""The broker transport: kombu's Redis transport, with one Redis client per channel.

kombu's Redis channel builds a new redis-py client for every command it sends outside its BRPOP
loop: filing each delivered message as unacknowledged, acknowledging it, publishing a batch of
task events. Building one copies redis-py's table of response callbacks (about 170 entries) into
a fresh case-insensitive dict, some 70 µs of CPU, twice per job and once per batch of events in
a worker's main process, the one process that hands every job to the pool. A client holds no
connection of its own (each command takes one from the channel's pool and gives it back), so one
client per pool serves every call; a new pool (after a fork or a reconnect) gets a new client.
Measured in docs/benchmarks.md ("The broker transport").

The app's connections, and those of its connection pool (its producers), take this transport
where kombu would take its own Redis transport: `Connection.get_transport_cls`, given to the app
through `AMQP` (mailpipe.celery). The transport is not named in the configuration (Celery's
`broker_transport`): kombu would then put that name in place of the URL's scheme, in `as_uri()`,
which Flower reads to pick its broker view, and when it decides that `rediss://` means TLS.

This overrides kombu's `Channel.conn_or_acquire`, `Connection.get_transport_cls` and
`ConnectionPool.new`, checked against kombu 5.7; `tests/unit/app/test_transport.py` fails if
kombu stops calling them or changes what they give.

`broker_ssl` is the app's `broker_use_ssl`: for `rediss://`, the broker's certificate is verified.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import kombu
import kombu.connection
from celery.app.amqp import AMQP as CeleryAMQP
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    _shared_client: Any = None
    _shared_client_pool: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool
        if self._shared_client is None or self._shared_client_pool is not pool:
            self._shared_client = self._create_client()
            self._shared_client_pool = pool
        yield self._shared_client


class Transport(kombu_redis.Transport):
    Channel = Channel


class _ThisTransport:
    """For a kombu connection: this module's transport where kombu's Redis transport would be."""

    def get_transport_cls(self) -> type:
        found: type = super().get_transport_cls()  # type: ignore[misc]
        return Transport if found is kombu_redis.Transport else found


class Connection(_ThisTransport, kombu.Connection):
    def Pool(self, limit: int | None = None, **kwargs: Any) -> ConnectionPool:
        return ConnectionPool(self, limit, **kwargs)


class PooledConnection(_ThisTransport, kombu.connection.PooledConnection):
    pass


class ConnectionPool(kombu.connection.ConnectionPool):
    """kombu's pool of connections (the app's producers use it), of `PooledConnection`s."""

    def new(self) -> PooledConnection:
        return PooledConnection(self, **dict(self.connection._info(resolve=False)))


class AMQP(CeleryAMQP):
    """Celery's broker plumbing, making its connections with `Connection`."""

    Connection = Connection


def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's `broker_use_ssl` for this broker URL: for `rediss://`, the server's certificate
    verified, as redis-py's own clients of the same URL verify it (mailpipe.resources, the worker
    heartbeat), where kombu alone would not check it; an `ssl_cert_reqs` in the URL's query still
    wins. None otherwise."""
    if urlsplit(url).scheme == "rediss":
        return {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    return None
