"""Model calls through real prefork workers, as the model provider sees them.

A `celery worker -P prefork` of the CPU stage hands each email off to `celery worker -P threads`
processes of the model role, which classify with the `bedrock` backend against the local
`converse` server (tests/support/bedrock_server.py) on loopback; the test process stores and
enqueues the emails, as upstream storage does. The fleet-wide limit is checked where it matters,
at the provider: from the times the calls arrived there, not from the limiter's own bookkeeping
(tests/integration/test_ratelimit.py checks the limiter itself, exactly, in Redis time).

The bound for rate r and burst B: every window of length t holds at most B + r*t calls. Calls are
admitted in Redis time and arrive at the server a moment later; that moment varies (a child is
descheduled between admission and sending on a busy machine; 10-22 ms seen here), so the window
check allows `ARRIVAL_JITTER_S` of it: less than the 1/r = 0.33 s that one call over the bound
would take, so a single extra call still fails the check. The in-flight count needs no allowance: the server answers a call strictly
inside the slot its caller holds.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from mailpipe.broker.mailboxes import shards_of
from mailpipe.broker.queues import Lane
from mailpipe.celery import app
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.fleet import CeleryProcess
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.storage import flags
from mailpipe.storage.models import (
    Classification,
    EmailLabel,
    EmailMessage,
    PipelineRun,
    RunStatus,
)
from tests.support.bedrock_server import (
    BedrockServer,
    TimedBedrockServer,
    bedrock_env,
    error,
    invoices,
    throttling,
)
from tests.support.faults import runs_key, set_fault
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

RATE_PER_S = 3.0
BURST = 3
MAX_IN_FLIGHT = 2
# With 0.5 s calls the in-flight cap alone would allow 4 calls/s: both limits bind in turn.
MODEL_DELAY_S = 0.5
ARRIVAL_JITTER_S = 0.25
# How many bulk emails a live one may see classified while it waits for the model (the test).
LIVE_PASSES_BULK = 12


def model_env(
    server: BedrockServer,
    aws_dir: Path,
    rate_per_s: float = RATE_PER_S,
    burst: int = BURST,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> dict[str, str]:
    """The test environment with the `bedrock` backend pointed at `server`."""
    env = dict(os.environ)
    env.update(
        {
            **bedrock_env(server, aws_dir),
            "MAILPIPE_MODEL_RATE_PER_S": str(rate_per_s),
            "MAILPIPE_MODEL_BURST": str(burst),
            "MAILPIPE_MODEL_MAX_IN_FLIGHT": str(max_in_flight),
        }
    )
    env.pop("AWS_PROFILE", None)
    return env


# The hostname of tests/unit/app/test_tasks.py's in-process worker.
IN_PROCESS_WORKER = "in-process@localhost"


@pytest.fixture
def model_fleet(
    res,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> Iterator[Callable[..., TimedBedrockServer]]:
    """`start(workers=, concurrency=, delay=, [rate_per_s=, max_in_flight=])`: a model server answering after `delay`
    seconds and real workers of both lanes using it, all stopped after the test. Model calls are
    switched on once the workers are up (so that no worker's start-up sweep runs first)."""
    # Any other worker on this run's queue (the `rules` backend of the shared one) would take
    # jobs meant for the model: only the ones started here may be running. The in-process
    # worker of tests/unit/app/test_tasks.py, alive for the session in whichever process ran
    # that module, answers the ping too, but consumes a queue of its own alone.
    others = [
        name
        for reply in app.control.ping(timeout=1.0) or []
        for name in reply
        if name != IN_PROCESS_WORKER
    ]
    assert not others, f"workers already consume this run's queue: {others}"
    servers: list[TimedBedrockServer] = []
    processes: list[CeleryProcess] = []

    def start(
        *,
        workers: int,
        concurrency: int,
        delay: float,
        rate_per_s: float = RATE_PER_S,
        max_in_flight: int = MAX_IN_FLIGHT,
        settings: dict[str, str] | None = None,
    ) -> TimedBedrockServer:
        """One worker of the CPU stage, and `workers` of the model role with `concurrency`
        threads each, as the Procfile starts them; `settings`: more of the environment."""
        server = TimedBedrockServer(delay=delay).start()
        servers.append(server)
        env = {**model_env(server, tmp_path, rate_per_s, BURST, max_in_flight), **(settings or {})}
        # The model role reserves one message per thread (Procfile).
        model_role_env = {**env, "MAILPIPE_WORKER_PREFETCH_MULTIPLIER": "1"}
        queue = res.settings.queue
        started = [
            localfleet.worker(
                env,
                tmp_path,
                concurrency=2,
                name="cpu",
                extra_args=(
                    "-Q",
                    f"{queue},{queue}.bulk,{queue}.control",
                    "-I",
                    "tests.support.faults",
                ),
            ).start(),
            *(
                localfleet.worker(
                    model_role_env,
                    tmp_path,
                    concurrency=concurrency,
                    name=f"models-{i}",
                    pool="threads",
                    extra_args=("-Q", f"{queue}.model,{queue}.model.bulk"),
                ).start()
                for i in range(workers)
            ),
        ]
        processes.extend(started)
        for worker in started:
            worker.wait_ready()
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        return server

    yield start
    try:
        for worker in processes:
            assert worker.alive(), f"a worker died during the test:\n{worker.log_tail()}"
    finally:
        for worker in processes:
            worker.stop()
        for server in servers:
            server.stop()


def deferrals(tmp_path: Path) -> int:
    """Jobs deferred by a throttle, from the workers' logs: what the scenario exercised, not what
    the test asserts about its outcome (that is in the database)."""
    return sum(log.read_text().count(" deferred ") for log in tmp_path.glob("models-*.log"))


def runs(res) -> list[PipelineRun]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return list(session.scalars(select(PipelineRun).order_by(PipelineRun.email_id)))


def labelled_emails(res) -> dict[int, set[str]]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        rows = session.execute(
            select(EmailLabel.email_id, EmailLabel.label).where(EmailLabel.source == "model")
        ).all()
    found: dict[int, set[str]] = {}
    for email_id, label in rows:
        found.setdefault(email_id, set()).add(label)
    return found


def classifications(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalar(select(func.count()).select_from(Classification)) or 0


def worst_window_excess(arrivals: list[float]) -> tuple[float, str]:
    """Over every window [a_i, a_j]: the most by which its calls exceed B + r*t, in seconds of
    rate (how much longer the window would have to be to allow them), and which window."""
    worst, where = float("-inf"), ""
    for i, first in enumerate(arrivals):
        for j in range(i, len(arrivals)):
            span = arrivals[j] - first
            excess = (j - i + 1 - BURST) / RATE_PER_S - span
            if excess > worst:
                worst, where = excess, f"{j - i + 1} calls within {span:.3f} s"
    return worst, where


def test_fleet_limit_holds_at_the_provider_and_throttled_jobs_keep_their_attempts(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    n = 60
    # Nine model-stage threads want a call at once: three times the cap.
    server = model_fleet(workers=3, concurrency=3, delay=MODEL_DELAY_S)
    ids = store_emails(res, invoices(n))
    assert len(enqueue_emails(ids, res).sent) == n

    statuses = wait_until_closed(res, ids, timeout=75)

    assert set(statuses.values()) == {"succeeded"}
    assert all(run.attempts == 1 and run.error is None for run in runs(res)), [
        (run.email_id, run.attempts, run.error) for run in runs(res) if run.attempts != 1
    ]
    assert classifications(res) == n
    assert labelled_emails(res) == {email_id: {"invoice"} for email_id in ids}
    # One paid call per email: a deferred job calls again only once it holds a slot.
    arrivals = server.arrivals()
    assert len(arrivals) == n and set(server.statuses()) == {200}

    excess, where = worst_window_excess(arrivals)
    assert excess <= ARRIVAL_JITTER_S, f"{where}: over B + r*t = {BURST} + {RATE_PER_S}*t"
    assert server.peak_in_flight == MAX_IN_FLIGHT  # reached, never passed
    # The limits held the fleet back, and each job waited its turn in its model-stage thread:
    # none was deferred, so none went through the broker again.
    assert deferrals(tmp_path) == 0


def test_a_capped_mailbox_keeps_to_its_ceiling_while_another_mailboxs_emails_finish(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """24 emails of a mailbox capped at 2 calls/s and 16 of an uncapped one, on 8 threads and a
    fleet limit of 20/s: the capped one's calls keep to 1 + r_m * (tau + t) at the provider
    (tau = 1 s, the ceiling's tolerance), its refused jobs wait as deferrals, each about once,
    and the other mailbox's emails are done long before the capped one's."""
    ceiling, flood, quiet = 2.0, 24, 16
    server = model_fleet(
        workers=1,
        concurrency=8,
        delay=0.05,
        rate_per_s=20.0,
        max_in_flight=16,
        settings={"MAILPIPE_MAILBOX_MODEL_RATES": json.dumps({"flood": ceiling})},
    )
    flood_ids = store_emails(res, invoices(flood, subject="Flooded invoice"), mailbox="flood")
    quiet_ids = store_emails(res, invoices(quiet), mailbox="quiet")
    enqueue_emails(flood_ids, res, mailboxes=dict.fromkeys(flood_ids, "flood"))
    enqueue_emails(quiet_ids, res, mailboxes=dict.fromkeys(quiet_ids, "quiet"))

    assert set(wait_until_closed(res, quiet_ids, timeout=60).values()) == {"succeeded"}
    quiet_done = len(server.arrivals_about("Flooded invoice"))
    statuses = wait_until_closed(res, flood_ids, timeout=90)

    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res)} == {1}  # a deferral uses no attempt
    arrivals = server.arrivals_about("Flooded invoice")
    assert len(arrivals) == flood and len(server.arrivals()) == flood + quiet
    burst = 1 + ceiling * 1.0
    for i, first in enumerate(arrivals):
        for j in range(i, len(arrivals)):
            excess = (j - i + 1 - burst) / ceiling - (arrivals[j] - first)
            assert excess <= ARRIVAL_JITTER_S, f"{j - i + 1} calls in {arrivals[j] - first:.3f} s"
    # The other mailbox did not wait for the capped one: it was done with most of those calls
    # still to come (at 2/s, 24 calls take 10.5 s after their burst).
    assert quiet_done <= flood / 2, quiet_done
    # No busy loop: each capped job was deferred to its own slot, in deferrals of at most
    # MAILPIPE_RETRY_BACKOFF_MAX each (the slots reach flood / ceiling = 12 s out), not every
    # half second; and none was counted as an attempt.
    most = math.ceil(flood / ceiling / res.settings.retry_backoff_max) + 1
    per_email = Counter(
        re.findall(
            r"email (\d+): deferred ",
            "".join(log.read_text() for log in tmp_path.glob("models-*.log")),
        )
    )
    assert per_email and max(per_email.values()) <= most, per_email
    assert {int(email_id) for email_id in per_email} <= set(flood_ids)


def test_other_mailboxes_calls_wait_behind_a_few_of_a_flood_s_at_the_model_stage(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """300 emails of one mailbox wait for the model (10 calls/s); 8 other mailboxes' emails
    sent meanwhile are classified before more than a round of the flood's calls: the model
    role's 4 threads take the model queues in turn, each round at most one job of each of the
    flood's two shards and at least one of the 8. Without shards the 8 would wait for the whole
    flood's 30 s of calls."""
    model_fleet(workers=1, concurrency=4, delay=0.1, rate_per_s=10.0, max_in_flight=8)
    flood = store_emails(res, invoices(300, subject="Flooded invoice"), mailbox="flood")
    assert len(enqueue_emails(flood, res, mailboxes=dict.fromkeys(flood, "flood")).sent) == 300

    def flood_classified(by: int | None = None) -> int:
        statement = (
            select(func.count())
            .select_from(PipelineRun)
            .where(PipelineRun.email_id.in_(flood), PipelineRun.status != RunStatus.OPEN)
        )
        if by is not None:
            then = select(PipelineRun.closed_at).where(PipelineRun.email_id == by)
            statement = statement.where(PipelineRun.closed_at <= then.scalar_subquery())
        with res.db.session() as session:
            return int(session.scalar(statement) or 0)

    wait_for(lambda: flood_classified() >= 10, 60, "the flood's calls to be under way")
    both = set(shards_of("flood", 16))
    names = [n for n in (f"customer-{i}" for i in range(40)) if set(shards_of(n, 16)) != both][:8]
    quiet = [store_emails(res, invoices(1), mailbox=name)[0] for name in names]
    before = flood_classified()
    for email_id, name in zip(quiet, names, strict=True):
        enqueue_emails([email_id], res, mailboxes={email_id: name})
    assert set(wait_until_closed(res, quiet, timeout=60).values()) == {"succeeded"}
    waited = max(flood_classified(email_id) - before for email_id in quiet)
    assert waited <= 4 + 2 * len(quiet) + 2, waited
    assert flood_classified() < 250  # the flood was still waiting all along


def test_provider_throttling_defers_the_job_without_using_its_attempts(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    server = model_fleet(workers=1, concurrency=2, delay=0.05)
    # One request per classify call (no botocore retries): 6 throttled calls, more than the run
    # has attempts, and it must still succeed without using one.
    throttled = 6
    server.enqueue(*[throttling(retry_after_ms=200)] * throttled)
    [email_id] = store_emails(res, invoices(1))
    enqueue_emails([email_id], res)

    assert wait_until_closed(res, [email_id], timeout=60) == {email_id: "succeeded"}

    [run] = runs(res)
    assert (run.attempts, run.error) == (1, None)
    assert classifications(res) == 1
    assert labelled_emails(res) == {email_id: {"invoice"}}
    assert server.statuses() == [429] * throttled + [200]
    assert deferrals(tmp_path) == throttled  # one request per slot: each throttle is a deferral


def test_a_request_the_provider_rejects_fails_the_run_at_once(
    res,
    model_fleet,  # type: ignore[no-untyped-def]
) -> None:
    server = model_fleet(workers=1, concurrency=2, delay=0.05)
    server.enqueue(error("ValidationException", 400, "Input is too long for requested model."))
    [email_id] = store_emails(res, invoices(1))
    enqueue_emails([email_id], res)

    assert wait_until_closed(res, [email_id], timeout=30) == {email_id: "failed"}

    [run] = runs(res)
    assert run.attempts == 1
    assert run.error is not None
    # Named by its code: the provider's message may quote the request, which is the email.
    assert run.error.endswith("bedrock rejected the request (ValidationException)")
    assert "Input is too long" not in run.error
    assert server.statuses() == [400]  # not retried by botocore, nor by the task
    assert classifications(res) == 0 and labelled_emails(res) == {}


def test_the_cpu_stage_hands_off_and_only_the_model_role_calls_the_model(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    server = model_fleet(workers=1, concurrency=4, delay=0.05)
    ids = store_emails(res, invoices(8))
    enqueue_emails(ids, res)
    assert set(wait_until_closed(res, ids, timeout=60).values()) == {"succeeded"}
    assert len(server.arrivals()) == 8  # one call each
    cpu, model = (tmp_path / "cpu.log").read_text(), (tmp_path / "models-0.log").read_text()
    # Each stage ran on its own role: the CPU stage handed off, the model role classified.
    assert cpu.count("'handed_off'") == 8 and "Task mailpipe.classify_email[" not in cpu
    assert model.count("'succeeded'") == 8 and "Task mailpipe.process_email[" not in model
    assert {run.attempts for run in runs(res)} == {1}
    assert parses(res, ids) == [1] * 8


def test_model_calls_switched_on_over_a_backlog_parse_no_email_twice(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    server = model_fleet(workers=1, concurrency=8, delay=0.05)
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    ids = store_emails(res, invoices(30))
    enqueue_emails(ids, res)
    # With model calls off every run waits after its CPU stage, its documents and input kept.
    wait_for(lambda: converted(res) == 30, 60, "the CPU stage of every email")
    assert parses(res, ids) == [1] * 30 and server.arrivals() == []
    # Switched on: the sweep it sends re-adds the model stage of each, not the whole job.
    subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "model-calls", "on"],
        env=model_env(server, tmp_path),
        check=True,
        capture_output=True,
    )
    assert set(wait_until_closed(res, ids, timeout=90).values()) == {"succeeded"}
    assert parses(res, ids) == [1] * 30  # no email parsed twice
    assert len(server.arrivals()) == 30  # nor classified twice


def test_an_incidents_switch_sequence_fails_no_waiting_email(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """Ten emails wait with model calls off. An operator runs, four times, `pause model`,
    `model-calls on`, `model-calls off`, `resume model`, then `model-calls on` for good, with
    the CLI on the workers' fleet: every one succeeds, no sweep is counted against any, none is
    marked for review."""
    server = model_fleet(workers=1, concurrency=8, delay=0.05)
    env = model_env(server, tmp_path)

    def mailpipe(*args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "mailpipe.cli.main", *args],
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )

    mailpipe("model-calls", "off")
    ids = store_emails(res, invoices(10))
    enqueue_emails(ids, res)
    wait_for(lambda: converted(res) == 10, 60, "the CPU stage of every email")
    for _ in range(4):
        mailpipe("pause", "model")
        mailpipe("model-calls", "on")
        mailpipe("model-calls", "off")
        mailpipe("resume", "model")
    mailpipe("model-calls", "on")
    assert set(wait_until_closed(res, ids, timeout=90).values()) == {"succeeded"}
    ended = runs(res)
    assert [(run.sweep_count, run.status.value) for run in ended] == [(0, "succeeded")] * 10
    with res.db.session() as session:
        marked = session.scalar(
            select(func.count()).where(
                EmailMessage.id.in_(ids), EmailMessage.needs_review.is_(True)
            )
        )
    assert marked == 0
    assert len(server.arrivals()) == 10  # each classified once


def test_a_crash_between_the_stages_is_recovered_by_the_sweeper_with_the_model_stage(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    server = model_fleet(workers=1, concurrency=4, delay=0.05)
    [email_id] = store_emails(res, invoices(1))
    # The CPU stage's child dies once its documents and the model's input are stored, before the
    # hand-off is sent: the redelivery finds the stage done and stops; the sweep sends the rest.
    set_fault(res.redis, email_id, "die-after-steps", times=1)
    enqueue_emails([email_id], res)
    wait_for(lambda: converted(res) == 1, 60, "the CPU stage")
    subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "sweep"],
        env=model_env(server, tmp_path),
        check=True,
        capture_output=True,
    )
    assert wait_until_closed(res, [email_id], timeout=60) == {email_id: "succeeded"}
    assert parses(res, [email_id]) == [1]
    assert len(server.arrivals()) == 1


def test_the_rate_limit_holds_with_32_threads_in_each_of_two_processes(
    res,
    model_fleet,  # type: ignore[no-untyped-def]
) -> None:
    server = model_fleet(workers=2, concurrency=32, delay=0.3)
    n = 40
    ids = store_emails(res, invoices(n))
    enqueue_emails(ids, res)
    assert set(wait_until_closed(res, ids, timeout=120).values()) == {"succeeded"}
    arrivals = server.arrivals()
    assert len(arrivals) == n
    excess, where = worst_window_excess(arrivals)
    assert excess <= ARRIVAL_JITTER_S, f"{where}: over B + r*t = {BURST} + {RATE_PER_S}*t"
    # 64 threads wanted a call at once; the fleet's cap held.
    assert server.peak_in_flight == MAX_IN_FLIGHT


def converted(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        count = session.scalar(
            select(func.count())
            .select_from(PipelineRun)
            .where(PipelineRun.converted_at.is_not(None))
        )
    return count or 0


def parses(res, email_ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """How often each email's CPU stage reached its steps (the parse), as counted in the CPU
    worker by tests.support.faults."""
    return [int(res.redis.get(runs_key(i)) or 0) for i in email_ids]


def test_live_emails_are_classified_first_through_a_model_bound_backfill(
    res,
    model_fleet,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A backfill waits at the model stage; live emails that arrive meanwhile pass it.

    Between a live email's hand-off to the model stage and its classification, few bulk emails
    are classified: those whose calls were in flight when it arrived (rate x call = 10 x 0.5 s =
    5), those granted while it reached a thread (one thread frees per grant, and it takes live
    first: about a grant, two on a busy machine) and before its first refusal registered it (its
    lease and claim: another grant or two), and bulk's share while it waits behind the other
    live calls (at most 0.1 x 4 + 1 = 1). That is 5 + 2 + 2 + 1 = 10; `LIVE_PASSES_BULK` allows two
    more for the writes after a call. Without the lanes, 32 threads holding bulk jobs stand
    before it in the queue and at the limiter: a live email would wait out about 32 of them.
    """
    rate, threads = 10.0, 16
    server = model_fleet(
        workers=2, concurrency=threads, delay=MODEL_DELAY_S, rate_per_s=rate, max_in_flight=8
    )
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    bulk = store_emails(res, invoices(80), Lane.BULK)
    assert len(enqueue_emails(bulk, res, lane=Lane.BULK).sent) == len(bulk)
    wait_for(lambda: converted(res) == len(bulk), 90, "the CPU stage of the backfill")
    # Switched on: the sweep it sends re-adds each bulk email's model stage in the bulk lane.
    subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "model-calls", "on"],
        env=model_env(server, tmp_path, rate, BURST, 8),
        check=True,
        capture_output=True,
    )
    # Every model thread holds a bulk job before live mail arrives.
    wait_for(lambda: classifications(res) >= 2 * threads, 60, "the backfill under way")
    live = store_emails(res, invoices(4))
    enqueue_emails(live, res)

    assert set(wait_until_closed(res, live + bulk, timeout=120).values()) == {"succeeded"}
    by_email = {run.email_id: run for run in runs(res)}
    bulk_done = sorted(by_email[email_id].classified_at for email_id in bulk)
    for email_id in live:
        run = by_email[email_id]
        passed = [t for t in bulk_done if run.converted_at < t <= run.classified_at]
        assert len(passed) <= LIVE_PASSES_BULK, (
            f"{len(passed)} bulk emails were classified while live email {email_id} waited"
        )
    # The backfill was not done when live mail came: live emails passed it.
    assert max(by_email[i].classified_at for i in live) < bulk_done[-1]
    assert len(server.arrivals()) == len(live) + len(bulk)  # one call each
