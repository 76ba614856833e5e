"""The one deduplicated way to ask for an email to be processed.

Ingest, the sweeper and `mailpipe failed --retry` all come through here, and so should upstream
code that stores emails itself:

    from mailpipe.enqueue import enqueue_email
    session.commit()            # the email_message row first
    enqueue_email(email_id)     # then the job

A Redis marker per email (`mailpipe:job:<id>`) is set with SET NX before a job is sent: a second
enqueue while the job waits or runs sends nothing. The job deletes the marker when it ends; the
running job keeps refreshing it. A marker whose message was lost some other way (a broker flush,
a message dropped by hand) expires by itself after `MAILPIPE_DEDUP_TTL` seconds (default 3600),
after which the next sweep re-adds the email.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from celery import Celery
from kombu import Producer

from mailpipe import redis_keys
from mailpipe.resources import Resources, get_resources


@dataclass(frozen=True)
class EnqueueResult:
    sent: list[int]
    already_queued: list[int]


def enqueue_email(email_id: int) -> bool:
    """Enqueue one email's job after the commit that stored it; False if it is already queued."""
    return bool(enqueue_emails([email_id]).sent)


def enqueue_emails(email_ids: Iterable[int], res: Resources | None = None) -> EnqueueResult:
    """Enqueue many emails in two round trips to Redis: one for the markers, one for the jobs."""
    from mailpipe.tasks import process_email

    res = res or get_resources()
    ids = list(dict.fromkeys(email_ids))
    if not ids:
        return EnqueueResult([], [])
    claimed = _claim_markers(res, ids)
    sent = [email_id for email_id, ok in zip(ids, claimed) if ok]
    skipped = [email_id for email_id, ok in zip(ids, claimed) if not ok]
    try:
        with process_email.app.producer_or_acquire() as producer:
            declare_queue(process_email.app, producer, res.settings.queue)
            with producer.batch():
                for email_id in sent:
                    process_email.apply_async((email_id,), producer=producer)
    except BaseException:
        # Nothing may stay marked as queued that was not sent.
        res.redis.delete(*(redis_keys.job_marker(email_id) for email_id in sent))
        raise
    return EnqueueResult(sent, skipped)


def declare_queue(app: Celery, producer: Producer, name: str) -> None:
    """Bind the queue to its exchange in Redis again, whatever kombu's declared-once cache says.

    kombu keeps the bindings as Redis keys: a flushed or restarted Redis forgets them, and a
    message published to an exchange without its binding is dropped without an error. One SADD
    per enqueue call (not per email) keeps every publishing path safe from that.
    """
    app.amqp.queues[name].bind(producer.channel).declare()


def is_queued(res: Resources, email_ids: Sequence[int]) -> list[bool]:
    """Whether each email's job is queued or running, by its marker."""
    pipe = res.redis.pipeline(transaction=False)
    for email_id in email_ids:
        pipe.exists(redis_keys.job_marker(email_id))
    return [bool(found) for found in pipe.execute()]


def _claim_markers(res: Resources, ids: list[int]) -> list[bool]:
    pipe = res.redis.pipeline(transaction=False)
    for email_id in ids:
        pipe.set(redis_keys.job_marker(email_id), "queued", nx=True, ex=res.settings.dedup_ttl)
    return [bool(ok) for ok in pipe.execute()]
