"""The broker transport: kombu's Redis transport, taking and acknowledging messages in fewer
round trips, with one Redis client per channel.

kombu's Redis channel spends three synchronous round trips of the worker's main process on each
message: the BRPOP that takes it, the MULTI that files it as unacknowledged (so that it can be
given back if the worker dies), and the MULTI that acknowledges it. Each costs the main process
some 150 µs of CPU here, most of it in the kernel's loopback TCP, and the main process is the one
process that hands every job to the pool. Three changes, measured in docs/benchmarks.md ("The
broker transport"):

- **Fetch.** While the queues have messages, the next one is taken by `FETCH`, a Lua script that
  files it exactly as kombu does (the same index and hash entries, which kombu's restore, the
  heartbeat and mailpipe.coordination.brokerstate read) and pops it, in one step. It is sent the
  way kombu sends BRPOP, without waiting, and its reply is read the same way. When a fetch finds
  the queues empty, the channel goes back to kombu's BRPOP until a message comes. The message is
  filed before it is popped, so no failure in between can lose it, where kombu's BRPOP and MULTI
  leave a window; a reply that never arrives leaves the message filed, and the heartbeat gives it
  back (mailpipe.coordination.heartbeat).
- **Acknowledgements ride the next fetch.** An ack made on the event loop's thread, while no
  BRPOP or fetch is waiting on the channel's connection, is recorded at once for kombu and
  Celery (the prefetch slot is free) and sent to Redis with the fetch that the freed slot starts
  in the same turn of the loop. One the loop does not send that way is sent on its own before the
  loop waits again, as it is when the channel closes. Acks from other threads (the threads pool)
  go out at once, as in kombu. A worker killed in between leaves those messages unacknowledged:
  they run again, as after a kill just before kombu's ack.
- **One client per channel.** kombu built a new redis-py client for every other command, each
  copying redis-py's table of response callbacks (about 70 µs). A client holds no connection of
  its own, so one client per pool serves every call; a new pool (after a fork or a reconnect)
  gets a new client.

The app's connections, and those of its connection pool (its producers), take this transport
where kombu would take its own Redis transport: `Connection.get_transport_cls`, given to the app
through `AMQP` (mailpipe.celery). The transport is not named in the configuration (Celery's
`broker_transport`): kombu would then put that name in place of the URL's scheme, in `as_uri()`,
which Flower reads to pick its broker view, and when it decides that `rediss://` means TLS.

This overrides kombu's `QoS.append`, `QoS.ack`, `Channel._brpop_start`, `Channel._brpop_read`,
`Channel.close`, `Channel.conn_or_acquire`, `MultiChannelPoller.on_poll_start`,
`Transport.register_with_event_loop`, `Connection.get_transport_cls` and `ConnectionPool.new`,
checked against kombu 5.7; `tests/unit/app/test_transport.py` fails if kombu stops calling them
or changes what they give.

`broker_ssl` is the app's `broker_use_ssl`: for `rediss://`, the broker's certificate is verified.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import kombu
import kombu.connection
from celery.app.amqp import AMQP as CeleryAMQP
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)

# KEYS: the unacked index, the unacked hash, then the queues' lists in BRPOP's order.
# ARGV: the time, the number of tags to acknowledge, those tags.
# Acknowledges the tags as kombu's QoS.ack does (ZREM, HDEL), then takes the oldest message of
# the first list that has one and files it as kombu's QoS.append does (ZADD, HSET of
# [payload, exchange, routing key]) before popping it: a write refused (maxmemory) fails the
# script with the message still in its list. A message it cannot read is left in its list, for
# kombu's BRPOP to take and handle as it would.
FETCH = """
local index, unacked = KEYS[1], KEYS[2]
for i = 3, 2 + tonumber(ARGV[2]) do
  redis.call('ZREM', index, ARGV[i])
  redis.call('HDEL', unacked, ARGV[i])
end
for i = 3, #KEYS do
  local item = redis.call('LINDEX', KEYS[i], -1)
  if item then
    local ok, message = pcall(cjson.decode, item)
    local properties = ok and type(message) == 'table' and message['properties']
    local info = type(properties) == 'table' and properties['delivery_info']
    local tag = type(properties) == 'table' and properties['delivery_tag']
    if type(info) ~= 'table' or type(tag) ~= 'string' then
      return false
    end
    redis.call('ZADD', index, ARGV[1], tag)
    redis.call('HSET', unacked, tag, '[' .. item .. ',' .. cjson.encode(info['exchange']) ..
      ',' .. cjson.encode(info['routing_key']) .. ']')
    redis.call('RPOP', KEYS[i])
    return {KEYS[i], item}
  end
end
return false
"""


class QoS(kombu_redis.QoS):
    """kombu's, except that a fetched message is filed already and acks may wait for a fetch."""

    def append(self, message: Any, delivery_tag: str) -> None:
        if self.channel._filed_by_fetch:
            virtual.QoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if self.channel._may_defer_ack():
            self.channel._pending_acks.append(delivery_tag)
            virtual.QoS.ack(self, delivery_tag)
        else:
            super().ack(delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS
    _shared_client: Any = None
    _shared_client_pool: Any = None
    # True while a fetched message is being delivered (QoS.append then files nothing).
    _filed_by_fetch = False
    # True while the command waiting on the channel's connection is a fetch, not a BRPOP.
    _fetching = False
    # The last fetch found nothing: the next wait is kombu's BRPOP.
    _queues_empty = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Tags acknowledged for kombu and Celery, not yet in Redis.
        self._pending_acks: list[str] = []
        # Tags sent with the fetch whose reply has not been read.
        self._acks_in_flight: list[str] = []
        super().__init__(*args, **kwargs)

    def _may_defer_ack(self) -> bool:
        return (
            not self._in_poll
            and not self._closing
            and self.connection._loop_thread == threading.get_ident()
        )

    def _brpop_start(self, timeout: Any = None) -> None:
        if self._acks_in_flight:  # the last fetch's reply was lost: send them again
            self._pending_acks[:0] = self._acks_in_flight
            self._acks_in_flight = []
        if self._queues_empty and not self._pending_acks:
            super()._brpop_start(timeout)
            return
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        prefix = self.global_keyprefix or ""
        keys = [prefix + self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        acks, self._pending_acks = self._pending_acks, []
        connection = self.client.connection
        try:
            connection.send_command(
                "EVAL",
                FETCH,
                2 + len(keys),
                prefix + self.unacked_index_key,
                prefix + self.unacked_key,
                *keys,
                time.time(),
                len(acks),
                *acks,
            )
        except BaseException:
            self._pending_acks[:0] = acks
            raise
        self._acks_in_flight = acks
        self._in_poll = connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        self._fetching = True

    def _brpop_read(self, **options: Any) -> Any:
        fetching, self._fetching = self._fetching, False
        if not fetching:
            self._queues_empty = False
            return super()._brpop_read(**options)
        acks, self._acks_in_flight = self._acks_in_flight, []
        self._filed_by_fetch = True
        try:
            return super()._brpop_read(**options)
        except kombu_redis.Empty:
            self._queues_empty = True
            raise
        except self.ResponseError as exc:
            log.warning("broker: the fetch script failed, the next message comes by BRPOP: %s", exc)
            self._pending_acks[:0] = acks
            self._queues_empty = True
            raise kombu_redis.Empty() from None
        except BaseException:
            # Lost with the connection, or the delivery failed: acknowledging twice is harmless.
            self._pending_acks[:0] = acks
            raise
        finally:
            self._filed_by_fetch = False

    def flush_acks(self) -> None:
        """Send to Redis the acks that no fetch has taken, in one round trip. Failing, they are
        logged as Celery logs a failed ack: those messages come back and their jobs run again."""
        acks, self._pending_acks = self._pending_acks, []
        if not acks:
            return
        try:
            with self.conn_or_acquire() as client:
                pipe = client.pipeline()
                for tag in acks:
                    self.qos._remove_from_indices(tag, pipe)
                pipe.execute()
        except self.connection_errors:
            log.warning("broker: %d acks could not be sent; those jobs run again", len(acks))

    def close(self) -> None:
        # kombu's close reads a reply still due, which may carry acks back; then they go out.
        if self._in_poll and not self.closed:
            try:
                self._brpop_read()
            except kombu_redis.Empty:
                pass
        self.flush_acks()
        super().close()

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


class Poller(kombu_redis.MultiChannelPoller):
    """kombu's poller; before the loop waits, acks that no fetch took go out on their own."""

    def on_poll_start(self) -> None:
        super().on_poll_start()
        for channel in self._channels:
            if channel._pending_acks and not channel._in_poll:
                channel.flush_acks()


class Transport(kombu_redis.Transport):
    Channel = Channel
    # The thread of the event loop this transport is registered with: only its acks may wait.
    _loop_thread: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cycle = Poller()  # type: ignore[assignment]

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._loop_thread = threading.get_ident()
        super().register_with_event_loop(connection, loop)


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
