"""How the code below the Celery face sends jobs: an `Enqueue` it is given (the app's
`mailpipe.enqueue.enqueue_emails`, or a sender of the caller's own), and `in_lanes`, which sends
each email's job in its lane. Nothing here imports Celery."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mailpipe.broker.queues import Lane, TaskName

# Sends the jobs of the emails given, of the stage given, in the lane given (deduplicated);
# returns the ids it sent.
Enqueue = Callable[[Sequence[int], TaskName, Lane], Sequence[int]]


def in_lanes(
    enqueue: Enqueue, email_ids: Sequence[int], lanes: Mapping[int, str], task: TaskName
) -> list[int]:
    """Send the jobs of `email_ids`, each in its email's lane (`lanes`), one call per lane;
    returns the ids sent."""
    sent: list[int] = []
    for lane in Lane:
        ids = [i for i in email_ids if lanes[i] == lane]
        if ids:
            sent.extend(enqueue(ids, task, lane))
    return sent
