"""The broker transport: kombu's Redis transport, with one Redis client per channel.

kombu's Redis channel builds a new redis-py client for every command it sends outside its BRPOP
loop: filing each delivered message as unacknowledged, acknowledging it, publishing a batch of
task events. Building one copies redis-py's table of response callbacks (about 170 entries) into
a fresh case-insensitive dict, some 70 µs of CPU, twice per job and once per batch of events in
a worker's main process, the one process that hands every job to the pool. A client holds no
connection of its own (each command takes one from the channel's pool and gives it back), so one
client per pool serves every call; a new pool (after a fork or a reconnect) gets a new client.
Measured in docs/benchmarks.md ("The broker transport").

This overrides kombu's `Channel.conn_or_acquire`, checked against kombu 5.7;
`tests/unit/app/test_transport.py` fails if kombu stops calling it or changes what it yields.

Naming the transport (Celery's `broker_transport`) means kombu no longer reads it from the URL's
scheme, and with that it no longer turns TLS on for `rediss://`: `broker_ssl` says it instead.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

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


def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's `broker_use_ssl` for this broker URL: TLS for `rediss://`, with the server's
    certificate verified, as redis-py's own clients of the same URL verify it (mailpipe.resources,
    the worker heartbeat); an `ssl_cert_reqs` in the URL's query still wins. None otherwise."""
    if urlsplit(url).scheme == "rediss":
        return {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    return None
