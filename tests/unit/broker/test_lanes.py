"""kombu's Redis transport takes its queues in LiveFirst's order, against the real kombu and Redis.

These tests fail loudly if an upgrade of kombu stops doing what `mailpipe.broker.lanes` relies
on: the transport option `queue_order_strategy` resolved through `cycle_by_name`, the class
created with no arguments, asked for the order of each BRPOP and told each message's queue.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kombu import Connection, Message, Queue
from kombu.transport.redis import Channel
from kombu.utils.scheduling import cycle_by_name

from mailpipe.broker import lanes
from mailpipe.broker.lanes import LiveFirst
from mailpipe.celery import app

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def test_the_transport_resolves_the_option_to_live_first() -> None:
    assert "queue_order_strategy" in Channel.from_transport_options
    strategy = app.conf.broker_transport_options["queue_order_strategy"]
    assert cycle_by_name(strategy) is LiveFirst


@pytest.fixture
def connection(res, monkeypatch) -> Iterator[Connection]:  # type: ignore[no-untyped-def]
    """A kombu connection with the app's queue order, on a key prefix of the test's own, its
    cycles giving bulk a quarter of the jobs."""
    settings = res.settings.model_copy(update={"bulk_share": 0.25})
    monkeypatch.setattr(lanes, "get_settings", lambda: settings)
    prefix = f"lanes{uuid.uuid4().hex[:8]}:"
    options = {
        "global_keyprefix": prefix,
        "queue_order_strategy": app.conf.broker_transport_options["queue_order_strategy"],
    }
    with Connection(res.settings.broker_url, transport_options=options) as connection:
        yield connection
    for key in res.redis.scan_iter(f"{prefix}*"):
        res.redis.delete(key)


def test_a_channel_consumes_live_first_and_bulk_its_share(connection: Connection) -> None:
    live, bulk = Queue("x", routing_key="x"), Queue("x.bulk", routing_key="x.bulk")
    with connection.Producer() as producer:
        for lane, queue, count in (("L", live, 6), ("B", bulk, 10)):
            for n in range(count):
                producer.publish({"lane": lane, "n": n}, routing_key=queue.name, declare=[queue])
    received: list[dict[str, object]] = []

    def on_message(body: dict[str, object], message: Message) -> None:
        received.append(body)
        message.ack()

    with connection.Consumer([live, bulk], callbacks=[on_message]):
        while len(received) < 16:
            connection.drain_events(timeout=5)
    # A quarter of the jobs while both lanes have work: three live, then one bulk; once live is
    # empty the BRPOP falls through to bulk, which gets the rest.
    assert "".join(str(body["lane"]) for body in received) == "LLLBLLLBBBBBBBBB"
    for lane in "LB":  # and each lane in the order its jobs were sent
        numbers = [body["n"] for body in received if body["lane"] == lane]
        assert numbers == sorted(numbers)  # type: ignore[type-var]
