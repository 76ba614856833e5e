"""The sweeper's rules, run against the real Redis and PostgreSQL: most with no worker, the jobs
of a run across its stages and its reopen on real workers of their own (tests/support/fleet.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from mailpipe.broker import layout, queues
from mailpipe.classifiers import ClassificationResult
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.coordination.heartbeat import redis_time
from mailpipe.enqueue import enqueue_email, enqueue_emails
from mailpipe.operations import status, sweeper
from mailpipe.pipeline import job, policy, runs
from mailpipe.pipeline.classify import store_classification
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus, SweepReport
from tests.support.bedrock_server import BedrockServer
from tests.support.emails import raw_email
from tests.support.services import delete_prefix
from tests.support.switches import set_model_calls
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def emails(n: int, tag: str = "") -> list[bytes]:
    return [raw_email(f"s{i}", message_id=f"{tag}{i}@x", body=f"body {i}") for i in range(n)]


def run_sweep(res: Resources, grace: float = 0.0) -> sweeper.SweepResult:
    return sweeper.sweep(
        res,
        enqueue=lambda ids, task, lane, boxes: enqueue_emails(ids, res, task, lane, boxes).sent,
        in_flight_grace=grace,
    )


def depth(res: Resources) -> int:
    return layout.queue_stats(res.redis, res.settings.queue).depth


def purge(res: Resources) -> None:
    """What `celery purge` or a message dropped by hand does: the messages go, the markers stay."""
    for queue in queues.job_queues(res.settings):
        for name in layout.family_lists(queue):
            res.redis.delete(name)


def start_attempt(res: Resources, email_id: int) -> int:
    """A delivery's claim: what a job whose worker then vanished with its message leaves."""
    with res.db.transaction() as session:
        return runs.claim(session, email_id, policy.Limits.of(res.settings)).attempt


def classify_then_die(res: Resources, email_id: int) -> None:
    """A model stage that claimed, stored the model's answer and died before the labels."""
    model_calls = flags_on(res)
    set_model_calls(res, False)
    assert job.process_email(res, email_id).kind is Kind.WAITING  # the CPU stage, done
    set_model_calls(res, model_calls)
    with res.db.transaction() as session:
        claim = runs.claim(
            session, email_id, policy.Limits.of(res.settings), stage=queues.Stage.MODEL
        )
    assert isinstance(claim, runs.Claim), claim
    with res.db.transaction() as session:
        run = runs.lock_current(session, claim)
        store_classification(session, run.id, email_id, ClassificationResult((), "m", "p"))
        runs.mark_classified(session, claim)


def answered_earlier(res: Resources, email_id: int, seconds: float) -> None:
    """The model's answer for `email_id` as if stored `seconds` before it was."""
    with res.db.transaction() as session:
        session.execute(
            update(PipelineRun)
            .where(PipelineRun.email_id == email_id)
            .values(classified_at=PipelineRun.classified_at - timedelta(seconds=seconds))
        )


def flags_on(res: Resources) -> bool:
    with res.db.session() as session:
        return flags.model_calls_enabled(session)


def sweep_counts(res: Resources) -> dict[int, int]:
    with res.db.session() as session:
        return dict(session.execute(select(PipelineRun.email_id, PipelineRun.sweep_count)).all())


def test_emails_without_run_are_readded_once(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(5))
    assert enqueue_email(ids[0])  # one is queued already
    # Two workers consume the queue (their heartbeats), a third has stopped beating.
    now = time.time()
    workers = {"a": now, "b": now, "gone": now - 2 * res.settings.worker_dead_after}
    res.redis.zadd(redis_keys.workers_on(res.settings.queue), workers)
    result = run_sweep(res)
    assert (result.readded_no_run, result.skipped_queued) == (4, 1)
    assert sorted(result.readded_ids) == ids[1:]
    assert depth(res) == 5  # four re-added beside the one queued, none twice
    with res.db.session() as session:
        report = session.scalars(select(SweepReport)).one()
    assert sweep_counts(res) == {i: 1 for i in ids[1:]}
    assert (report.readded_no_run, report.queue_depth, report.backlog_per_task) == (4, 5, 2.5)
    # Queued or running emails are never re-added: the next sweep sends nothing.
    again = run_sweep(res)
    assert (again.readded_no_run, again.readded_stalled, again.skipped_queued) == (0, 0, 5)
    assert again.broker_jobs == 5
    assert depth(res) == 5


def test_open_runs_follow_the_model_call_rules(res) -> None:  # type: ignore[no-untyped-def]
    never, answered, waiting_off = store_emails(res, emails(3))
    with res.db.transaction() as session:
        runs.ensure_runs(session, [never])
    classify_then_die(res, answered)
    set_model_calls(res, False)
    assert job.process_email(res, waiting_off).kind is Kind.WAITING  # its CPU stage, done

    # A run whose CPU stage is not done needs its job either way; the others wait for model
    # calls, or were answered just now.
    assert run_sweep(res).readded_ids == [never]
    purge(res)

    set_model_calls(res, True)
    # Never classified: at once. Classified: only once its answer is older than the threshold.
    assert sorted(run_sweep(res).readded_ids) == sorted([never, waiting_off])
    purge(res)
    answered_earlier(res, answered, res.settings.stall_after + 1)
    assert sorted(run_sweep(res).readded_ids) == sorted([never, answered, waiting_off])


def test_a_run_past_its_cpu_stage_gets_only_its_model_stage_back(res) -> None:  # type: ignore[no-untyped-def]
    """Model calls switched on over runs that waited for them: the sweep sends their model stage,
    which reads what the CPU stage kept, and never the whole job again."""
    [waiting, fresh] = store_emails(res, emails(2))
    set_model_calls(res, False)
    assert job.process_email(res, waiting).kind is Kind.WAITING  # converted, waiting
    set_model_calls(res, True)
    result = run_sweep(res)
    assert sorted(result.readded_ids) == sorted([waiting, fresh])
    lists = [
        *layout.family_lists(queues.model_queue(res.settings)),
        *layout.family_lists(res.settings.queue),
    ]
    sent = {
        json.loads(raw)["headers"]["task"]: json.loads(raw)["headers"][layout.EMAIL_ID_HEADER]
        for name in lists
        for raw in res.redis.lrange(name, 0, -1)
    }
    assert sent == {"mailpipe.classify_email": waiting, "mailpipe.process_email": fresh}
    # Both are in the broker now: the next sweep finds them there, in either queue.
    again = run_sweep(res)
    assert (again.readded_ids, again.skipped_queued) == ([], 2)


def test_runs_waiting_for_model_calls_are_never_counted_however_the_switch_flaps(res) -> None:  # type: ignore[no-untyped-def]
    """An operator's incident: pause, on, off, resume, four times, then on for good. Each "on"
    sends a sweep that starts the waiting runs' model stage, which then meets the switch off
    and waits again. Waiting is no lost job: not one sweep is counted, none fails as stalled."""
    waiting = store_emails(res, emails(10))
    set_model_calls(res, False)
    for email_id in waiting:
        assert job.process_email(res, email_id).kind is Kind.WAITING
    for _ in range(4):
        set_model_calls(res, True)
        result = run_sweep(res)
        assert (result.started_waiting, result.readded_stalled) == (10, 0)
        assert (result.marked_for_review, sorted(result.readded_ids)) == (0, waiting)
        set_model_calls(res, False)
        for email_id in waiting:  # the model role takes each job, and finds the switch off
            assert job.classify_email(res, email_id).kind is Kind.WAITING
        purge(res)  # the messages it consumed
    set_model_calls(res, True)
    assert run_sweep(res).started_waiting == 10
    for email_id in waiting:
        assert job.classify_email(res, email_id).kind is Kind.SUCCEEDED
    assert sweep_counts(res) == {i: 0 for i in waiting}
    with res.db.session() as session:
        assert not session.scalar(select(EmailMessage.id).where(EmailMessage.needs_review))
        report = session.scalars(select(SweepReport).order_by(SweepReport.id.desc())).first()
    assert (report.started_waiting, report.readded_stalled) == (10, 0)


def test_a_started_model_stage_whose_job_is_lost_is_counted_as_lost(res) -> None:  # type: ignore[no-untyped-def]
    """Starting a waiting run is no re-add; its job lost after that is one."""
    [email_id] = store_emails(res, emails(1))
    set_model_calls(res, False)
    assert job.process_email(res, email_id).kind is Kind.WAITING
    set_model_calls(res, True)
    assert run_sweep(res).started_waiting == 1
    purge(res)  # the model stage's job, lost with the broker
    again = run_sweep(res)
    assert (again.started_waiting, again.readded_stalled) == (0, 1)
    assert sweep_counts(res) == {email_id: 1}


def test_a_run_converted_on_a_stale_switch_hands_off_itself(res) -> None:  # type: ignore[no-untyped-def]
    """A worker still holding "off" in its cache ends a CPU stage after the switch's sweep has
    run: once its lease is released it reads the switch afresh and hands the run off itself,
    so the run never waits for beat's next sweep."""
    [early, late] = store_emails(res, emails(2))
    cached = Resources(res.settings.model_copy(update={"model_calls_cache_seconds": 3600}))
    try:
        set_model_calls(res, False)
        assert job.process_email(cached, early).kind is Kind.WAITING  # the cache reads "off"
        set_model_calls(res, True)
        assert run_sweep(res).started_waiting == 1  # the switch's own sweep: `late` unconverted
        assert job.process_email(cached, late).kind is Kind.HANDED_OFF
    finally:
        cached.close()


def test_the_job_api_reads_a_purged_job_as_lost_whatever_its_marker_says(res) -> None:  # type: ignore[no-untyped-def]
    """`GET /api/jobs/<id>` answers from the broker, as the sweeper does: a model stage purged
    from its queue reads lost, its marker left behind notwithstanding."""
    [email_id] = store_emails(res, emails(1))
    set_model_calls(res, False)
    assert job.process_email(res, email_id).kind is Kind.WAITING
    set_model_calls(res, True)
    assert run_sweep(res).started_waiting == 1

    def state() -> str:
        with res.db.session() as session:
            return str(status.job_state(res, session, email_id)["state"])

    # The marker is as old as a job that has waited a while.
    res.redis.set(redis_keys.job_marker(email_id), str(time.time() - 3600))
    assert state() == "queued"
    purge(res)  # `celery purge` of the model queues
    assert res.redis.exists(redis_keys.job_marker(email_id))
    assert state() == "lost"


def test_unfinished_jobs_are_readded_even_with_model_calls_off(res) -> None:  # type: ignore[no-untyped-def]
    [lost] = store_emails(res, emails(1))
    start_attempt(res, lost)
    set_model_calls(res, False)
    assert run_sweep(res).readded_ids == [lost]


def test_a_run_whose_job_is_lost_three_times_is_taken_off_the_queue(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    [stuck] = store_emails(res, emails(1))
    for expected_count in (1, 2, 3):
        result = run_sweep(res)
        assert result.readded_ids == [stuck]
        purge(res)  # its job is lost again, its marker left behind
        assert sweep_counts(res) == {stuck: expected_count}
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
    delete_prefix(
        os.environ["MAILPIPE_BROKER_URL"], os.environ["MAILPIPE_REDIS_PREFIX"]
    )  # a Redis restart
    assert depth(res) == 0
    result = run_sweep(res)
    assert sorted(result.readded_ids) == ids
    assert depth(res) == 50
    assert run_sweep(res).readded_ids == []


def test_a_purged_queue_is_readded_at_the_next_sweep_though_its_markers_live(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(20))
    assert len(enqueue_emails(ids, res).sent) == 20
    purge(res)
    assert all(res.redis.exists(redis_keys.job_marker(i)) for i in ids)
    # A sweep right after the jobs were sent leaves them: the broker read may have missed a
    # message in flight, and the markers say they were just sent.
    assert run_sweep(res, grace=60).readded_ids == []
    assert sorted(run_sweep(res).readded_ids) == ids
    assert depth(res) == 20
    assert run_sweep(res).readded_ids == []  # once


def test_waiting_jobs_whose_markers_are_gone_are_never_readded(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    ids = store_emails(res, emails(30))
    enqueue_emails(ids[:20], res)
    # Ten have a run whose job was re-sent (a retry, a deferral) and waits in the queue.
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids[20:])
    enqueue_emails(ids[20:], res)
    for email_id in ids:  # expired, evicted under maxmemory, or deleted by hand
        res.redis.delete(redis_keys.job_marker(email_id))
    for _ in range(5):
        result = run_sweep(res)
        assert result.readded_ids == [] and result.marked_for_review == 0
        assert result.skipped_queued == 30
    assert depth(res) == 30
    assert set(sweep_counts(res).values()) == {0}
    # The sweeps put the markers back, so that an enqueue of a waiting email sends nothing.
    assert enqueue_emails(ids, res).sent == []


def test_a_backlog_that_waits_longer_than_every_ttl_is_never_readded(res) -> None:  # type: ignore[no-untyped-def]
    # The shortest windows the settings accept: markers of 2 s, sweeps every second.
    short = Resources(
        Settings(**{**res.settings.model_dump(), "dedup_ttl": 2, "sweep_interval": 1})
    )
    set_model_calls(res, True)
    ids = store_emails(res, emails(40))
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids[:10])  # some waited through a retry or a deferral
    assert len(enqueue_emails(ids, short).sent) == 40
    # On Redis's clock, which the markers lapse by: the backlog waits four of their lifetimes.
    waited_long_enough = redis_time(res.redis) + 4 * short.settings.dedup_ttl
    sweeps = 0

    def swept_again_and_waited_long_enough() -> bool:
        nonlocal sweeps
        result = run_sweep(short)
        assert result.readded_ids == [] and result.marked_for_review == 0
        assert depth(res) == 40
        sweeps += 1
        return sweeps >= 6 and redis_time(res.redis) > waited_long_enough

    wait_for(
        swept_again_and_waited_long_enough,
        120,
        "six sweeps over four lifetimes of a marker",
        every=short.settings.sweep_interval,
    )
    assert set(sweep_counts(res).values()) == {0}
    with res.db.session() as session:
        statuses = set(session.scalars(select(PipelineRun.status)))
        review = session.scalar(select(EmailMessage.id).where(EmailMessage.needs_review))
    assert statuses <= {RunStatus.OPEN} and review is None


def test_a_running_job_is_never_taken_for_lost(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    [email_id] = store_emails(res, emails(1))
    start_attempt(res, email_id)
    res.redis.set(redis_keys.lease(email_id), "elsewhere:1:running", px=60_000)
    result = run_sweep(res)
    assert (result.readded_ids, result.skipped_queued) == ([], 1)


def test_two_sweeps_at_once_do_not_double_anything(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A sweep starts while another has read the broker and sent nothing yet: the lock keeps it
    out, and the first sends each job once."""
    ids = store_emails(res, emails(30))
    read_broker = layout.emails_in_broker
    first_has_read, second_is_done = threading.Event(), threading.Event()

    def the_first_read_waits_for_the_second_sweep(*args: object) -> set[int]:
        present = read_broker(*args)  # type: ignore[arg-type]
        if not first_has_read.is_set():
            first_has_read.set()
            second_is_done.wait(60)
        return present

    monkeypatch.setattr(layout, "emails_in_broker", the_first_read_waits_for_the_second_sweep)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(run_sweep, res)
        try:
            wait_for(first_has_read.is_set, 60, "the first sweep to read the broker")
            second = run_sweep(res)
        finally:
            second_is_done.set()
        results = [first.result(60), second]
    readded = [i for r in results for i in r.readded_ids]
    assert sorted(readded) == ids  # each email re-added once in all
    assert depth(res) == 30
    assert set(sweep_counts(res).values()) == {1}
    assert [r.ran for r in results] == [True, False]


def test_a_job_that_ends_while_the_broker_is_read_is_not_taken_for_lost(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The first batch is read again after the broker: a run the sweeper saw open, whose job a
    worker took and finished while the broker was being read, is closed by then."""
    set_model_calls(res, True)
    [email_id] = store_emails(res, emails(1, "reread"))
    enqueue_emails([email_id], res)
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])  # open, as an enqueued email's run is
    read_broker = layout.emails_in_broker

    def read_while_the_job_ends(*args: object) -> set[int]:
        purge(res)  # a worker took the message...
        assert job.process_email(res, email_id).kind is Kind.SUCCEEDED  # ...and finished it
        return read_broker(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(layout, "emails_in_broker", read_while_the_job_ends)
    result = run_sweep(res)
    assert (result.readded_stalled, result.readded_no_run, depth(res)) == (0, 0, 0)


def run_of(res: Resources, email_id: int) -> PipelineRun:
    with res.db.session() as session:
        return session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).one()


def test_a_job_lost_at_both_stages_is_swept_three_times_in_all(res, fleet) -> None:  # type: ignore[no-untyped-def]
    """The sweeps of a run count over its two stages: the hand-off to the model stage does not
    give a job lost twice at the CPU stage three more sweeps."""
    server = BedrockServer().start()
    try:
        # Model calls on (the fleet's default) with a remote model: the CPU stage hands off.
        f = fleet(MAILPIPE_MODEL_BACKEND="bedrock", AWS_ENDPOINT_URL_BEDROCK_RUNTIME=server.url)
        [lost] = store_emails(res, emails(1, "both-stages"))
        f.enqueue([lost])
        for count in (1, 2):  # lost before any worker took it
            f.lose_jobs()
            assert f.sweep()["readded_ids"] == [lost]
            assert sweep_counts(res) == {lost: count}
        # The CPU stage's worker, and no model role to take the hand-off.
        cpu_queues = f"{queues.email_queue(res.settings)},{queues.control_queue(res.settings)}"
        f.worker("cpu-stage", f"--queues={cpu_queues}")
        model_queue = queues.model_queue(res.settings)
        wait_for(lambda: f.queue_depth(model_queue) == 1, 60, "the hand-off to the model stage")
        assert run_of(res, lost).converted_at is not None
        f.lose_jobs()
        assert f.sweep()["readded_ids"] == [lost]  # its model stage, a third sweep
        assert f.queue_depth(model_queue) == 1
        assert sweep_counts(res) == {lost: 3}
        f.lose_jobs()
        result = f.sweep()
        assert (result["readded_ids"], result["marked_for_review"]) == ([], 1)
        assert server.requests == []  # the model stage never ran
    finally:
        server.stop()
    run = run_of(res, lost)
    assert (run.status, run.sweep_count) == (RunStatus.FAILED, 3)
    assert run.error.startswith("stalled: its job was lost 4 times"), run.error
    with res.db.session() as session:
        email = session.get_one(EmailMessage, lost)
    assert email.needs_review and "re-added 3 times" in (email.review_reason or "")


def test_a_reopened_run_whose_job_is_lost_is_readded_with_model_calls_off(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(MAILPIPE_MAX_RETRIES="0")
    worker = f.worker("failing")
    [reopened] = store_emails(res, emails(1, "reopened"))
    f.set_fault(reopened, "raise", times=1)
    f.enqueue([reopened])
    assert wait_until_closed(res, [reopened]) == {reopened: "failed"}
    worker.stop()
    set_model_calls(res, False)
    subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "failed", "--retry", str(reopened)],
        env=f.env,
        check=True,
        capture_output=True,
    )
    f.lose_jobs()  # the reopened run's job, lost before any worker took it
    assert f.sweep()["readded_ids"] == [reopened]
    assert f.queue_depth() == 1
    # The job sent again runs its CPU stage, and the run waits for model calls.
    f.worker("after-reopen")
    wait_for(lambda: run_of(res, reopened).converted_at is not None, 60, "the CPU stage to run")
    assert f.runs(reopened) == 2
    run = run_of(res, reopened)
    assert (run.status, run.sweep_count) == (RunStatus.OPEN, 1)
