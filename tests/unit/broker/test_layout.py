"""What the broker holds, read from kombu's keys, against the real Redis and kombu.

These tests fail loudly if an upgrade of kombu moves what `mailpipe.broker.layout` and the
heartbeat rely on: the names of the unacked keys, the message layout with its headers, and
`QoS.restore_by_tag`.
"""

from __future__ import annotations

import inspect

import kombu
import pytest
from kombu.transport.redis import Channel, QoS

from mailpipe.broker import layout
from mailpipe.celery import app
from mailpipe.enqueue import send_job

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def deliver_one(res):  # type: ignore[no-untyped-def]
    """Take one message from the email queue as a worker does, without acknowledging it."""
    connection = app.connection_for_write()
    channel = connection.default_channel
    queue = app.amqp.queues[res.settings.queue](channel)
    message = queue.get(no_ack=False)
    assert message is not None
    return connection, channel, message


def test_the_kombu_layout_this_module_reads_is_still_there() -> None:
    assert Channel.unacked_key == "unacked"
    assert list(inspect.signature(QoS.restore_by_tag).parameters) == [
        "self",
        "tag",
        "client",
        "leftmost",
    ]
    assert kombu.VERSION[:2] >= (5, 7)


def test_emails_with_a_job_are_found_queued_delivered_or_counting_down(res) -> None:  # type: ignore[no-untyped-def]
    for email_id in (11, 12, 13):
        send_job(email_id)
    send_job(14, countdown=300)  # a retry or a deferral, waiting in the queue
    connection, _, delivered = deliver_one(res)  # 11: delivered, not acknowledged
    try:
        assert res.redis.hlen(layout.unacked_key()) == 1
        assert layout.emails_in_broker(res.redis, [res.settings.queue]) == {11, 12, 13, 14}
        assert layout.queue_stats(res.redis, res.settings.queue).depth == 3
        delivered.ack()
        assert layout.emails_in_broker(res.redis, [res.settings.queue]) == {12, 13, 14}
    finally:
        connection.release()


def test_a_consumer_that_never_acknowledges_leaves_nothing_delivered(res) -> None:  # type: ignore[no-untyped-def]
    """`celery inspect`, a worker's start-up sync and Flower consume without acks: kombu files
    none of their messages, so the heartbeat never finds them held by no live worker."""
    send_job(41)
    received: list[kombu.Message] = []
    with app.connection_for_write() as connection:
        queue = app.amqp.queues[res.settings.queue]
        with connection.Consumer([queue], callbacks=[lambda _, m: received.append(m)], no_ack=True):
            while not received:
                connection.drain_events(timeout=5)
    assert received[0].headers[layout.EMAIL_ID_HEADER] == 41
    assert layout.delivered(res.redis) == []
    assert layout.emails_in_broker(res.redis, [res.settings.queue]) == set()


def test_a_long_backlog_is_read_in_chunks_without_losing_one(res) -> None:  # type: ignore[no-untyped-def]
    ids = list(range(1, 2 * layout.SCAN_CHUNK + 17))
    with app.producer_or_acquire() as producer:
        for email_id in ids:
            send_job(email_id, producer=producer)
    assert layout.emails_in_broker(res.redis, [res.settings.queue]) == set(ids)


def test_restore_by_tag_puts_a_delivered_message_back_at_the_front(res) -> None:  # type: ignore[no-untyped-def]
    for email_id in (21, 22):
        send_job(email_id)
    connection, channel, delivered = deliver_one(res)
    try:
        assert layout.delivered(res.redis) == [delivered.delivery_tag]
        channel.qos.restore_by_tag(delivered.delivery_tag)
        assert res.redis.hlen(layout.unacked_key()) == 0
        again = app.amqp.queues[res.settings.queue](channel).get(no_ack=True)
        assert again.headers[layout.EMAIL_ID_HEADER] == 21  # first again, not behind 22
    finally:
        connection.release()
