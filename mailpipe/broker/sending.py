"""How the code below the Celery face sends jobs: an `Enqueue` it is given (the app's
`mailpipe.enqueue.enqueue_emails`, or a sender of the caller's own), and `in_lanes`, which sends
each email's job in its lane. Nothing here imports Celery."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mailpipe.broker.queues import Lane, TaskName


@dataclass(frozen=True)
class Route:
    """Where one job is sent: its queue, and its mailbox as the message names it; None for the
    default mailbox, and when the sender does not know it. The default mailbox is never named:
    its jobs go where the previous release takes them, and that release refuses arguments it
    does not know (0.1.0 does)."""

    queue: str
    mailbox: str | None


class Place(NamedTuple):
    """Where an email's jobs go, as its row says: its lane and its mailbox (None: the default)."""

    lane: str
    mailbox: str | None


# Sends the jobs of the emails given, of the stage given, in the lane given, each to its mailbox's
# queues when the mailboxes are given (email id -> the row's mailbox), deduplicated; returns the
# ids it sent.
Enqueue = Callable[[Sequence[int], TaskName, Lane, Mapping[int, str | None] | None], Sequence[int]]


def in_lanes(
    enqueue: Enqueue, email_ids: Sequence[int], places: Mapping[int, Place], task: TaskName
) -> list[int]:
    """Send the jobs of `email_ids`, each in its email's lane and mailbox (`places`), one call
    per lane; returns the ids sent."""
    sent: list[int] = []
    for lane in Lane:
        ids = [i for i in email_ids if places[i].lane == lane]
        if ids:
            sent.extend(enqueue(ids, task, lane, {i: places[i].mailbox for i in ids}))
    return sent
