"""Crash isolation, leases, worker death and SIGTERM on real prefork workers.

Each test starts its own workers with `tests.support.faults` loaded and its own Redis key prefix,
so a killed worker never takes the session's shared worker with it.
"""

from __future__ import annotations

import signal

import pytest
from sqlalchemy import select

from mailpipe.broker.queues import control_queue, email_queue, model_queue
from mailpipe.cli.ingest import store_emails
from mailpipe.storage.models import PipelineRun, RunAttempt
from tests.support.bedrock_server import BedrockServer
from tests.support.emails import raw_email
from tests.support.fleet import Fleet, waiting_in
from tests.support.waits import run_statuses, wait_for, wait_until_closed

pytestmark = [pytest.mark.slow, pytest.mark.services]  # Redis, PostgreSQL and the S3 server


def email(tag: str) -> bytes:
    return raw_email(f"Invoice {tag}", message_id=f"{tag}@x", body="Amount due")


def run_of(res, email_id: int) -> PipelineRun:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).one()


# How a child can die mid-job: it exits, it is SIGKILLed (the OOM killer), it segfaults.
CRASH_MODES = ("exit", "sigkill", "segfault")


def test_jobs_that_kill_their_child_fail_alone_after_their_attempts(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet()
    worker = f.worker("crash")
    *poisons, good = store_emails(
        res, [email(f"poison-{mode}") for mode in CRASH_MODES] + [email("good")]
    )
    for poison, mode in zip(poisons, CRASH_MODES, strict=True):
        f.set_fault(poison, mode)
    f.enqueue([*poisons, good])
    statuses = wait_until_closed(res, [*poisons, good], timeout=180)
    assert statuses == {**dict.fromkeys(poisons, "failed"), good: "succeeded"}
    for poison, mode in zip(poisons, CRASH_MODES, strict=True):
        run = run_of(res, poison)
        assert run.attempts == res.settings.max_attempts == 4, mode
        assert "gave up after 4 attempts" in run.error, (mode, run.error)
        assert "worker process died" in run.error, (mode, run.error)
        assert f.runs(poison) == 4, mode  # requeued after each death, never a fifth time
    assert worker.alive()  # the main process lived through every crash
    # Every message acknowledged and none waiting: nothing is left that could run a fifth time.
    wait_for(lambda: _unacked_and_queued(f) == (0, 0), 30, "every message acked")
    assert [f.runs(poison) for poison in poisons] == [4, 4, 4]


def test_memory_blown_past_a_limit_fails_the_job_after_its_attempts_and_the_child_lives(
    res, fleet
) -> None:  # type: ignore[no-untyped-def]
    f = fleet()
    worker = f.worker("memory", "--concurrency", "1")
    children_before = worker.child_pids()
    hog, good = store_emails(res, [email("hog"), email("after-hog")])
    f.set_fault(hog, "memory")
    f.enqueue([hog, good])
    statuses = wait_until_closed(res, [hog, good])
    assert statuses == {hog: "failed", good: "succeeded"}
    run = run_of(res, hog)
    # A MemoryError is nothing the pipeline classifies: retried like any unforeseen error.
    assert run.attempts == 4 and f.runs(hog) == 4
    assert run.error.startswith("gave up after 4 attempts: unexpected MemoryError"), run.error
    assert worker.child_pids() == children_before  # the same child went on to the next jobs


def test_a_slow_job_past_the_visibility_timeout_is_not_run_twice_at_once(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # The settings refuse a visibility timeout below the time limits; a message that carries
    # its own, longer limits breaks that rule, and the lease must still hold.
    f = fleet(
        MAILPIPE_VISIBILITY_TIMEOUT="8",
        MAILPIPE_TASK_SOFT_TIME_LIMIT="3",
        MAILPIPE_TASK_TIME_LIMIT="4",
        MAILPIPE_RETRY_BACKOFF_MAX="2",
    )
    [slow] = store_emails(res, [email("slow")])
    f.set_fault(slow, "slow:25", times=1)
    # Sent (and marked queued) before the worker starts: the sweep it runs at start must find
    # the job queued, not add a copy with the default limits.
    f.send(slow, soft_time_limit=60, time_limit=70)
    f.worker("slow")
    wait_until_closed(res, [slow], timeout=90)
    assert run_statuses(res, [slow]) == {slow: "succeeded"}
    assert run_of(res, slow).attempts == 1
    # The redelivered copy waited on the lease, then found the run closed: the steps ran once.
    assert f.runs(slow) == 1


def test_a_job_whose_child_died_runs_again_without_waiting_out_the_lease(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(MAILPIPE_LEASE_TTL="120")
    f.worker("takeover")
    [crashy] = store_emails(res, [email("crash-once")])
    f.set_fault(crashy, "sigkill", times=1)
    f.enqueue([crashy])
    # Far less than the 120 s lease: the dead child's lease is taken over at once.
    wait_until_closed(res, [crashy], timeout=45)
    run = run_of(res, crashy)
    assert (run.status.value, run.attempts) == ("succeeded", 2)
    # The killed child wrote nothing of its attempt: the next claim wrote it, as lost.
    with res.db.session() as session:
        statement = select(RunAttempt.attempt, RunAttempt.outcome, RunAttempt.error_class)
        history = session.execute(statement.order_by(RunAttempt.id)).all()
    assert history == [(1, "lost", "Lost"), (2, "succeeded", None)]


def test_sigterm_finishes_short_jobs_and_requeues_the_long_one_at_once(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(
        MAILPIPE_SOFT_SHUTDOWN_TIMEOUT="6",
        MAILPIPE_VISIBILITY_TIMEOUT="300",
        MAILPIPE_TASK_SOFT_TIME_LIMIT="100",
        MAILPIPE_TASK_TIME_LIMIT="120",
    )
    leaving = f.worker("leaving", REMAP_SIGTERM="SIGQUIT")
    short, long = store_emails(res, [email("short"), email("long")])
    # Both held while they start; the short one let go once its worker is stopping, the long one
    # held past the window.
    f.set_fault(short, "held", times=1)
    f.set_fault(long, "held", times=1)
    f.enqueue([short, long])
    wait_for(lambda: f.runs(short) == 1 and f.runs(long) == 1, 30, "both jobs to start")
    f.worker("staying")
    leaving.signal(signal.SIGTERM)
    f.release(short)
    # The long job is requeued when the window ends and finished elsewhere, long before the
    # 300 s visibility timeout would have brought it back (the wait gives up at 60 s).
    statuses = wait_until_closed(res, [short, long], timeout=60)
    assert statuses == {short: "succeeded", long: "succeeded"}
    short_run = run_of(res, short)
    assert (short_run.attempts, short_run.cutoffs) == (1, 0)  # finished inside the window
    # The cut-off gave its attempt back: the job's one counted attempt is the one that finished.
    long_run = run_of(res, long)
    assert (long_run.attempts, long_run.cutoffs) == (1, 1)
    assert leaving.process.wait(30) is not None


# A soft-shutdown window that held jobs outlast, and time limits far beyond it.
SHUTDOWN_WINDOW = {
    "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": "3",
    "MAILPIPE_VISIBILITY_TIMEOUT": "300",
    "MAILPIPE_TASK_SOFT_TIME_LIMIT": "100",
    "MAILPIPE_TASK_TIME_LIMIT": "120",
}


def cut_off_by_shutdown(f: Fleet, email_id: int, delivery: int) -> PipelineRun:
    """A worker of its own takes the job's `delivery`-th delivery and is sent SIGTERM while the
    job runs: it stops at the end of its soft-shutdown window and the broker takes the job back.
    Returns the run as the delivery's claim left it."""
    worker = f.worker(f"stopping-{delivery}", REMAP_SIGTERM="SIGQUIT")
    wait_for(lambda: f.runs(email_id) == delivery, 60, f"delivery {delivery} to start its steps")
    claimed = run_of(f.res, email_id)
    worker.signal(signal.SIGTERM)
    assert worker.process.wait(30) is not None
    return claimed


def test_a_job_cut_off_by_three_shutdowns_finishes_on_its_one_attempt(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(**SHUTDOWN_WINDOW)
    [long] = store_emails(res, [email("outlasts-shutdowns")])
    f.set_fault(long, "held", times=3)
    f.enqueue([long])
    for delivery in (1, 2, 3):
        claimed = cut_off_by_shutdown(f, long, delivery)
        # Each claim after a cut-off records it and gives the attempt back.
        assert (claimed.attempts, claimed.cutoffs) == (1, delivery - 1)
        if delivery > 1:
            assert claimed.error.startswith(
                f"cut off by shutdown ({delivery - 1} of at most 10)"
            ), claimed.error
    f.worker("staying")
    assert wait_until_closed(res, [long], timeout=90) == {long: "succeeded"}
    run = run_of(res, long)
    assert (run.attempts, run.cutoffs, run.error) == (1, 3, None)
    assert f.runs(long) == 4


def test_a_job_cut_off_more_often_than_the_bound_fails_saying_why(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(**SHUTDOWN_WINDOW, MAILPIPE_MAX_SHUTDOWN_CUTOFFS="2")
    [long] = store_emails(res, [email("outlasts-every-window")])
    f.set_fault(long, "held")
    f.enqueue([long])
    for delivery in (1, 2):
        cut_off_by_shutdown(f, long, delivery)
    # The third delivery's claim finds the second cut-off, the bound: the run fails unstarted.
    f.worker("staying")
    assert wait_until_closed(res, [long], timeout=90) == {long: "failed"}
    run = run_of(res, long)
    assert run.cutoffs == 2 and run.attempts == 0
    assert run.error == (
        "cut off by shutdown 2 times: the job runs longer than any worker's soft-shutdown "
        "window (MAILPIPE_SOFT_SHUTDOWN_TIMEOUT) lets it"
    )
    assert f.runs(long) == 2


def _unacked_and_queued(f: Fleet) -> tuple[int, int]:
    """Messages the broker holds for the fleet: delivered but unacked, and waiting in the queue."""
    redis = f.res.redis
    queued = waiting_in(redis, f.prefix, f.res.settings.queue, f.res.settings)
    return redis.hlen(f"{f.prefix}unacked"), queued


def test_every_job_is_acked_as_it_ends(res, fleet) -> None:  # type: ignore[no-untyped-def]
    # Celery sends an ack at the next turn of the worker's event loop; none may be left over.
    f = fleet()
    f.worker("acking")
    ids = store_emails(res, [email(f"ack-{n}") for n in range(40)])
    f.enqueue(ids)
    assert set(wait_until_closed(res, ids).values()) == {"succeeded"}
    wait_for(lambda: _unacked_and_queued(f) == (0, 0), 10, "every message acked")


@pytest.mark.parametrize("stop", ["warm", "soft"])
def test_a_job_that_ends_while_its_worker_stops_is_acked_not_requeued(
    res, fleet, stop: str
) -> None:  # type: ignore[no-untyped-def]
    # warm: SIGTERM as Celery takes it (wait for running jobs); soft: SIGTERM remapped to a cold
    # shutdown that first waits the soft-shutdown window, as the ECS task definitions run it.
    # The job is held until its worker is stopping, then let go; the soft-shutdown window covers
    # the rest of it with room, and Celery waits it out in full.
    f = fleet(MAILPIPE_SOFT_SHUTDOWN_TIMEOUT="8")
    worker = f.worker("stopping", **({"REMAP_SIGTERM": "SIGQUIT"} if stop == "soft" else {}))
    [ending] = store_emails(res, [email(f"ends-while-stopping-{stop}")])
    f.set_fault(ending, "held", times=1)
    f.enqueue([ending])
    wait_for(lambda: f.runs(ending) == 1, 30, "the job to start")
    worker.signal(signal.SIGTERM)
    f.release(ending)
    assert worker.process.wait(30) is not None
    assert run_statuses(res, [ending]) == {ending: "succeeded"}
    # Its ack went out before the worker closed its connection: a lost ack would have put the
    # message back in the queue (kombu restores a channel's unacked messages when it closes).
    assert _unacked_and_queued(f) == (0, 0)


def test_a_job_that_ends_inside_the_shutdown_window_is_not_taken_for_cut_off(res, fleet) -> None:  # type: ignore[no-untyped-def]
    """The CPU stage ends inside its worker's soft-shutdown window and hands off; the model
    stage's worker is then killed mid-call. That death is an attempt, not a shutdown's cut-off."""
    server = BedrockServer(delay=10).start()
    try:
        f = fleet(
            MAILPIPE_SOFT_SHUTDOWN_TIMEOUT="8",
            MAILPIPE_MODEL_BACKEND="bedrock",
            AWS_ENDPOINT_URL_BEDROCK_RUNTIME=server.url,
        )
        settings = res.settings
        cpu = f"--queues={email_queue(settings)},{control_queue(settings)}"
        model = ("--pool", "threads", f"--queues={model_queue(settings)}")
        stopping = f.worker("stopping", cpu, REMAP_SIGTERM="SIGQUIT")
        [email_id] = store_emails(res, [email("ends-in-the-window")])
        f.set_fault(email_id, "held", times=1)
        f.enqueue([email_id])
        wait_for(lambda: f.runs(email_id) == 1, 30, "the job to start")
        stopping.signal(signal.SIGTERM)
        f.release(email_id)  # it ends inside the window
        assert stopping.process.wait(30) is not None
        assert f.queue_depth(model_queue(settings)) == 1  # handed off inside the window
        killed = f.worker("model-killed", *model)
        wait_for(lambda: len(server.requests) == 1, 30, "the model call")
        killed.kill()
        f.worker("model", *model)
        assert wait_until_closed(res, [email_id], timeout=120) == {email_id: "succeeded"}
    finally:
        server.stop()
    run = run_of(res, email_id)
    assert (run.attempts, run.cutoffs) == (2, 0)
