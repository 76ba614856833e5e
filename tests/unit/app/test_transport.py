"""The broker transport (mailpipe.app.transport), on the real Redis: every connection of the app
(its pool's too) takes it and keeps the URL's scheme; a fetched message is filed as kombu files it
(kombu's restore gives it back whole) and comes in queue order; acks made on the event loop go out
with the next fetch and leave nothing unacknowledged; a fetch refused for memory, or one that meets
a message it cannot read, pops nothing; it shares one Redis client per channel, kombu's commands
still reach Redis under the run's key prefix, and none builds a client of its own; a `rediss://`
URL gets TLS with the certificate verified. This fails when a kombu upgrade stops going through
the methods the transport overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
from kombu.asynchronous import Hub
from kombu.transport import redis as kombu_redis

from mailpipe.app.transport import FETCH, Channel, Transport
from mailpipe.harness.services import PrivateRedis

QUEUE = "transport-test"


@pytest.fixture
def channel(services: None) -> Iterator[Any]:
    from mailpipe.celery import app

    with app.connection_for_write() as connection:
        channel = connection.default_channel
        channel.queue_declare(QUEUE)
        channel.queue_purge(QUEUE)
        yield channel
        channel.queue_purge(QUEUE)


def test_the_app_connects_through_this_transport(channel: Any) -> None:
    from mailpipe.celery import app

    assert kombu.VERSION[:2] == (5, 7), "re-check mailpipe.app.transport against this kombu"
    assert isinstance(channel.connection, Transport)
    assert isinstance(channel, Channel)
    with app.pool.acquire() as pooled, app.producer_or_acquire() as producer:
        assert isinstance(pooled.transport, Transport)
        assert isinstance(producer.connection.transport, Transport)
    # The URL's own scheme, which Flower reads to pick its broker view.
    assert app.connection_for_read().as_uri().startswith("redis://")


def test_every_call_shares_one_client_and_a_given_client_passes_through(channel: Any) -> None:
    with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
        assert first is second
        assert first.connection_pool is channel.pool
    given = redis.Redis(connection_pool=channel.pool)
    with channel.conn_or_acquire(given) as client:
        assert client is given


def test_a_new_pool_gets_a_new_client(channel: Any) -> None:
    with channel.conn_or_acquire() as before:
        pass
    channel._disconnect_pools()  # what kombu does after a fork
    with channel.conn_or_acquire() as after:
        assert after is not before
        assert after.connection_pool is channel.pool
        assert after.ping()


def test_delivery_and_ack_build_no_client_and_leave_nothing_unacked(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with channel.conn_or_acquire():  # the shared client, built before counting starts
        pass
    built: list[bool] = []
    create = channel._create_client

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs.get("asynchronous", False))
        return create(*args, **kwargs)

    monkeypatch.setattr(channel, "_create_client", counting)
    producer = kombu.Producer(channel)
    for number in range(20):
        producer.publish({"n": number}, routing_key=QUEUE, serializer="json")
    prefix = os.environ["MAILPIPE_REDIS_PREFIX"]
    raw = redis.Redis.from_url(os.environ["MAILPIPE_BROKER_URL"])
    seen = []
    for _ in range(20):
        message = channel.basic_get(QUEUE, no_ack=False)
        assert message is not None
        assert raw.hlen(f"{prefix}unacked") == 1  # filed as unacknowledged, under the prefix
        seen.append(message.decode()["n"])
        message.ack()

    assert sorted(seen) == list(range(20))
    assert built == [], "kombu built its own client for a command"
    assert raw.hlen(f"{prefix}unacked") == 0
    assert raw.zcard(f"{prefix}unacked_index") == 0


def _raw() -> tuple[redis.Redis, str]:
    return redis.Redis.from_url(os.environ["MAILPIPE_BROKER_URL"]), os.environ[
        "MAILPIPE_REDIS_PREFIX"
    ]


def test_a_fetched_message_is_filed_as_kombu_files_it_and_kombu_restores_it(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    filed_by_kombu: list[str] = []
    kombu_append = kombu_redis.QoS.append

    def append_by_kombu(qos: Any, message: Any, tag: str) -> None:
        filed_by_kombu.append(tag)
        kombu_append(qos, message, tag)

    monkeypatch.setattr(kombu_redis.QoS, "append", append_by_kombu)
    producer = kombu.Producer(channel)
    for number in range(3):
        producer.publish({"n": number}, routing_key=QUEUE, serializer="json")
    received: list[Any] = []
    consumer = kombu.Consumer(
        channel, [kombu.Queue(QUEUE)], callbacks=[lambda _, m: received.append(m)]
    )
    consumer.consume()
    connection = channel.connection.client
    while len(received) < 3:
        connection.drain_events(timeout=5)

    assert [m.decode()["n"] for m in received] == [0, 1, 2]  # the queue's order
    assert filed_by_kombu == [], "a message came by BRPOP, not by fetch"
    raw, prefix = _raw()
    first = received[0]
    info = first.delivery_info
    filed = raw.hget(f"{prefix}unacked", first.delivery_tag)
    assert filed is not None
    assert json.loads(filed) == [first._raw, info["exchange"], info["routing_key"]]
    assert raw.zscore(f"{prefix}unacked_index", first.delivery_tag) is not None

    channel.qos.restore_by_tag(first.delivery_tag)  # what the heartbeat does for a dead worker
    assert raw.hget(f"{prefix}unacked", first.delivery_tag) is None
    again = channel.basic_get(QUEUE, no_ack=True)
    assert again is not None and again.decode() == {"n": 0}
    consumer.cancel()


def test_acks_on_the_event_loop_go_out_with_the_next_fetch(
    channel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    acked_alone: list[str] = []
    kombu_ack = kombu_redis.QoS.ack

    def ack_alone(qos: Any, tag: str) -> None:
        acked_alone.append(tag)
        kombu_ack(qos, tag)

    monkeypatch.setattr(kombu_redis.QoS, "ack", ack_alone)
    producer = kombu.Producer(channel)
    for number in range(10):
        producer.publish({"n": number}, routing_key=QUEUE, serializer="json")
    channel.basic_qos(0, 1, False)  # one message at a time, as a busy worker's prefetch
    waiting: list[Any] = []
    consumer = kombu.Consumer(
        channel, [kombu.Queue(QUEUE)], callbacks=[lambda _, m: waiting.append(m)]
    )
    consumer.consume()
    hub = Hub()
    channel.connection.client.register_with_event_loop(hub)
    seen: list[int] = []
    deadline = time.monotonic() + 30
    try:
        while len(seen) < 10 and time.monotonic() < deadline:
            hub.run_once()
            for message in waiting:  # acked after the delivery, as Celery acks a finished job
                seen.append(message.decode()["n"])
                message.ack()
            waiting.clear()
        for _ in range(5):  # the last ack goes out with a fetch that finds the queue empty
            hub.run_once()
    finally:
        hub.close()
        consumer.cancel()

    assert seen == list(range(10))
    assert acked_alone == [], "an ack went out on its own instead of with a fetch"
    raw, prefix = _raw()
    assert raw.hlen(f"{prefix}unacked") == 0
    assert raw.zcard(f"{prefix}unacked_index") == 0


def _message(tag: str) -> bytes:
    return json.dumps(
        {
            "body": "e30=",
            "properties": {
                "delivery_tag": tag,
                "delivery_info": {"exchange": "", "routing_key": "q"},
            },
        }
    ).encode()


def _fetch(client: redis.Redis) -> Any:
    return client.eval(FETCH, 3, "unacked_index", "unacked", "q", time.time(), 0)


def test_a_fetch_refused_for_memory_or_meeting_an_unreadable_message_pops_nothing(
    tmp_path: Path,
) -> None:
    server = PrivateRedis(tmp_path / "redis.log").start()
    try:
        client = redis.Redis.from_url(server.url)
        client.lpush("q", _message("t1"))
        client.config_set("maxmemory", 1)  # every write that needs memory is refused
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            _fetch(client)
        assert client.llen("q") == 1 and client.hlen("unacked") == 0
        client.config_set("maxmemory", 0)
        assert _fetch(client) == [b"q", _message("t1")]
        assert client.llen("q") == 0 and client.hexists("unacked", "t1")

        client.lpush("q", b"not a kombu message")
        assert _fetch(client) is None
        assert client.lrange("q", 0, -1) == [b"not a kombu message"]  # left for kombu's BRPOP
    finally:
        server.stop()


_CONNECTION_OF_THE_APP = """
import json
from mailpipe.celery import app
connection = app.connection_for_write()  # lazy: nothing is connected
ssl = connection.ssl
print(json.dumps({
    "transport": type(connection.transport).__module__,
    "scheme": connection.as_uri().split(":")[0],
    "ssl": {key: int(value) for key, value in ssl.items()} if ssl else ssl,
}))
"""


@pytest.mark.parametrize(
    ("url", "expected_ssl"),
    [
        ("rediss://:secret@broker.example:6380/0", {"ssl_cert_reqs": 2}),  # CERT_REQUIRED
        ("rediss://:secret@broker.example:6380/0?ssl_cert_reqs=none", {"ssl_cert_reqs": 0}),
        ("redis://broker.example:6379/0", None),
    ],
)
def test_a_rediss_url_still_gets_tls_with_the_certificate_verified(
    url: str, expected_ssl: object
) -> None:
    env = {**os.environ, "MAILPIPE_BROKER_URL": url}
    done = subprocess.run(
        [sys.executable, "-c", _CONNECTION_OF_THE_APP],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "transport": "mailpipe.app.transport",
        "scheme": url.split(":")[0],
        "ssl": expected_ssl,
    }
