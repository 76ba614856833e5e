"""Live first, bulk its share, on a real prefork worker (mailpipe.broker.lanes, docs/lanes.md).

The worker consumes the CPU stage's live and bulk queues and the control queue, as the worker
role does, with concurrency 2 and the default prefetch multiplier (2): it holds at most 4
messages it took from Redis, whose lanes the queue order no longer decides. Emails are small and
plain, classified by the `rules` classifier in the CPU stage, so a run closes with its one job.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from mailpipe.app.tasks import sweep
from mailpipe.broker.queues import Lane, Stage, control_queue, stage_queue
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.fleet import CeleryProcess
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus, SweepReport
from tests.support.emails import raw_email
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

CONCURRENCY = 2
PREFETCH = 2  # MAILPIPE_WORKER_PREFETCH_MULTIPLIER's default
RESERVED = CONCURRENCY * PREFETCH
SHARE = 0.1


def plain_emails(count: int) -> list[bytes]:
    tag = uuid.uuid4().hex[:8]  # distinct emails, not copies of one another
    return [
        raw_email("lanes", to="b@example.org", message_id=f"{tag}.{n}@example.org")
        for n in range(count)
    ]


def store(res, count: int, lane: Lane) -> list[int]:  # type: ignore[no-untyped-def]
    ids = store_emails(res, plain_emails(count))
    with res.db.transaction() as session:
        session.execute(update(EmailMessage).where(EmailMessage.id.in_(ids)).values(lane=lane))
    return ids


def closed(res) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Closed runs per lane, read in one statement."""
    with res.db.session() as session:
        rows = session.execute(
            select(EmailMessage.lane, func.count())
            .join(PipelineRun, PipelineRun.email_id == EmailMessage.id)
            .where(PipelineRun.status != RunStatus.OPEN)
            .group_by(EmailMessage.lane)
        ).all()
    return {Lane.LIVE: 0, Lane.BULK: 0} | {lane: count for lane, count in rows}


def closed_by_then(res, email_id: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Runs per lane that had closed when `email_id`'s run closed (itself included)."""
    with res.db.session() as session:
        then = select(PipelineRun.closed_at).where(PipelineRun.email_id == email_id)
        rows = session.execute(
            select(EmailMessage.lane, func.count())
            .join(PipelineRun, PipelineRun.email_id == EmailMessage.id)
            .where(PipelineRun.closed_at <= then.scalar_subquery())
            .group_by(EmailMessage.lane)
        ).all()
    return {Lane.LIVE: 0, Lane.BULK: 0} | {lane: count for lane, count in rows}


@pytest.fixture
def worker(res, tmp_path: Path) -> Iterator[CeleryProcess]:  # type: ignore[no-untyped-def]
    """Starts the worker role on the CPU stage's two lanes and the control queue when called."""
    started: list[CeleryProcess] = []
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)  # the rules classifier closes runs in the CPU stage
    queues = [
        stage_queue(Stage.CPU, res.settings, Lane.LIVE),
        stage_queue(Stage.CPU, res.settings, Lane.BULK),
        control_queue(res.settings),
    ]

    def start() -> CeleryProcess:
        process = localfleet.worker(
            {**os.environ, "MAILPIPE_BULK_SHARE": str(SHARE)},
            tmp_path,
            concurrency=CONCURRENCY,
            name=f"lanes-{uuid.uuid4().hex[:6]}",
            extra_args=(f"--queues={','.join(queues)}",),
        ).start()
        started.append(process)
        process.wait_ready()
        return process

    yield start  # type: ignore[misc]
    for process in started:
        process.stop()


def test_live_mail_overtakes_a_backfill_and_bulk_goes_on_after_it(res, worker) -> None:  # type: ignore[no-untyped-def]
    """Each live email closes before more than a few bulk emails have closed since it was sent.

    When the live emails are sent the worker holds RESERVED bulk messages, which run first;
    after that, each message it takes is live while live has work, but for bulk's turns, one in
    1/SHARE of the jobs it takes meanwhile. So the bulk emails closed between the live emails'
    enqueue and one's close are at most RESERVED + SHARE x the jobs closed in between, plus one
    for the turn boundary and one for the start-up sweep's job. Round robin over the two lanes
    would close about one bulk email per live one ahead of the last (20 here).
    """
    assert len(enqueue_emails(store(res, 2000, Lane.BULK), res, lane=Lane.BULK).sent) == 2000
    worker()
    wait_for(lambda: closed(res)[Lane.BULK] >= 20, what="the backfill to be under way")

    live = store(res, 20, Lane.LIVE)
    assert enqueue_emails(live, res).sent == live
    # Counted from once the live jobs are in the broker: the bulk jobs the worker closed while
    # the enqueue ran (on a loaded machine, one or two) had no live job to give way to.
    before = closed(res)[Lane.BULK]
    wait_until_closed(res, live)
    for email_id in live:
        by_then = closed_by_then(res, email_id)
        bulk_closed = by_then[Lane.BULK] - before
        jobs_closed = bulk_closed + by_then[Lane.LIVE]
        assert bulk_closed <= RESERVED + SHARE * jobs_closed + 2, (email_id, by_then, before)

    # Live is empty: the BRPOP falls through to bulk, which gets every job (a few hundred are
    # watched, not the whole backfill, to keep the test short).
    after = closed(res)[Lane.BULK]
    wait_for(lambda: closed(res)[Lane.BULK] >= after + 200, what="200 more bulk runs to close")


def test_bulk_keeps_its_share_while_live_work_waits(res, worker) -> None:  # type: ignore[no-untyped-def]
    """With both lanes' backlogs longer than the window, bulk gets SHARE of the jobs closed.

    The worker takes exactly one bulk job in 1/SHARE while both lanes have work (the credit;
    give or take one at a turn's edge, and one for the start-up sweep's job on the control
    queue). The runs closed differ from the jobs taken by at most the RESERVED messages the
    worker holds, so over n closed runs bulk has closed SHARE x n, give or take RESERVED + 2:
    at n >= 250, between 7.6% and 12.4%. kombu's round robin would give bulk half, its strict
    priority none.
    """
    assert len(enqueue_emails(store(res, 300, Lane.BULK), res, lane=Lane.BULK).sent) == 300
    assert len(enqueue_emails(store(res, 600, Lane.LIVE), res).sent) == 600
    worker()
    wait_for(lambda: sum(closed(res).values()) >= 250, timeout=180, what="250 runs to close")
    counts = closed(res)
    jobs = sum(counts.values())
    assert counts[Lane.LIVE] < 600 and counts[Lane.BULK] < 300  # both lanes had work throughout
    assert abs(counts[Lane.BULK] - SHARE * jobs) <= RESERVED + 2, counts


def test_a_sweep_starts_before_a_live_backlog(res, worker) -> None:  # type: ignore[no-untyped-def]
    """The control queue is asked first: a sweep sent behind 2,000 live jobs starts while most of
    them still wait. The jobs are of emails that do not exist, so each fails in a few
    milliseconds; what the worker reserved and what its other child closes while the sweep runs
    come to tens of jobs (a loaded machine's margin: half the backlog). Asked after the live
    queue, the sweep would find it empty."""
    backlog = 2000
    missing = list(range(10**7, 10**7 + backlog))
    assert len(enqueue_emails(missing, res).sent) == backlog
    with res.db.session() as session:
        reports_before = session.scalar(select(func.max(SweepReport.id))) or 0
    sweep.apply_async()
    worker()

    def first_report() -> SweepReport | None:
        with res.db.session() as session:
            return session.scalars(
                select(SweepReport)
                .where(SweepReport.id > reports_before, SweepReport.finished_at.is_not(None))
                .order_by(SweepReport.id)
                .limit(1)
            ).first()

    wait_for(lambda: first_report() is not None, 60, "a sweep to finish")
    report = first_report()
    assert report is not None
    assert report.queue_depth is not None
    assert report.queue_depth >= backlog // 2, report.queue_depth
