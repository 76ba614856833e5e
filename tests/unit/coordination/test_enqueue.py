"""Enqueue against the real Redis broker: a job is marked as queued only once it was sent."""

from __future__ import annotations

import base64
import json

import pytest

from mailpipe import enqueue
from mailpipe.broker import layout
from mailpipe.broker.queues import Lane, Stage, TaskName, family, job_queues, stage_queue
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.resources import Resources
from tests.support.emails import raw_email

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def emails(n: int) -> list[bytes]:
    return [raw_email(f"s{i}", message_id=f"enq{i}@x", body="body") for i in range(n)]


def test_a_batch_the_broker_drops_midway_leaves_no_marker_and_can_be_sent_again(
    res, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(3))
    send = enqueue.send_job
    sent: list[int] = []

    def broker_drops_on_the_third(email_id: int, *args: object, **kwargs: object) -> None:
        if len(sent) == 2:
            raise ConnectionError("Connection closed by server.")
        sent.append(email_id)
        send(email_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(enqueue, "send_job", broker_drops_on_the_third)
    with pytest.raises(ConnectionError):
        enqueue.enqueue_emails(ids, res)
    # None stays marked as queued, or the sweeper would take a job never sent for waiting.
    assert not any(res.redis.exists(redis_keys.job_marker(i)) for i in ids)

    monkeypatch.setattr(enqueue, "send_job", send)
    again = enqueue.enqueue_emails(ids, res)
    assert (sorted(again.sent), again.already_queued) == (sorted(ids), [])
    assert layout.emails_in_broker(res.redis, [res.settings.queue]) >= set(ids)


def test_a_lane_s_jobs_go_to_its_queue_and_carry_the_lane(res) -> None:  # type: ignore[no-untyped-def]
    live, bulk = store_emails(res, emails(2))
    enqueue.enqueue_emails([live], res)
    enqueue.enqueue_emails([bulk], res, TaskName.CLASSIFY_EMAIL, Lane.BULK)
    bulk_model = stage_queue(Stage.MODEL, res.settings, Lane.BULK)
    assert lanes_in(res, res.settings.queue) == {live: "live"}
    assert lanes_in(res, bulk_model) == {bulk: "bulk"}
    others = set(job_queues(res.settings)) - {res.settings.queue, bulk_model}
    assert layout.emails_in_broker(res.redis, others) == set()


@pytest.mark.parametrize("shards", [0, 16])
def test_a_job_names_its_mailbox_only_in_a_shard_queue(res, shards: int) -> None:  # type: ignore[no-untyped-def]
    """The lane's own queue is the previous release's too, which refuses arguments it does not
    know: no job there names a mailbox, even a named mailbox's sent with no shards."""
    res = Resources(res.settings.model_copy(update={"mailbox_queues": shards}))
    [email_id] = store_emails(res, emails(1), mailbox="customer")
    enqueue.enqueue_emails([email_id], res, mailboxes={email_id: "customer"})
    [(queue, kwargs)] = jobs_in(res, res.settings.queue).values()
    assert (queue == res.settings.queue) is (shards == 0)
    assert kwargs.get("mailbox") == (None if shards == 0 else "customer")


def jobs_in(res, queue: str) -> dict[int, tuple[str, dict[str, object]]]:  # type: ignore[no-untyped-def]
    """The queue of `queue`'s family each job waiting in it was sent to, and its keywords, by
    email."""
    found = {}
    for member in family(queue, res.settings):
        for raw in res.redis.lrange(layout.queue_list(member), 0, -1):
            message = json.loads(raw)
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            found[message["headers"][layout.EMAIL_ID_HEADER]] = (member, kwargs)
    return found


def lanes_in(res, queue: str) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """The lane keyword of each job waiting in `queue`, by email."""
    return {email_id: kwargs["lane"] for email_id, (_, kwargs) in jobs_in(res, queue).items()}
