"""What one delivery of an email's job comes to: decided by the steps (`job`) from the facts
the run's state answers (`runs`), and mapped to Celery's actions by the task shell."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mailpipe.errors import Dependency


class Kind(enum.StrEnum):
    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    WAITING = "waiting"  # open: the documents are stored, model calls are off
    CLOSED = "already_closed"  # nothing done: the run was closed, or a later claim holds it
    FAILED = "failed"
    RETRY = "retry"  # an attempt failed and attempts remain: send again after `delay`
    DEFER = "deferred"  # not an attempt: send again after `delay`
    PAUSED = "paused"  # not an attempt: the stage is paused, the job goes back to its queue
    HANDED_OFF = "handed_off"  # the CPU stage is done: send the model stage


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    delay: float = 0.0  # RETRY, DEFER: seconds before the next delivery
    error: str | None = None  # why, for FAILED, RETRY, DEFER and PAUSED
    # DEFER, PAUSED: when this job was first deferred or sent back by a pause (unix time)
    deferred_since: float | None = None
    outage: Dependency | None = None  # DEFER: the dependency whose outage it waits out

    @property
    def follows_up(self) -> bool:
        """Another delivery of the job is to be sent."""
        return self.kind in (Kind.RETRY, Kind.DEFER, Kind.PAUSED, Kind.HANDED_OFF)
