"""The stages paused now, with the operator's pauses that a flushed or restarted Redis lost put
back from the database first (mailpipe.coordination.pauses, mailpipe.storage.flags).

Putting them back holds the kept rows while Redis is written: a `mailpipe resume` of one of them
deletes its row first and its Redis pause after, so it waits for the rows and then removes what
was put back. It never imports Celery.
"""

from __future__ import annotations

from mailpipe.broker.queues import Stage
from mailpipe.coordination import pauses
from mailpipe.resources import Resources
from mailpipe.storage import flags


def in_force(res: Resources) -> dict[Stage, pauses.Pause]:
    """Every paused stage; the operator's pauses Redis lost are put back on the way."""
    found = pauses.paused_if_known(res.redis)
    return restore(res) if found is None else found


def restore(res: Resources) -> dict[Stage, pauses.Pause]:
    """Put the operator's pauses the database keeps back into Redis; every paused stage."""
    with res.db.transaction() as session:
        kept = flags.operator_pauses(session, hold=True)
        return pauses.restore(res.redis, {Stage(stage): held for stage, held in kept.items()})
