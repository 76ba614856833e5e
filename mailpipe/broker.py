"""kombu's Redis transport with one redis-py client per channel instead of one per command.

kombu builds a new redis-py client for every command it sends outside the consumer's BRPOP: each
publish, each task event, each ack and each delivery's unacked bookkeeping. Building a redis-py
8 client costs as much as the round trip itself (its table of response callbacks is rebuilt every
time: about 200 µs against 190 µs for a PUBLISH, docs/benchmarks.md), and a worker's main
process builds five or six per job. A client draws a connection from its pool for each command
and is safe to share between threads, so one per pool sends the same commands for less.

`register()` makes this the transport behind ``redis://`` and ``rediss://`` URLs in this
process. It keeps those schemes, rather than naming the class in `broker_transport`, because
Flower picks its broker client (the queue lengths it shows) by the URL's scheme.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES, redis


class Channel(redis.Channel):
    _sync_client = None

    def _create_client(self, asynchronous: bool = False):  # type: ignore[no-untyped-def]
        if asynchronous:
            return super()._create_client(asynchronous=True)
        # A channel that lost its connection, or was forked, drops its pool and builds a new one.
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client()
        return client


class Transport(redis.Transport):
    Channel = Channel


def register() -> None:
    for scheme in ("redis", "rediss"):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
