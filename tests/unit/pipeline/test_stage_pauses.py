"""An operator's pause outlives a flushed or restarted Redis: the database keeps it, and the
first reader that finds Redis without it puts it back (mailpipe.pipeline.stage_pauses)."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import select

from mailpipe.broker.queues import Stage
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses
from mailpipe.operations import actions
from mailpipe.pipeline import job, stage_pauses
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import PipelineRun
from tests.support.services import delete_prefix
from tests.unit.pipeline.test_job import PLAIN

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def lose_redis(res: Resources) -> None:
    """What a flushed or restarted Redis leaves: none of this run's keys, and no cached read."""
    delete_prefix(os.environ["MAILPIPE_BROKER_URL"], os.environ["MAILPIPE_REDIS_PREFIX"])
    res.pauses.forget()
    assert pauses.paused(res.redis) == {}


def test_an_operators_pause_is_put_back_with_its_reason_and_start(res: Resources) -> None:
    held = actions.pause(res, Stage.CPU, "incident 7", user="ops")
    lose_redis(res)

    back = stage_pauses.in_force(res)
    assert set(back) == {Stage.CPU}
    assert (back[Stage.CPU].by, back[Stage.CPU].error) == (pauses.OPERATOR, "incident 7")
    assert back[Stage.CPU].since == held.since
    assert pauses.paused(res.redis) == back  # in Redis again, for every worker


def test_a_resumed_pause_stays_ended_through_a_flush(res: Resources) -> None:
    actions.pause(res, Stage.MODEL, "incident 8", user="ops")
    assert actions.resume(res, Stage.MODEL, user="ops")
    lose_redis(res)
    assert stage_pauses.in_force(res) == {}


def test_an_outages_pause_is_not_kept(res: Resources) -> None:
    # Its own check pauses the stage again if the outage lasts; a kept one would need a resume.
    pauses.record_fault(
        res.redis, Stage.CPU, 1, "BlobUnavailable", dependency="blobs", threshold=1, window=60
    )
    lose_redis(res)
    assert stage_pauses.in_force(res) == {}


def test_a_job_after_a_flush_sees_the_kept_pause_and_claims_nothing(res: Resources) -> None:
    actions.pause(res, Stage.CPU, "incident 9", user="ops")
    [email_id] = store_emails(res, [PLAIN])
    lose_redis(res)

    outcome = job.process_email(res, email_id)
    assert outcome.kind is Kind.PAUSED
    assert outcome.error == "the cpu stage is paused: incident 9"
    with res.db.session() as session:
        assert session.scalars(select(PipelineRun)).all() == []
