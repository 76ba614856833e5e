"""The one deduplicated way to ask for an email to be processed.

Ingest, the sweeper and `mailpipe failed --retry` all come through here, and so should upstream
code that stores emails itself:

    from mailpipe.enqueue import enqueue_email
    session.commit()            # the email_message row first
    enqueue_email(email_id)     # then the job

Each email's marker is set first (`mailpipe.coordination.markers`): an email whose job is
already queued or running gets nothing sent. Importing this module builds the Celery app but
loads no task module, no document converter and no signal handler: the job is sent by its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu import Producer

from mailpipe.broker import layout
from mailpipe.broker.layout import job_headers
from mailpipe.broker.mailboxes import assign, candidates, stored
from mailpipe.broker.queues import Lane, TaskName, queue_of
from mailpipe.broker.sending import Enqueue, Route
from mailpipe.celery import app
from mailpipe.coordination import markers
from mailpipe.resources import Resources, get_resources
from mailpipe.settings import get_settings


@dataclass(frozen=True)
class EnqueueResult:
    sent: list[int]
    already_queued: list[int]


def enqueue_email(email_id: int, mailbox: str | None = None) -> bool:
    """Enqueue one email's job after the commit that stored it; False if it is already queued.
    `mailbox`: the row's, if the caller has it at hand (None: the job reads it from the row,
    which costs it a hop through its lane's own queue)."""
    given = None if mailbox is None else {email_id: stored(mailbox)}
    return bool(enqueue_emails([email_id], mailboxes=given).sent)


def enqueue_emails(
    email_ids: Iterable[int],
    res: Resources | None = None,
    task: TaskName = TaskName.PROCESS_EMAIL,
    lane: Lane = Lane.LIVE,
    mailboxes: Mapping[int, str | None] | None = None,
) -> EnqueueResult:
    """Enqueue many emails in three round trips to Redis: the markers, the lengths of the shard
    queues their mailboxes may take, the jobs.
    `task`: the stage to send; the sweeper sends the model stage of runs past their CPU stage.
    `lane`: the lane every job of this call goes in (the emails' own: callers group by it).
    `mailboxes`: each email's mailbox as its row holds it (None: the default one); without it the
    jobs go to the lane's own queue, and each job reads its mailbox from the row."""
    res = res or get_resources()
    ids = list(dict.fromkeys(email_ids))
    if not ids:
        return EnqueueResult([], [])
    claimed = markers.claim(res.redis, ids, res.settings.dedup_ttl)
    sent = [email_id for email_id, ok in zip(ids, claimed, strict=True) if ok]
    skipped = [email_id for email_id, ok in zip(ids, claimed, strict=True) if not ok]
    try:
        routes = route(res, sent, task, lane, mailboxes)
        with app.producer_or_acquire() as producer:
            for queue in {each.queue for each in routes.values()}:
                declare_queue(app, producer, queue)
            with producer.batch():
                for email_id in sent:
                    send_job(email_id, task, lane, routes[email_id], producer=producer)
    except BaseException:
        # Nothing may stay marked as queued that was not sent.
        markers.release(res.redis, sent)
        raise
    return EnqueueResult(sent, skipped)


def route(
    res: Resources,
    email_ids: Sequence[int],
    task: TaskName,
    lane: Lane,
    mailboxes: Mapping[int, str | None] | None,
) -> dict[int, Route]:
    """Where each email's job of `task` goes in `lane`: the shorter of its mailbox's two shard
    queues (one round trip for their lengths), or the lane's own queue when `mailboxes` is not
    given or there are no shards, where the job finds its mailbox on the row
    (mailpipe.broker.mailboxes)."""
    queue = queue_of(task, res.settings, lane)
    if mailboxes is None:
        return {email_id: Route(queue, None) for email_id in email_ids}
    count = res.settings.mailbox_queues
    wanted = [(email_id, mailboxes[email_id]) for email_id in email_ids]
    held = layout.lengths(res.redis, candidates((box for _, box in wanted), queue, count))
    placed = assign(wanted, queue, count, held)
    # A job in the lane's own queue names no mailbox, whatever its row's: the previous release
    # takes that queue and refuses arguments it does not know. It reads its mailbox from the row.
    return {
        email_id: Route(placed[email_id], None if placed[email_id] == queue else box)
        for email_id, box in wanted
    }


def sender(res: Resources) -> Enqueue:
    """`enqueue_emails` as the sweeper and the operator's actions are handed it: they never
    import Celery. Returns the ids it sent."""
    return lambda ids, task, lane, boxes: enqueue_emails(ids, res, task, lane, boxes).sent


def send_sweep() -> None:
    """Send one sweep (`mailpipe.sweep`), as the faces do once model calls are switched on."""
    # Imported here: the task module loads the pipeline's parsers and classifiers, which a face
    # has no other use for (tests/unit/test_layers.py).
    from mailpipe.app.tasks import sweep

    sweep.apply_async()


def send_job(
    email_id: int,
    task: TaskName = TaskName.PROCESS_EMAIL,
    lane: Lane = Lane.LIVE,
    route: Route | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> None:
    """Publish one message of the email's job (`task`: its stage) to the stage's queue of its
    `lane`, with the headers every job carries, whatever its marker says: the enqueue above, and
    the job's own follow-ups (a deferral, a delivery cut off by the hard time limit, the hand-off
    to the model stage), which hold their email's marker already. The lane goes in the message's
    keyword arguments too, so that every follow-up stays in it without reading the email's row.
    `route`: its queue and mailbox (`route`; by default the lane's own queue, the mailbox not
    named). The mailbox goes in the keyword arguments too, named as shown (`mailbox`), so that
    every follow-up stays in it.
    `kwargs`: the task's other keyword arguments; `options`: Celery's `send_task` options
    (countdown, producer)."""
    route = route or Route(queue_of(task, get_settings(), lane), None)
    named = {} if route.mailbox is None else {"mailbox": route.mailbox}
    app.send_task(
        task.value,
        (email_id,),
        {**(kwargs or {}), "lane": lane.value, **named},
        queue=route.queue,
        headers=job_headers(email_id),
        **options,
    )


def declare_queue(app: Celery, producer: Producer, name: str) -> None:
    """Bind the queue to its exchange in Redis again, whatever kombu's declared-once cache says.

    kombu keeps the bindings as Redis keys: a flushed or restarted Redis forgets them, and a
    message published to an exchange without its binding is dropped without an error. One SADD
    per enqueue call (not per email) keeps every publishing path safe from that.
    """
    app.amqp.queues[name].bind(producer.channel).declare()
