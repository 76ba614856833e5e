"""Which lane a worker takes its next job from: live first, bulk its share (docs/lanes.md).

kombu's Redis transport consumes a worker's queues with one BRPOP over their lists, which returns
a message from the first list in the command's order that has one. It asks a queue order strategy
for that order before each BRPOP (`consume`), and tells it which queue each message came from
(`rotate`): the transport option `queue_order_strategy` names the strategy's class
(mailpipe.app.config), kombu creates it with no arguments and hands it the consumed queues
(`update`). `tests/unit/broker/test_lanes.py` fails if kombu stops doing so.
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

from mailpipe.broker.queues import Lane, control_queue, lane_of
from mailpipe.settings import get_settings


class LiveFirst:
    """The control queue first, then live queues before bulk ones, except that bulk goes first
    once it has earned a job.

    The control queue carries sweeps and nothing else: one sweep's work is small, and it
    re-adds lost jobs and marks runs for review, so it never waits behind a backlog of jobs.

    Bulk earns a credit of MAILPIPE_BULK_SHARE for every job the worker receives and spends 1 on
    each bulk job; bulk goes first while the credit is at least 1. A credit rather than a count
    of jobs, so that a share that is not 1/n (0.3) comes out exact. Neither lane banks turns while
    the other is empty: a live job received while bulk went first (bulk had none) earns nothing,
    and a bulk job received while live went first (live had none) takes the credit no lower
    than 0.

    While both lanes have work, bulk gets `share` of the jobs (one in ten at 0.1); while live is
    empty, the BRPOP falls through to bulk, which gets them all; 0 is strict live first, 1 bulk
    first. A live job is never behind more than the jobs its worker had already reserved
    (concurrency x prefetch multiplier) and the bulk turns earned meanwhile.
    """

    def __init__(self) -> None:
        # Exact arithmetic: ten float 0.1s add up to just under 1, and bulk would miss its turn.
        settings = get_settings()
        self.share = Fraction(settings.bulk_share).limit_denominator(1000)
        self.control = control_queue(settings)
        # Starting with one job's share gives bulk its first turn at the 1/share-th job.
        self.credit = self.share
        self.queues: list[str] = []
        # The job queues in the order of their next turns; the last one used is at the end.
        self.turns: dict[str, None] = {}

    def update(self, queues: Iterable[str]) -> None:
        self.queues = list(queues)
        jobs = [queue for queue in self.queues if queue != self.control]
        self.turns = {**{q: None for q in self.turns if q in jobs}, **dict.fromkeys(jobs)}

    def consume(self, n: int) -> list[str]:
        """The first `n` queues, in the order to BRPOP them."""
        queues = self.queues[:n]
        control = [queue for queue in queues if queue == self.control]
        live = self._in_turn([q for q in queues if lane_of(q) is Lane.LIVE and q != self.control])
        bulk = self._in_turn([queue for queue in queues if lane_of(queue) is Lane.BULK])
        return control + (bulk + live if self.credit >= 1 else live + bulk)

    def _in_turn(self, queues: list[str]) -> list[str]:
        """A lane's queues by their turns."""
        given = set(queues)
        return [queue for queue in self.turns if queue in given]

    def rotate(self, last_used: str) -> str:
        """A job came from `last_used`; a sweep counts toward neither lane."""
        if last_used == self.control:
            return last_used
        if last_used in self.turns:
            del self.turns[last_used]
            self.turns[last_used] = None
        if lane_of(last_used) is Lane.BULK:
            self.credit = max(self.credit + self.share - 1, Fraction(0))
        elif self.credit < 1:
            self.credit += self.share
        return last_used
