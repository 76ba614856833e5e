"""The broker transport shares one Redis client per channel (mailpipe.app.transport), on the real
Redis: kombu's commands still reach it under the run's key prefix, and no command builds a client
of its own. This fails when a kombu upgrade stops going through `conn_or_acquire`."""

from __future__ import annotations

import os
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
    assert kombu.VERSION[:2] == (5, 7), "re-check mailpipe.app.transport against this kombu"
    assert isinstance(channel.connection, Transport)
    assert isinstance(channel, Channel)


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
