"""The Redis transport mailpipe registers, against the real Redis."""

from __future__ import annotations

import uuid

import pytest

from mailpipe import broker
from mailpipe.celery import app


def test_the_app_uses_it_and_keeps_the_redis_scheme_that_flower_reads(services: None) -> None:
    with app.connection_for_write() as connection:
        assert isinstance(connection.default_channel, broker.Channel)
        assert connection.as_uri().startswith("redis://")


def test_one_client_per_pool_and_a_new_one_after_the_pool_is_dropped(services: None) -> None:
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        channel._disconnect_pools()  # what a lost connection or a fork does
        second = channel._create_client()
        assert second is not first and second.connection_pool is channel.pool
        assert second.ping()


def test_messages_go_through_it(services: None) -> None:
    name = f"broker-test-{uuid.uuid4().hex[:8]}"
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue(name)
        try:
            for n in range(3):
                queue.put({"n": n}, serializer="json")
            got = [queue.get(timeout=5) for _ in range(3)]
            for message in got:
                message.ack()
            assert [m.payload["n"] for m in got] == [0, 1, 2]
            with pytest.raises(queue.Empty):
                queue.get(block=False)
        finally:
            queue.queue.delete()
            queue.close()
