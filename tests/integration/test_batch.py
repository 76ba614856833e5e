"""The bulk lane's model stage through Bedrock batch inference (docs/batch.md).

The batches' leader (`mailpipe.pipeline.batches.tick`, what beat's lock holder runs every
MAILPIPE_MODEL_BATCH_INTERVAL) is called from the test process against the real services: the
test's PostgreSQL database and Redis, the moto S3 server, and the stand-in of Bedrock's control
plane (tests/support/bedrock_batch_server.py) reached by real boto3 through
`AWS_ENDPOINT_URL_BEDROCK`. Real workers run where a worker is the subject (the hand-off to the
batch, a worker killed while a batch is out); elsewhere the model stage's deliveries are the
pipeline's own functions, called in this process. Small batches (a minimum of 2) keep it cheap.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from sqlalchemy import func, select

from mailpipe.broker import layout
from mailpipe.broker.queues import Lane, Stage, job_queues
from mailpipe.celery import app
from mailpipe.classifiers.batch import BatchModel
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails, sender
from mailpipe.operations import actions, status, sweeper
from mailpipe.pipeline import batches, job
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage import flags
from mailpipe.storage.models import (
    AttemptOutcome,
    BatchState,
    Classification,
    EmailLabel,
    ModelBatch,
    ModelBatchRecord,
    PipelineRun,
    RunAttempt,
    RunStatus,
)
from tests.support.bedrock_batch_server import BedrockBatchServer, JobScript
from tests.support.bedrock_server import BedrockServer, invoices
from tests.support.waits import wait_for

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

ROLE_ARN = "arn:aws:iam::123456789012:role/mailpipe-batch"
BATCH_SETTINGS = {
    "model_backend": "bedrock",
    "model_batch": "on",
    "model_batch_role_arn": ROLE_ARN,
    "model_batch_min": 2,
    "model_batch_size": 4,
    "model_batch_wait": 0,
    "model_batch_max_wait": 3600,
}


@pytest.fixture
def stand_ins(
    res: Resources, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[BedrockBatchServer, BedrockServer]]:
    """The control plane's stand-in and the Converse one, with boto3 pointed at them."""
    with (
        BedrockBatchServer(res.settings.s3_endpoint_url or "") as batch,
        BedrockServer() as converse,
    ):
        monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK", batch.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_BEDROCK_RUNTIME", converse.url)
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        yield batch, converse


def resources(res: Resources, **overrides: Any) -> Resources:
    """Resources like `res`, with the batch settings and `overrides`."""
    return Resources(Settings(**{**res.settings.model_dump(), **BATCH_SETTINGS, **overrides}))


@pytest.fixture
def bres(res: Resources, stand_ins: object) -> Iterator[Resources]:
    made = resources(res)
    yield made
    made.close()


def leader(res: Resources) -> batches.TickResult:
    """One pass of the batches' leader, as beat's lock holder runs it."""
    return batches.tick(res, sender(res), BatchModel.from_settings(res.settings))


def waiting_for_batch(res: Resources, n: int, lane: Lane = Lane.BULK) -> list[int]:
    """`n` invoices whose CPU stage is done and whose model stage was delivered once: with
    batches on, in the bulk lane, each then waits for a batch."""
    email_ids = store_emails(res, invoices(n), lane)
    for email_id in email_ids:
        assert job.process_email(res, email_id, lane=lane).kind is Kind.HANDED_OFF
        verdict = job.classify_email(res, email_id, lane=lane)
        assert verdict.kind is (Kind.BATCHED if lane is Lane.BULK else Kind.SUCCEEDED)
    return email_ids


def statuses(res: Resources, email_ids: list[int]) -> dict[int, RunStatus]:
    with res.db.session() as session:
        rows = session.execute(
            select(PipelineRun.email_id, PipelineRun.status).where(
                PipelineRun.email_id.in_(email_ids)
            )
        )
        return {email_id: run_status for email_id, run_status in rows}


def assert_applied_once(res: Resources, email_ids: list[int]) -> None:
    """Every run succeeded once, with one classification with its tokens, one succeeded
    attempt, its label, and nothing left waiting for a batch."""
    with res.db.session() as session:
        for email_id in email_ids:
            run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).one()
            assert run.status is RunStatus.SUCCEEDED, (email_id, run.status, run.error)
            answers = session.scalars(
                select(Classification).where(Classification.email_id == email_id)
            ).all()
            assert len(answers) == 1
            assert answers[0].input_tokens and answers[0].output_tokens
            succeeded = session.scalar(
                select(func.count()).where(
                    RunAttempt.email_id == email_id,
                    RunAttempt.outcome == AttemptOutcome.SUCCEEDED.value,
                )
            )
            assert succeeded == 1
            labels = session.scalars(
                select(EmailLabel.label).where(EmailLabel.email_id == email_id)
            ).all()
            assert labels == ["invoice"]
        assert not session.scalar(select(func.count()).select_from(ModelBatchRecord))


def batch_objects(res: Resources) -> list[str]:
    """The objects under the blob prefix's `batch/`."""
    bucket, _, prefix = res.settings.blob_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=res.settings.s3_endpoint_url)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/batch/")
    return [found["Key"] for found in listed.get("Contents", [])]


def test_a_bulk_backfill_is_batched_applied_once_past_a_killed_worker_and_live_mail_is_not(
    res: Resources,
    stand_ins: tuple[BedrockBatchServer, BedrockServer],
    tmp_path: Path,
) -> None:
    batch, converse = stand_ins
    others = [name for reply in app.control.ping(timeout=1.0) or [] for name in reply]
    assert not others, f"workers already consume this run's queue: {others}"
    env = {
        **os.environ,
        "MAILPIPE_MODEL_BACKEND": "bedrock",
        "MAILPIPE_MODEL_BATCH": "on",
        "MAILPIPE_MODEL_BATCH_ROLE_ARN": ROLE_ARN,
        "MAILPIPE_MODEL_BATCH_MIN": "2",
        "MAILPIPE_MODEL_BATCH_SIZE": "4",
        "MAILPIPE_MODEL_BATCH_WAIT": "0",
    }
    queue = res.settings.queue

    def model_role(name: str) -> localfleet.CeleryProcess:
        return localfleet.worker(
            env,
            tmp_path,
            concurrency=4,
            name=name,
            pool="threads",
            extra_args=("-Q", f"{queue}.model,{queue}.model.bulk"),
        ).start()

    cpu = localfleet.worker(
        env, tmp_path, name="cpu", extra_args=("-Q", f"{queue},{queue}.bulk,{queue}.control")
    ).start()
    model = model_role("models-a")
    started = [cpu, model]
    bres = resources(res)
    try:
        for worker in started:
            worker.wait_ready()
        bulk = store_emails(res, invoices(4), Lane.BULK)
        [live] = store_emails(res, invoices(1))
        enqueue_emails(bulk, res, lane=Lane.BULK)
        enqueue_emails([live], res)

        def all_wait() -> bool:
            with res.db.session() as session:
                waiting = session.scalar(select(func.count()).select_from(ModelBatchRecord))
            return waiting == len(bulk) and statuses(res, [live])[live] is RunStatus.SUCCEEDED

        wait_for(all_wait, timeout=60, what="the bulk emails to wait for a batch")
        assert len(converse.requests) == 1  # the live email's, through Converse
        with res.db.session() as session:
            shown = status.job_state(res, session, bulk[0])
        assert shown is not None
        assert (shown["state"], shown["waiting_for"], shown["batch_job"]) == (
            "waiting",
            "batch",
            None,
        )

        formed = leader(bres)
        assert (formed.formed, formed.submitted) == (1, 1)
        [out] = batch.jobs
        with res.db.session() as session:
            shown = status.job_state(res, session, bulk[0])
        assert shown is not None and shown["batch_job"] == out.job_id
        # While the batch is out: the model role is killed and another takes its place, and a
        # sweep finds nothing lost.
        model.kill()
        started.append(model := model_role("models-b"))
        model.wait_ready()
        swept = sweeper.sweep(res, enqueue=sender(res), in_flight_grace=0)
        assert (swept.readded_stalled, swept.started_waiting) == (0, 0)

        applied = leader(bres)
        assert applied.applied == len(bulk)
        assert_applied_once(res, [*bulk, live])
        assert len(converse.requests) == 1
        [record] = out.request["inputDataConfig"]["s3InputDataConfig"]["s3Uri"].split("/")[-1:]
        assert record == batches.INPUT_NAME
        with res.db.session() as session:
            done = session.scalars(select(ModelBatch)).one()
        assert (done.state, done.answered, done.unanswered) == (BatchState.DONE, 4, 0)
        assert batch_objects(res) == []  # input and output deleted once applied
    finally:
        bres.close()
        for worker in started:
            worker.stop()


def test_failed_expired_and_stopped_batches_send_their_emails_back_and_fail_no_run(
    bres: Resources, stand_ins: tuple[BedrockBatchServer, BedrockServer]
) -> None:
    batch, converse = stand_ins
    batch.script(JobScript("Failed"), JobScript("Expired"))
    email_ids = waiting_for_batch(bres, 4)
    assert leader(bres).submitted == 1
    for ended in ("Failed", "Expired", "Stopped"):
        if ended == "Stopped":
            boto3.client("bedrock").stop_model_invocation_job(jobIdentifier=batch.jobs[-1].arn)
        # Read as ended: its records wait again, and form the next batch at once.
        passed = leader(bres)
        assert (passed.ended, passed.submitted, passed.applied) == (1, 1, 0), ended
        assert batch.jobs[-2].status == ended
        assert set(statuses(bres, email_ids).values()) == {RunStatus.OPEN}
    assert leader(bres).applied == 4
    assert len(batch.jobs) == 4
    assert_applied_once(bres, email_ids)
    with bres.db.session() as session:
        failed_attempts = session.scalar(
            select(func.count()).where(RunAttempt.outcome == AttemptOutcome.FAILED.value)
        )
    assert failed_attempts == 0
    assert converse.requests == []
    assert batch_objects(bres) == []


def test_records_left_without_an_answer_are_their_emails_failed_attempts_then_rebatched(
    bres: Resources, stand_ins: tuple[BedrockBatchServer, BedrockServer]
) -> None:
    batch, _ = stand_ins
    batch.script(JobScript(errors=1, omitted=1))
    email_ids = waiting_for_batch(bres, 4)
    leader(bres)
    partial = leader(bres)
    # Applied, and the two without an answer formed into the next batch at once.
    assert (partial.applied, partial.unanswered, partial.submitted) == (2, 2, 1)
    with bres.db.session() as session:
        runs = {
            run.email_id: run
            for run in session.scalars(
                select(PipelineRun).where(PipelineRun.status == RunStatus.OPEN)
            )
        }
        assert len(runs) == 2
        assert {run.error_class for run in runs.values()} == {"BatchUnanswered"}
        assert all(run.attempts == 1 for run in runs.values())
        waiting = session.scalars(select(ModelBatchRecord)).all()
        assert {record.email_id for record in waiting} == set(runs)
        assert {record.batch_id for record in waiting} == {2}
    assert leader(bres).applied == 2
    assert_applied_once(bres, email_ids)


def test_a_leader_that_dies_mid_apply_and_two_leaders_at_once_apply_each_answer_once(
    res: Resources,
    bres: Resources,
    stand_ins: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    email_ids = waiting_for_batch(bres, 4)
    leader(bres)
    synced = batches.sync_model_labels
    calls = []

    def dies_on_the_third(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("the leader's process died")
        synced(*args, **kwargs)

    monkeypatch.setattr(batches, "sync_model_labels", dies_on_the_third)
    with pytest.raises(RuntimeError):
        leader(bres)
    monkeypatch.setattr(batches, "sync_model_labels", synced)
    assert list(statuses(bres, email_ids).values()).count(RunStatus.SUCCEEDED) == 2
    # The old leader and the new one, at once.
    other = resources(res)
    passes = [threading.Thread(target=leader, args=(each,)) for each in (bres, other)]
    for each in passes:
        each.start()
    for each in passes:
        each.join()
    other.close()
    assert_applied_once(bres, email_ids)


def test_a_leftover_goes_real_time_and_nothing_is_submitted_while_model_calls_are_off(
    res: Resources, stand_ins: tuple[BedrockBatchServer, BedrockServer]
) -> None:
    batch, converse = stand_ins
    bres = resources(res, model_batch_max_wait=0)
    try:
        [email_id] = waiting_for_batch(bres, 1)
        with bres.db.transaction() as session:
            flags.set_model_calls(session, False)
        assert leader(bres).realtime == 0
        with bres.db.transaction() as session:
            flags.set_model_calls(session, True)
        assert leader(bres).realtime == 1
        assert batch.jobs == []
        queued = layout.emails_in_broker(bres.redis, job_queues(bres.settings))
        assert email_id in queued
        # Its delivery goes through Converse, as any model stage does.
        assert job.classify_email(bres, email_id, lane=Lane.BULK).kind is Kind.SUCCEEDED
        assert len(converse.requests) == 1
        leader(bres)
        assert_applied_once(bres, [email_id])
    finally:
        bres.close()


def test_nothing_is_submitted_while_the_model_stage_or_the_emails_mailbox_is_paused(
    bres: Resources, stand_ins: tuple[BedrockBatchServer, BedrockServer]
) -> None:
    batch, _ = stand_ins
    email_ids = waiting_for_batch(bres, 2)
    actions.pause(bres, Stage.MODEL, "by the test", user="test")
    assert leader(bres).submitted == 0
    actions.resume(bres, Stage.MODEL, user="test")
    actions.pause_mailbox(bres, "default", "by the test", user="test")
    assert leader(bres).submitted == 0
    assert batch.jobs == []
    actions.resume_mailbox(bres, "default", enqueue=sender(bres), user="test")
    assert leader(bres).submitted == 1
    assert leader(bres).applied == 2
    assert_applied_once(bres, email_ids)


def test_with_batches_off_the_bulk_lane_is_real_time_and_so_are_the_emails_left_waiting(
    res: Resources, bres: Resources, stand_ins: tuple[BedrockBatchServer, BedrockServer]
) -> None:
    batch, converse = stand_ins
    left_waiting = waiting_for_batch(bres, 2)
    off = resources(res, model_batch="off")
    try:
        fresh = store_emails(off, invoices(2), Lane.BULK)
        for email_id in fresh:
            job.process_email(off, email_id, lane=Lane.BULK)
            assert job.classify_email(off, email_id, lane=Lane.BULK).kind is Kind.SUCCEEDED
        assert len(converse.requests) == 2
        # The leader sends the emails still waiting through real-time.
        assert leader(off).realtime == 2
        for email_id in left_waiting:
            assert job.classify_email(off, email_id, lane=Lane.BULK).kind is Kind.SUCCEEDED
        assert len(converse.requests) == 4
        assert batch.jobs == []
        leader(off)
        assert_applied_once(off, [*left_waiting, *fresh])
    finally:
        off.close()
