"""The sweeper's rules, run against the real Redis and PostgreSQL (no worker needed)."""

from __future__ import annotations

import time
from datetime import timedelta

from sqlalchemy import select, update

from mailpipe import flags, redis_keys, sweeper
from mailpipe.enqueue import enqueue_email, enqueue_emails
from mailpipe.ingest import store_emails
from mailpipe.metrics import BacklogMetrics
from mailpipe.models import EmailMessage, PipelineRun, RunStatus, SweepReport, utcnow
from mailpipe.pipeline import runs
from mailpipe.queuestats import queue_stats
from mailpipe.resources import Resources


class RecordingSink:
    def __init__(self) -> None:
        self.sent: list[BacklogMetrics] = []

    def send(self, metrics: BacklogMetrics) -> None:
        self.sent.append(metrics)


def emails(n: int) -> list[bytes]:
    return [f"From: a@example.org\r\nSubject: s{i}\r\nMessage-ID: <{i}@x>\r\n\r\nbody {i}\r\n".encode() for i in range(n)]


def run_sweep(res: Resources, sink: RecordingSink | None = None) -> sweeper.SweepResult:
    return sweeper.sweep(
        res,
        enqueue=lambda ids: enqueue_emails(ids, res),
        count_workers=lambda: 2,
        sink=sink or RecordingSink(),
    )


def depth(res: Resources) -> int:
    return queue_stats(res.redis, res.settings.queue).depth


def set_model_calls(res: Resources, on: bool) -> None:
    with res.db.transaction() as session:
        flags.set_model_calls(session, on)


def make_runs(res: Resources, ids: list[int], **values) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids)
        if values:
            session.execute(update(PipelineRun).where(PipelineRun.email_id.in_(ids)).values(**values))


def test_emails_without_run_are_readded_once(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(5))
    assert enqueue_email(ids[0])  # one is queued already
    sink = RecordingSink()
    result = run_sweep(res, sink)
    assert (result.readded_no_run, result.skipped_queued) == (4, 1)
    assert sorted(result.readded_ids) == ids[1:]
    assert depth(res) == 5  # four re-added beside the one queued, none twice
    with res.db.session() as session:
        counts = dict(session.execute(select(PipelineRun.email_id, PipelineRun.sweep_count)).all())
        report = session.scalars(select(SweepReport)).one()
    assert counts == {i: 1 for i in ids[1:]}
    assert (report.readded_no_run, report.queue_depth) == (4, 5)
    assert sink.sent[0].queue_depth == 5 and sink.sent[0].backlog_per_task == 2.5
    # Queued or running emails are never re-added: the next sweep sends nothing.
    again = run_sweep(res)
    assert (again.readded_no_run, again.readded_stalled, again.skipped_queued) == (0, 0, 5)
    assert depth(res) == 5


def test_open_runs_follow_the_model_call_rules(res) -> None:  # type: ignore[no-untyped-def]
    never, recent, old, waiting_off = store_emails(res, emails(4))
    make_runs(res, [never, recent, old, waiting_off])
    long_ago = utcnow() - timedelta(seconds=res.settings.stall_after + 60)
    with res.db.transaction() as session:
        session.execute(update(PipelineRun).where(PipelineRun.email_id.in_([recent, old])).values(classified_at=utcnow()))
        session.execute(update(PipelineRun).where(PipelineRun.email_id == old).values(updated_at=long_ago))

    set_model_calls(res, False)
    assert run_sweep(res).readded_ids == []  # with model calls off, waiting runs are left alone

    set_model_calls(res, True)
    readded = run_sweep(res).readded_ids
    # Never classified: at once. Classified: only once it has been open past the threshold.
    assert sorted(readded) == sorted([never, old, waiting_off])


def test_unfinished_jobs_are_readded_even_with_model_calls_off(res) -> None:  # type: ignore[no-untyped-def]
    [lost] = store_emails(res, emails(1))
    make_runs(res, [lost], attempts=1, attempt_started_at=utcnow())
    set_model_calls(res, False)
    assert run_sweep(res).readded_ids == [lost]


def test_a_run_swept_three_times_is_taken_off_the_queue(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    [stuck] = store_emails(res, emails(1))
    for expected_count in (1, 2, 3):
        result = run_sweep(res)
        assert result.readded_ids == [stuck]
        res.redis.delete(redis_keys.job_marker(stuck))  # its job is lost again
        with res.db.session() as session:
            assert session.scalar(select(PipelineRun.sweep_count)) == expected_count
    result = run_sweep(res)
    assert (result.readded_ids, result.marked_for_review) == ([], 1)
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        email = session.get_one(EmailMessage, stuck)
    assert run.status is RunStatus.FAILED and "stalled" in (run.error or "")
    assert email.needs_review and "re-added 3 times" in (email.review_reason or "")


def test_broker_flush_loses_jobs_and_one_sweep_readds_each_once(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(50))
    assert len(enqueue_emails(ids, res).sent) == 50
    assert enqueue_emails(ids, res).sent == []  # a second enqueue while they wait sends nothing
    assert depth(res) == 50
    from tests.conftest import clear_redis

    clear_redis(res.redis)  # what a Redis restart without persistence does
    assert depth(res) == 0
    result = run_sweep(res)
    assert sorted(result.readded_ids) == ids
    assert depth(res) == 50
    assert run_sweep(res).readded_ids == []


def test_a_marker_left_by_a_lost_message_expires(res) -> None:  # type: ignore[no-untyped-def]
    short = Resources(res.settings.model_copy(update={"dedup_ttl": 2}))
    [email_id] = store_emails(res, emails(1))
    assert enqueue_emails([email_id], short).sent == [email_id]
    assert 0 < res.redis.ttl(redis_keys.job_marker(email_id)) <= 2
    res.redis.delete(redis_keys.queue_list(res.settings.queue))  # the message is lost, not the marker
    assert run_sweep(short).readded_ids == []  # still blocked by the marker
    time.sleep(2.5)
    assert run_sweep(short).readded_ids == [email_id]


def test_two_sweeps_at_once_do_not_double_anything(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(30))
    res.redis.set(redis_keys.sweep_lock(), "another sweep", ex=60)
    assert run_sweep(res).ran is False  # the lock keeps a second sweep out
    res.redis.delete(redis_keys.sweep_lock())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_sweep(res), range(2)))
    readded = [i for r in results for i in r.readded_ids]
    assert sorted(readded) == ids  # each email re-added once in all
    assert depth(res) == 30
    with res.db.session() as session:
        assert set(session.scalars(select(PipelineRun.sweep_count))) == {1}
