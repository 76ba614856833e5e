"""Stage pauses on real workers (mailpipe.coordination.pauses, mailpipe.app.pausing).

A fleet-wide fault, S3 or Bedrock refusing the fleet, pauses its stage instead of failing its
backlog: no run fails, no attempt is used, the workers stop taking the stage's jobs, which wait
in the broker, and a probe ends the pause once access is back. An operator's pause does the same
through `mailpipe pause` and ends with `mailpipe resume`. The workers are `celery worker`
processes of the test's own key prefix (tests/support/fleet.py); the test reads the pause as an
operator does, with `mailpipe status --json`, and the runs in the database.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import select

from mailpipe.broker.queues import family
from mailpipe.cli.demo.fleet import CeleryProcess
from mailpipe.cli.ingest import store_emails
from mailpipe.storage.models import PipelineRun
from tests.support.bedrock_server import (
    TimedBedrockServer,
    error,
    invoices,
    keyword_labels,
    unlimited_bedrock_env,
)
from tests.support.flaky_proxy import FlakyProxy
from tests.support.fleet import Fleet
from tests.support.waits import holds_for, wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

EMAILS = 50
PROBE_INTERVAL_S = 1.0
# The pause is watched for this many probe intervals: long enough for several probes and for a
# worker that still took jobs to show it.
WATCHED_INTERVALS = 5
FAST_PROBES = {"MAILPIPE_PAUSE_PROBE_INTERVAL": str(PROBE_INTERVAL_S)}


def mailpipe(env: dict[str, str], *args: str) -> str:
    """`mailpipe ARGS` as an operator runs it, on the fleet's broker and key prefix."""
    done = subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def paused(env: dict[str, str]) -> dict[str, Any]:
    """The `paused` object of `mailpipe status --json`."""
    return json.loads(mailpipe(env, "status", "--json"))["paused"]


def runs(res, email_ids: list[int]) -> list[PipelineRun]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return list(session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(email_ids))))


def assert_jobs_wait_in_the_broker(
    f: Fleet, jobs: int, queue: str | None = None, requests: Callable[[], int] | None = None
) -> None:
    """Every job is back in `queue` (the email queue by default) and none is held by a worker,
    and it stays so for several probe intervals: the workers no longer take the stage's jobs.
    `requests`: a count of the calls the paused service received, which may grow by a probe per
    interval only."""
    wait_for(
        lambda: f.queue_depth(queue) == jobs and f.unacked() == 0,
        60,
        f"all {jobs} jobs back in the queue",
    )
    before = requests() if requests is not None else 0
    holds_for(
        lambda: f.queue_depth(queue) == jobs and f.unacked() == 0,
        WATCHED_INTERVALS * PROBE_INTERVAL_S,
        f"{jobs} jobs waiting in the queue",
    )
    if requests is not None:
        probes = requests() - before
        # A probe per interval, give or take one at either end of the window; without the pause
        # each of the jobs would be calling the service again.
        assert 1 <= probes <= WATCHED_INTERVALS + 1, probes


def test_s3_refusing_the_fleet_pauses_the_cpu_stage_and_a_probe_ends_it(res, fleet) -> None:  # type: ignore[no-untyped-def]
    proxy = FlakyProxy(res.settings.s3_endpoint_url).start()
    try:
        proxy.deny(code="AccessDenied")
        # The workers reach S3 through the proxy; this process stores the blobs directly.
        f = fleet(MAILPIPE_S3_ENDPOINT_URL=proxy.url, **FAST_PROBES)
        f.worker("cpu")
        ids = store_emails(res, invoices(EMAILS))
        f.enqueue(ids)

        wait_for(lambda: "cpu" in paused(f.env), 60, "the cpu stage to pause")
        pause = paused(f.env)["cpu"]
        assert pause["by"] == "auto"
        assert "AccessDenied" in pause["error"]
        assert_jobs_wait_in_the_broker(f, EMAILS, requests=lambda: proxy.failed_requests)
        # The emails taken before the pause hold open runs that used no attempt; the others
        # have no run yet.
        during = runs(res, ids)
        assert len(during) >= 3  # MAILPIPE_PAUSE_AFTER_EMAILS
        assert {run.status.value for run in during} == {"open"}
        assert {run.attempts for run in during} == {0}
        assert all(run.converted_at is None for run in during)

        proxy.deny(False)
        statuses = wait_until_closed(res, ids, timeout=120)
    finally:
        proxy.stop()
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res, ids)} == {1}
    assert paused(f.env) == {}


def test_bedrock_refusing_the_fleet_pauses_the_model_stage_only(res, fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    denied = error("AccessDeniedException", 403, "You don't have access to the model.")
    server = TimedBedrockServer(default=denied)
    server.start()
    try:
        f = fleet(**unlimited_bedrock_env(server, tmp_path), **FAST_PROBES)
        f.both_stages()
        ids = store_emails(res, invoices(EMAILS))
        f.enqueue(ids)

        wait_for(lambda: "model" in paused(f.env), 60, "the model stage to pause")
        pause = paused(f.env)
        assert set(pause) == {"model"}  # the CPU stage goes on
        assert pause["model"]["by"] == "auto"
        assert "AccessDeniedException" in pause["model"]["error"]
        # Every email passed the CPU stage, and its model stage waits in the broker.
        assert_jobs_wait_in_the_broker(
            f, EMAILS, queue=f"{res.settings.queue}.model", requests=lambda: len(server.calls)
        )
        during = runs(res, ids)
        assert len(during) == EMAILS
        assert {run.status.value for run in during} == {"open"}
        assert all(run.converted_at is not None for run in during)
        # The model stage starts with a fresh budget, and the fault gave back every attempt.
        assert {run.attempts for run in during} == {0}

        server.default = keyword_labels
        statuses = wait_until_closed(res, ids, timeout=120)
    finally:
        server.stop()
    assert set(statuses.values()) == {"succeeded"}
    after = runs(res, ids)
    assert {run.attempts for run in after} == {1}
    # One claim for the CPU stage, one for each model-stage delivery that reached the model:
    # those the model refused (at least one per email it took to pause the stage) used none of
    # the attempts, the one it answered used the only attempt counted.
    refused = [run.claims - 2 for run in after]
    assert min(refused) >= 0
    assert sum(1 for n in refused if n > 0) >= 3
    answered = server.statuses()
    assert answered.count(403) >= sum(refused)
    # Each email classified once, and the probe that ended the pause.
    assert answered.count(200) == EMAILS + 1
    assert paused(f.env) == {}


def test_an_operators_pause_stops_a_live_worker_until_resumed(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(**FAST_PROBES)
    worker = f.worker("cpu")
    queue = res.settings.queue
    lanes = {queue, f"{queue}.bulk"}
    assert lanes <= f.consumed_queues(worker.nodename)

    mailpipe(f.env, "pause", "cpu")
    wait_for(
        lambda: not lanes & f.consumed_queues(worker.nodename),
        30,
        "the worker to stop consuming both lanes of the cpu stage",
    )
    pause = paused(f.env)
    assert set(pause) == {"cpu"}
    assert pause["cpu"]["by"] == "operator"
    ids = store_emails(res, invoices(EMAILS))
    f.enqueue(ids)
    assert_jobs_wait_in_the_broker(f, EMAILS)
    assert runs(res, ids) == []  # no job was claimed, not even taken and put back

    mailpipe(f.env, "resume", "cpu")
    statuses = wait_until_closed(res, ids, timeout=120)
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res, ids)} == {1}
    assert paused(f.env) == {}
    assert lanes <= f.consumed_queues(worker.nodename)


def test_an_operators_pause_outlives_a_flushed_redis(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # A Redis without persistence restarted, or flushed: the worker itself puts the kept pause
    # back (no `mailpipe` command runs until it has) and never consumes the stage meanwhile.
    f = fleet()
    worker = f.worker("cpu")
    queue = res.settings.queue
    lanes = {queue, f"{queue}.bulk"}
    mailpipe(f.env, "pause", "cpu", "--reason", "incident")
    wait_for(lambda: not lanes & f.consumed_queues(worker.nodename), 30, "the pause applied")
    since = paused(f.env)["cpu"]["since"]

    f.flush()
    restored = f"{f.prefix}mailpipe:pauses:restored"
    wait_for(lambda: res.redis.exists(restored), 30, "the worker to put the kept pause back")
    pause = paused(f.env)
    assert (pause["cpu"]["by"], pause["cpu"]["error"], pause["cpu"]["since"]) == (
        "operator",
        "incident",
        since,
    )
    ids = store_emails(res, invoices(EMAILS))
    f.enqueue(ids)
    assert_jobs_wait_in_the_broker(f, EMAILS)
    assert runs(res, ids) == []
    assert not lanes & f.consumed_queues(worker.nodename)

    mailpipe(f.env, "resume", "cpu")
    statuses = wait_until_closed(res, ids, timeout=120)
    assert set(statuses.values()) == {"succeeded"}


def lose_broker_connection(res, worker: CeleryProcess) -> int:  # type: ignore[no-untyped-def]
    """Close the worker main process's connections to Redis from the server's side, as a
    failover or a network blip does; returns how many were closed."""
    port = res.redis.connection_pool.connection_kwargs["port"]
    return sum(
        res.redis.client_kill_filter(addr=f"{conn.laddr.ip}:{conn.laddr.port}")
        for conn in psutil.Process(worker.pid).net_connections(kind="tcp")
        if conn.raddr and conn.raddr.port == port
    )


def test_a_paused_worker_stays_paused_across_a_lost_broker_connection(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # Celery starts the consumer again after a lost connection, with the queues it consumes
    # then; the pause must hold through it, and so must the resume.
    f = fleet()
    worker = f.worker("cpu")
    queue = res.settings.queue

    def with_shards(*lane_queues: str) -> set[str]:
        return {name for each in lane_queues for name in family(each, res.settings)}

    others = {f"{queue}.control", *with_shards(f"{queue}.model", f"{queue}.model.bulk")}
    mailpipe(f.env, "pause", "cpu")
    wait_for(lambda: f.consumed_queues(worker.nodename) == others, 30, "the pause applied")

    assert lose_broker_connection(res, worker) > 0
    # Only a worker connected again answers; it still leaves the paused queue alone.
    wait_for(lambda: f.consumed_queues(worker.nodename) == others, 60, "the worker back")
    ids = store_emails(res, invoices(EMAILS))
    f.enqueue(ids)
    assert_jobs_wait_in_the_broker(f, EMAILS)
    assert runs(res, ids) == []

    mailpipe(f.env, "resume", "cpu")
    wait_for(lambda: queue in f.consumed_queues(worker.nodename), 30, "the resume applied")
    assert lose_broker_connection(res, worker) > 0
    statuses = wait_until_closed(res, ids, timeout=120)
    assert set(statuses.values()) == {"succeeded"}
    assert f.consumed_queues(worker.nodename) == {*with_shards(queue, f"{queue}.bulk"), *others}


def test_a_pause_past_its_alarm_bound_fails_nothing_and_alarms(res, fleet) -> None:  # type: ignore[no-untyped-def]
    """No run fails for an outage, however long: past MAILPIPE_OUTAGE_ALARM_AFTER the pause
    alarms instead, and the jobs still wait for the dependency."""
    alarm_after = 2.0
    proxy = FlakyProxy(res.settings.s3_endpoint_url).start()
    try:
        proxy.deny(code="AccessDenied")
        f = fleet(
            MAILPIPE_S3_ENDPOINT_URL=proxy.url,
            MAILPIPE_OUTAGE_ALARM_AFTER=str(alarm_after),
            **FAST_PROBES,
        )
        f.worker("cpu")
        denied = store_emails(res, invoices(10))
        f.enqueue(denied)
        wait_for(lambda: "cpu" in paused(f.env), 60, "the cpu stage to pause")
        wait_for(lambda: paused(f.env).get("cpu", {}).get("alarm"), 60, "the outage's alarm")
        pause = paused(f.env)["cpu"]
        assert (pause["by"], pause["dependency"]) == ("auto", "blobs")
        since = datetime.fromisoformat(pause["since"]).timestamp()
        assert time.time() - since > alarm_after
        assert {run.status.value for run in runs(res, denied)} <= {"open"}

        proxy.deny(False)
        assert set(wait_until_closed(res, denied, timeout=90).values()) == {"succeeded"}
        assert {run.attempts for run in runs(res, denied)} == {1}
        assert paused(f.env) == {}
    finally:
        proxy.stop()
