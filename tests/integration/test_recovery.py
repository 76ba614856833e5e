"""Recovery on real prefork workers: backlogs older than every TTL, the hard time limit, a lease
taken over, the database restarted during a claim, a quota at zero, and a worker killed whole.

Time is compressed with short settings that the settings themselves accept, so that each case
runs in seconds; every wait is for a condition, with a generous deadline.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import redis
from sqlalchemy import func, select

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.servers import PrivateRedis
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination.heartbeat import redis_time
from mailpipe.resources import Resources
from mailpipe.storage.models import Classification, EmailMessage, PipelineRun, SweepReport
from tests.support.bedrock_server import BedrockServer, throttling
from tests.support.database import on_server
from tests.support.emails import raw_email
from tests.support.faults import claims_held, release_claim, set_claim_fault
from tests.support.services import PrivatePostgres
from tests.support.waits import wait_for, wait_until_closed

pytestmark = [pytest.mark.slow, pytest.mark.services]  # Redis, PostgreSQL and the S3 server


def email(tag: str) -> bytes:
    return raw_email(f"Invoice {tag}", message_id=f"{tag}@x", body="Amount due")


def runs_of(res, email_ids: list[int]) -> dict[int, PipelineRun]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        rows = session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(email_ids))).all()
    return {run.email_id: run for run in rows}


def deliveries(worker: localfleet.CeleryProcess) -> int:
    """Messages of process_email the worker received, from its log."""
    return len(
        re.findall(r"Task mailpipe\.process_email\[[^\]]+\] received", worker.log_path.read_text())
    )


def sweep_reports(res) -> list[SweepReport]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return list(session.scalars(select(SweepReport)))


def test_a_backlog_older_than_every_ttl_is_processed_once(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # Markers lapse after 2 s, leases after 3 s, and a message unacknowledged for 8 s goes back to
    # its queue; the backlog waits longer than all three while sweeps fire every second, drains
    # with them firing, and some markers are deleted by hand on top.
    visibility_timeout = 8
    f = fleet(
        MAILPIPE_DEDUP_TTL="2",
        MAILPIPE_SWEEP_INTERVAL="1",
        MAILPIPE_LEASE_TTL="3",
        MAILPIPE_TASK_SOFT_TIME_LIMIT="4",
        MAILPIPE_TASK_TIME_LIMIT="5",
        MAILPIPE_RETRY_BACKOFF_BASE="1",
        MAILPIPE_RETRY_BACKOFF_MAX="2",
        MAILPIPE_VISIBILITY_TIMEOUT=str(visibility_timeout),
        MAILPIPE_WORKER_PREFETCH_MULTIPLIER="1",
    )
    ids = store_emails(res, [email(f"backlog-{n}") for n in range(60)])
    for email_id in ids:
        f.set_fault(email_id, "slow:0.1", times=1)
    f.enqueue(ids)
    # On Redis's clock, which every TTL runs on.
    older_than_every_ttl = redis_time(res.redis) + visibility_timeout
    f.beat()
    sweeper = f.worker("sweeper", "--queues", f"{res.settings.queue}.control")
    wait_for(
        lambda: redis_time(res.redis) > older_than_every_ttl, 60, "the backlog to outlive every TTL"
    )
    swept_before = len(sweep_reports(res))

    def swept_the_old_backlog() -> bool:
        reports = sweep_reports(res)[swept_before:]
        return len([r for r in reports if r.skipped_queued == 60]) >= 3

    wait_for(swept_the_old_backlog, 60, "three sweeps to find the old backlog waiting")
    for email_id in ids[:20]:
        res.redis.delete(f"{f.prefix}mailpipe:job:{email_id}")
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], f.queue_depth())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert f.queue_depth() == 60
        swept_before_the_drain = len(sweep_reports(res))
        worker = f.worker("drainer", "--concurrency", "1")
        statuses = wait_until_closed(res, ids, timeout=120)
    finally:
        stop.set()
        watcher.join()
    assert set(statuses.values()) == {"succeeded"}
    assert peak[0] <= 60
    assert deliveries(worker) == 60  # not one extra delivery
    assert all(f.runs(i) == 1 for i in ids)
    runs = runs_of(res, ids)
    assert {run.sweep_count for run in runs.values()} == {0}
    assert {run.attempts for run in runs.values()} == {1}
    reports = sweep_reports(res)
    assert len(reports) > swept_before_the_drain  # sweeps ran while it drained too
    assert {(r.readded_no_run, r.readded_stalled, r.marked_for_review) for r in reports} == {
        (0, 0, 0)
    }
    with res.db.session() as session:
        assert (
            session.scalar(
                select(func.count()).select_from(EmailMessage).where(EmailMessage.needs_review)
            )
            == 0
        )
    assert sweeper.alive()


def test_a_job_that_ignores_the_soft_limit_is_cut_off_and_fails_after_its_attempts(
    res, fleet
) -> None:  # type: ignore[no-untyped-def]
    f = fleet(
        MAILPIPE_TASK_SOFT_TIME_LIMIT="1",
        MAILPIPE_TASK_TIME_LIMIT="2",
        MAILPIPE_RETRY_BACKOFF_BASE="0.5",
        MAILPIPE_RETRY_BACKOFF_MAX="2",
        MAILPIPE_VISIBILITY_TIMEOUT="10",
        MAILPIPE_LEASE_TTL="3",
    )
    worker = f.worker("limits")
    stuck, good = store_emails(res, [email("stuck"), email("after-stuck")])
    f.set_fault(stuck, "hang")
    f.enqueue([stuck, good])
    statuses = wait_until_closed(res, [stuck, good], timeout=120)
    assert statuses == {stuck: "failed", good: "succeeded"}
    run = runs_of(res, [stuck])[stuck]
    assert run.attempts == 4
    assert (
        run.error == "gave up after 4 attempts: attempt 4 was cut off by the hard time limit (2 s)"
    )
    assert f.runs(stuck) == 4  # never a fifth time
    # Each cut-off came back at once, re-sent as cut off (the error above), and that delivery
    # sent the retry with its backoff as its countdown: full jitter below 0.5, 1 and 2 s.
    countdowns = f.countdowns(stuck)
    assert len(countdowns) == 3, countdowns
    for countdown, ceiling in zip(countdowns, [0.5, 1.0, 2.0], strict=True):
        assert 0 <= countdown <= ceiling, countdowns
    assert worker.alive()


def test_a_lease_taken_over_mid_job_leaves_the_run_to_its_new_holder(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # The first delivery is held for as long as the second takes: time limits to match.
    f = fleet(
        MAILPIPE_LEASE_TTL="3",
        MAILPIPE_TASK_SOFT_TIME_LIMIT="110",
        MAILPIPE_TASK_TIME_LIMIT="120",
        MAILPIPE_VISIBILITY_TIMEOUT="130",
    )
    f.worker("first")
    f.worker("second")
    [email_id] = store_emails(res, [email("taken-over")])
    f.set_fault(email_id, "held", times=1)
    f.enqueue([email_id])
    wait_for(lambda: f.runs(email_id) == 1, 30, "the first delivery to start")
    # Its lease lapses (say its renewals could not reach Redis) and a second delivery starts.
    res.redis.delete(f"{f.prefix}mailpipe:lease:{email_id}")
    f.send(email_id)
    wait_until_closed(res, [email_id], timeout=60)
    assert f.runs(email_id) == 2
    # The first delivery wakes, finds its attempt superseded and ends: its message acknowledged.
    f.release(email_id)
    wait_for(lambda: f.unacked() == 0, 60, "the first delivery to end")
    run = runs_of(res, [email_id])[email_id]
    assert (run.status.value, run.attempts) == ("succeeded", 2)
    with res.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Classification)) == 1
    logs = "".join(w.log_path.read_text() for w in f.workers)
    # Fenced: it wakes after the new holder closed the run.
    assert (
        f"email {email_id}: the run is succeeded already; this delivery stops without writing"
        in logs
    )
    assert logs.count("lease lost while the job was running") == 1


def test_postgresql_restarted_during_a_claim_is_a_retry_not_a_lost_job(res, fleet) -> None:  # type: ignore[no-untyped-def]
    pg = PrivatePostgres()
    try:
        pg.start()
        private = on_server(res, pg.url)
        [email_id] = store_emails(private, [email("claim-during-restart")])
        f = fleet(
            MAILPIPE_DATABASE_URL=pg.url,
            MAILPIPE_RETRY_BACKOFF_BASE="0.5",
            MAILPIPE_RETRY_BACKOFF_MAX="2",
        )
        set_claim_fault(res.redis, email_id, prefix=f.prefix)
        f.enqueue([email_id])
        f.worker("claimer")
        wait_for(
            lambda: claims_held(res.redis, email_id, f.prefix) == 1, 30, "the claim to be held"
        )
        pg.stop()  # the claim's connection is cut mid-transaction
        pg.start()
        release_claim(res.redis, email_id, f.prefix)  # it goes on, on its dead connection
        # This process's own pooled connections died with the server too: read on fresh ones.
        private.close()
        private = Resources(private.settings)
        wait_until_closed(private, [email_id], timeout=60)
        run = runs_of(private, [email_id])[email_id]
        # The failed claim was rolled back, not counted, and the job was retried, not acked.
        assert (run.status.value, run.attempts, run.sweep_count) == ("succeeded", 1, 0)
        private.close()
    finally:
        pg.destroy()


def test_a_model_quota_at_zero_defers_without_attempts_then_fails_with_the_reason(
    res, fleet
) -> None:  # type: ignore[no-untyped-def]
    with BedrockServer() as server:
        server.default = throttling()
        f = fleet(
            MAILPIPE_MODEL_BACKEND="bedrock",
            MAILPIPE_BEDROCK_REGION="us-east-1",
            AWS_ENDPOINT_URL_BEDROCK_RUNTIME=server.url,
            MAILPIPE_MAX_DEFERRAL="8",
            MAILPIPE_RETRY_BACKOFF_BASE="0.5",
            MAILPIPE_RETRY_BACKOFF_MAX="2",
        )
        f.worker("throttled")
        [email_id] = store_emails(res, [email("quota-zero")])
        f.enqueue([email_id])
        wait_for(
            lambda: f.res.redis.zcard(f"{f.prefix}mailpipe:deferred:mailpipe.model") == 1,
            30,
            "a deferral",
        )
        statuses = wait_until_closed(res, [email_id], timeout=60)
        assert statuses == {email_id: "failed"}
        run = runs_of(res, [email_id])[email_id]
        assert run.attempts == 0  # a throttled call uses no attempt
        assert "past MAILPIPE_MAX_DEFERRAL (8 s)" in run.error and "throttled" in run.error
        assert len(server.requests) >= 3
        # Each deferral was counted for the metrics.
        assert int(res.redis.get(f"{f.prefix}mailpipe:metrics:deferrals") or 0) >= 3


def test_a_killed_worker_s_jobs_run_elsewhere_within_the_dead_after(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # The visibility timeout (10 minutes) is far beyond the waits below: only the heartbeat's
    # recovery, a dead_after after the last beat, can bring the jobs back in time for them.
    f = fleet(
        MAILPIPE_WORKER_HEARTBEAT_INTERVAL="1",
        MAILPIPE_WORKER_DEAD_AFTER="3",
        MAILPIPE_TASK_SOFT_TIME_LIMIT="110",
        MAILPIPE_TASK_TIME_LIMIT="120",
        MAILPIPE_VISIBILITY_TIMEOUT="600",
    )
    doomed = f.worker("doomed")  # two children, two reserved messages each at prefetch 2
    ids = store_emails(res, [email(f"doomed-{n}") for n in range(4)])
    for email_id in ids:
        f.set_fault(email_id, "held", times=1)
    f.enqueue(ids)
    wait_for(
        lambda: sum(f.runs(i) for i in ids) == 2 and f.unacked() == 4,
        30,
        "two jobs running and two reserved on the doomed worker",
    )
    # A child for each job that comes back: the two that were only reserved are held on their
    # first run there, until every job has started again.
    rescuer = f.worker("rescuer", "--concurrency", "4")
    doomed.kill()  # SIGKILL to the main process and its children
    wait_for(
        lambda: all(f.runs(i) >= 1 for i in ids) and sum(f.runs(i) for i in ids) == 6,
        120,
        "every job to start again on the rescuer",
    )
    for email_id in ids:
        f.release(email_id)
    statuses = wait_until_closed(res, ids, timeout=60)
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs_of(res, ids).values()} <= {1, 2}
    assert rescuer.alive()


def test_a_live_worker_s_held_jobs_are_never_taken_from_it(res, fleet) -> None:  # type: ignore[no-untyped-def]
    dead_after = 2
    f = fleet(
        MAILPIPE_WORKER_HEARTBEAT_INTERVAL="1",
        MAILPIPE_WORKER_DEAD_AFTER=str(dead_after),
        MAILPIPE_TASK_SOFT_TIME_LIMIT="110",
        MAILPIPE_TASK_TIME_LIMIT="120",
        MAILPIPE_VISIBILITY_TIMEOUT="600",
    )
    f.worker("busy", "--concurrency", "1")  # one running, one reserved behind it
    ids = store_emails(res, [email(f"held-{n}") for n in range(2)])
    for email_id in ids:
        f.set_fault(email_id, "held", times=1)
    f.enqueue(ids)
    wait_for(
        lambda: f.unacked() == 2 and sum(map(f.runs, ids)) == 1,
        30,
        "the busy worker to hold both jobs, one of them running",
    )
    f.worker("idle")  # would take any message the busy one lost
    # Both stay the busy worker's for three times dead_after, on Redis's clock (the one the
    # heartbeats and their cutoffs run on): neither starts again, nor waits in the queue.
    watched_until = redis_time(res.redis) + 3 * dead_after

    def kept() -> bool:
        assert (sum(map(f.runs, ids)), f.unacked(), f.queue_depth()) == (1, 2, 0)
        return redis_time(res.redis) > watched_until

    wait_for(kept, 60, "three times dead_after to pass with the jobs held")
    for email_id in ids:
        f.release(email_id)
    statuses = wait_until_closed(res, ids, timeout=60)
    assert set(statuses.values()) == {"succeeded"}
    # Each job ran once, on the worker that held it.
    assert [f.runs(i) for i in ids] == [1, 1]
    assert {run.attempts for run in runs_of(res, ids).values()} == {1}


@pytest.mark.parametrize(
    ("policy", "evicts"),
    [
        ("allkeys-lru", "allkeys-* evicts queued jobs"),
        ("volatile-lru", "volatile-* evicts leases, dedup markers and heartbeats first"),
    ],
)
def test_a_worker_refuses_a_redis_that_may_evict_keys(res, tmp_path, policy, evicts) -> None:  # type: ignore[no-untyped-def]
    server = PrivateRedis(tmp_path / "redis.log").start()
    try:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", policy)
        env = {**os.environ, "MAILPIPE_BROKER_URL": server.url}
        worker = localfleet.worker(env, tmp_path, name="evicting").start()
        try:
            assert worker.process.wait(60) != 0
        finally:
            worker.stop()  # a worker that did start must not outlive the test
        log = " ".join(worker.log_tail().split())  # the message, whatever its line breaks
        assert f"Redis maxmemory-policy is {policy}: it may evict keys mailpipe needs" in log
        assert evicts in log
        assert "Set it to noeviction" in log and "custom parameter group" in log
    finally:
        server.stop()
