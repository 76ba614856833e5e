"""An email's lane travels with every job of it: through a flushed broker and the sweep that
recovers it, a retry from the failed list, a move to the other lane, and a real worker's
hand-off to the model stage."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mailpipe.broker.queues import Lane, Stage, stage_queue
from mailpipe.cli.ingest import store_emails
from mailpipe.pipeline import runs
from mailpipe.storage.models import EmailMessage, ErrorClass
from tests.support.bedrock_server import BedrockServer
from tests.support.emails import raw_email
from tests.support.fleet import Fleet
from tests.support.waits import wait_for

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def emails(n: int, tag: str) -> list[bytes]:
    return [raw_email(f"s{i}", message_id=f"{tag}{i}@x", body=f"body {i}") for i in range(n)]


def mailpipe(f: Fleet, *args: str) -> str:
    """`mailpipe ARGS` in the fleet's key space; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", *args],
        env={**os.environ, **f.env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout


def fail(res, email_id: int) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        assert runs.fail(session, email_id, "failed by the test", error_class=ErrorClass.LOST)


def test_each_email_s_jobs_stay_in_its_lane_through_recovery_retry_move_and_hand_off(
    res,  # type: ignore[no-untyped-def]
    fleet,
) -> None:
    server = BedrockServer().start()
    try:
        # A remote model with model calls on: the CPU stage hands each email off.
        f = fleet(MAILPIPE_MODEL_BACKEND="bedrock", AWS_ENDPOINT_URL_BEDROCK_RUNTIME=server.url)
        live_cpu, bulk_cpu, live_model, bulk_model = (
            stage_queue(stage, res.settings, lane) for stage in Stage for lane in Lane
        )
        [live] = store_emails(res, emails(1, "lane-live"))
        bulk, moved = store_emails(res, emails(2, "lane-bulk"), Lane.BULK)

        # A flushed broker (queue bindings, markers and all): the sweep sends each job in its lane.
        f.flush()
        assert sorted(f.sweep()["readded_ids"]) == sorted([live, bulk, moved])
        assert f.jobs_in(live_cpu) == {live: "live"}
        assert f.jobs_in(bulk_cpu) == {bulk: "bulk", moved: "bulk"}

        # A failed run retried from the failed list goes back in its lane.
        fail(res, moved)
        f.flush()
        assert mailpipe(f, "failed", "--retry", str(moved)).startswith("reopened 1, enqueued 1")
        assert f.jobs_in(bulk_cpu) == {moved: "bulk"}
        assert f.jobs_in(live_cpu) == {}

        # Moved to live, it fails again: its next retry goes live.
        assert mailpipe(f, "lane", "live", str(moved)).startswith("moved 1 to live")
        with res.db.session() as session:
            assert session.get_one(EmailMessage, moved).lane == Lane.LIVE
        fail(res, moved)
        f.flush()
        mailpipe(f, "failed", "--retry", str(moved))
        assert f.jobs_in(live_cpu) == {moved: "live"}
        assert f.jobs_in(bulk_cpu) == {}

        # A real worker of the CPU stage's two lanes, and no model role: each hand-off waits
        # in its lane's model queue.
        f.flush()
        f.sweep()  # the three jobs again, each in its email's lane
        cpu_queues = ",".join([live_cpu, bulk_cpu, f"{res.settings.queue}.control"])
        f.worker("cpu-stage", f"--queues={cpu_queues}")
        wait_for(
            lambda: len(f.jobs_in(live_model)) + len(f.jobs_in(bulk_model)) == 3,
            60,
            "the three hand-offs to the model stage",
        )
        assert f.jobs_in(live_model) == {live: "live", moved: "live"}
        assert f.jobs_in(bulk_model) == {bulk: "bulk"}
    finally:
        server.stop()
