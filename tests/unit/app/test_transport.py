"""The broker transport (mailpipe.app.transport), on the real Redis: every connection of the app
(its pool's too) takes it and keeps the URL's scheme; it shares one Redis client per channel,
kombu's commands still reach Redis under the run's key prefix, and none builds a client of its
own; a `rediss://` URL gets TLS with the certificate verified. This fails when a kombu upgrade
stops going through the methods the transport overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
import redis

from mailpipe.app.transport import Channel, Transport

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
