"""A rolling deploy on real workers: the previous release and this one side by side.

The previous release is the commit `deploy/previous-release` names, checked out in a git worktree
and installed into a venv of its own (its dependencies are this environment's, which its
pyproject's ranges allow). The database is migrated by this release, as the release task does
before a rollout. Each direction runs a CPU worker and a model worker of each release (the model
stage calls the Bedrock stand-in) on one broker key prefix:

- rollout: the previous release's workers take this release's jobs (both lanes, both stages,
  retries, and deferrals at the fleet's model-call limit); this release's workers start beside
  them while the emails are ingested; the previous release's workers are stopped with SIGTERM,
  started as the task definitions start them (`REMAP_SIGTERM=SIGQUIT`: the soft shutdown);
- rollback: the same with the roles reversed, the previous release on this release's schema.

A third of the emails belong to named mailboxes, half of those sent to their mailbox's shard
queues, which only this release takes. Nothing may fail: no run fails, no task raises, and every
email is done by the deadline (DONE_WITHIN_S). Nothing waits for a sweep in a rollout; in a
rollback, the jobs this release left in its shards wait for the previous release's sweep (run
here as its beat would), and only those: every default mailbox's job runs as it was sent. A wait that times out says how each stopped worker exited,
what each email not closed was doing, and whether its job is in the broker.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from mailpipe.broker.queues import Lane
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.ingest import store_emails
from mailpipe.storage import flags
from mailpipe.storage.models import (
    AttemptOutcome,
    EmailMessage,
    PipelineRun,
    RunAttempt,
    RunStatus,
    SweepReport,
)
from tests.support.bedrock_server import TimedBedrockServer, unlimited_bedrock_env
from tests.support.emails import raw_email
from tests.support.faults import set_fault
from tests.support.paths import REPO
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

EMAILS = 500
RETRIED = 10  # emails of each half whose first attempt fails, so that a release schedules a retry
# Mailboxes in use beside the default one: a third of the emails are theirs, of which half are
# sent with their mailbox (to its shards, which only this release takes) and half without, as
# upstream's `enqueue_email(id)` sends them (to the lane's own queue, which both releases take).
MAILBOXES = ("north", "south", "east")
# A deadline, not a figure, counted once the first release's workers have stopped. On a quiet
# machine the backlog closes a few seconds after the last ingest. It has room for a worker whose
# shutdown hung in Celery until the harness killed it (docs/decisions/worker-shutdown-hangs.md):
# its jobs come back once its heartbeat is MAILPIPE_WORKER_DEAD_AFTER old, then wait a backoff.
DONE_WITHIN_S = 180.0


@dataclass(frozen=True)
class Release:
    name: str
    python: str  # its interpreter
    checkout: Path  # the code `celery -A mailpipe` imports, started from there


THIS = Release("this", sys.executable, REPO)


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    commit = (REPO / "deploy" / "previous-release").read_text().strip()
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True
    )
    if known.returncode != 0:
        pytest.fail(
            f"the previous release {commit} (deploy/previous-release) is not in this clone's "
            "history: fetch it (git fetch --unshallow) to run the rolling-deploy test"
        )
    root = tmp_path_factory.mktemp("previous-release")
    checkout, venv = root / "checkout", root / "venv"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run(
        [*git, "add", "--detach", str(checkout), commit], check=True, capture_output=True
    )
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        # Its dependencies: this environment's (a line of a .pth file goes on sys.path).
        Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(checkout)],
            check=True,
            capture_output=True,
        )
        yield Release("previous", str(python), checkout)
    finally:
        subprocess.run([*git, "remove", "--force", str(checkout)], capture_output=True)


def start(release: Release, env: dict[str, str], logs: Path) -> list[localfleet.CeleryProcess]:
    """The release's CPU worker (both lanes and the sweeps) and model worker, ready."""
    queue = env["MAILPIPE_QUEUE"]
    name = f"{release.name}-{uuid.uuid4().hex[:6]}"
    processes = [
        localfleet.worker(
            env,
            logs,
            name=f"{name}-cpu",
            extra_args=(
                "-I",
                "tests.support.faults",
                f"--queues={queue},{queue}.bulk,{queue}.control",
            ),
        ),
        localfleet.worker(
            env,
            logs,
            name=f"{name}-model",
            pool="threads",
            concurrency=8,
            extra_args=(f"--queues={queue}.model,{queue}.model.bulk",),
        ),
    ]
    for process in processes:
        process.python, process.cwd = release.python, release.checkout
        process.start()
    for process in processes:
        process.wait_ready()
    return processes


def enqueue(
    env: dict[str, str], ids: list[int], lane: Lane, mailboxes: dict[int, str | None] | None
) -> None:
    """This release's deduplicated enqueue, in the fleet's key space; with `mailboxes`, each
    job sent to its mailbox's queue."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from mailpipe.broker.queues import Lane; "
            "from mailpipe.enqueue import enqueue_emails; "
            "boxes = json.loads(sys.argv[2]); ids = [int(a) for a in sys.argv[3:]]; "
            "enqueue_emails(ids, lane=Lane(sys.argv[1]), "
            "mailboxes=None if boxes is None else {i: boxes[str(i)] for i in ids})",
            lane.value,
            json.dumps(mailboxes),
            *map(str, ids),
        ],
        env=env,
        check=True,
    )


def ingest(res, env: dict[str, str], prefix: str, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """`n` emails, half of them in the bulk lane, a third of them in MAILBOXES, RETRIED of them
    failing their first attempt."""
    tag = uuid.uuid4().hex[:8]
    ids = store_emails(
        res,
        [
            raw_email(
                f"Invoice {i}",
                sender=f"billing{i}@acme.example",
                message_id=f"{tag}-{i}@acme.example",
                body=f"Invoice {i}: amount due",
            )
            for i in range(n)
        ],
    )
    bulk = ids[: n // 2]
    boxes: dict[int, str | None] = dict.fromkeys(ids)
    boxes |= {email_id: MAILBOXES[i % len(MAILBOXES)] for i, email_id in enumerate(ids[::3])}
    with res.db.transaction() as session:
        session.execute(update(EmailMessage).where(EmailMessage.id.in_(bulk)).values(lane="bulk"))
        for name in MAILBOXES:
            mine = [email_id for email_id, box in boxes.items() if box == name]
            session.execute(
                update(EmailMessage).where(EmailMessage.id.in_(mine)).values(mailbox=name)
            )
    for email_id in ids[:: n // RETRIED][:RETRIED]:
        set_fault(res.redis, email_id, "transient", 1, prefix=prefix)
    upstream = set(ids[3::6])  # a mailbox's, sent without it
    for lane, mine in ((Lane.BULK, bulk), (Lane.LIVE, ids[n // 2 :])):
        enqueue(env, [i for i in mine if i not in upstream], lane, boxes)
        enqueue(env, [i for i in mine if i in upstream], lane, None)
    return ids


def received(process: localfleet.CeleryProcess) -> int:
    return len(re.findall(r"Task mailpipe\.\w+\[[^\]]+\] received", process.log_path.read_text()))


def raised(processes: list[localfleet.CeleryProcess]) -> list[str]:
    """Every task the workers saw end in an exception: a FAILURE in Flower."""
    lines = []
    for process in processes:
        lines += [
            line
            for line in process.log_path.read_text(errors="replace").splitlines()
            if re.search(r"raised (unexpected|expected)|TypeError", line)
        ]
    return lines


# Run with the fleet's environment: mailpipe reads its key prefix once per process.
BROKER_STATE = """
import json
from mailpipe.broker.layout import emails_in_broker
from mailpipe.broker.queues import job_queues
from mailpipe.coordination import pauses
from mailpipe.resources import get_resources
res = get_resources()
print(json.dumps({
    "paused": {stage: pause.error for stage, pause in pauses.paused(res.redis).items()},
    "in_broker": sorted(emails_in_broker(res.redis, job_queues(res.settings))),
}))
"""


def broker_state(env: dict[str, str]) -> dict[str, Any]:
    """The stages' pauses and the emails with a job in the broker, under the fleet's key prefix:
    read by mailpipe's own functions."""
    done = subprocess.run(
        [sys.executable, "-c", BROKER_STATE], env=env, check=True, capture_output=True, text=True
    )
    return dict(json.loads(done.stdout))


# The previous release's sweep, as its beat sends one every MAILPIPE_SWEEP_INTERVAL: run with its
# interpreter, from its checkout, in the fleet's environment. Prints the emails it re-added.
PREVIOUS_SWEEP = """
import json
from mailpipe.enqueue import enqueue_emails
from mailpipe.operations import sweeper
from mailpipe.resources import get_resources
res = get_resources()
result = sweeper.sweep(res, lambda ids, task, lane: enqueue_emails(ids, res, task, lane).sent)
print(json.dumps(result.readded_ids))
"""


def swept_by(release: Release, env: dict[str, str]) -> list[int]:
    done = subprocess.run(
        [release.python, "-c", PREVIOUS_SWEEP],
        env=env,
        cwd=release.checkout,
        check=True,
        capture_output=True,
        text=True,
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def closed(res, ids: list[int]) -> bool:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        done = session.scalar(
            select(func.count())
            .select_from(PipelineRun)
            .where(PipelineRun.email_id.in_(ids), PipelineRun.status != RunStatus.OPEN)
        )
    return done == len(ids)


def still_open(  # type: ignore[no-untyped-def]
    res, env: dict[str, str], ids: list[int], stops: dict[str, tuple[int | None, float]]
) -> str:
    """What a timed-out wait reports: how the first release's workers stopped (exit code,
    seconds), the stages' pauses, and each email not closed yet (with its run's attempts, if it
    has a run) and whether its job is in the broker."""
    state = broker_state(env)
    in_broker = set(state["in_broker"])
    lines = [f"stopped (exit code, s): {stops}", f"paused: {state['paused']}"]
    with res.db.session() as session:
        runs = {
            run.email_id: run
            for run in session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(ids)))
        }
        waiting = [i for i in ids if i not in runs or runs[i].status is RunStatus.OPEN]
        lines.append(f"{len(waiting)} not closed")
        for email_id in waiting[:20]:
            run = runs.get(email_id)
            if run is None:
                lines.append(f"email {email_id}: no run, in the broker: {email_id in in_broker}")
                continue
            attempts = session.scalars(
                select(RunAttempt).where(RunAttempt.run_id == run.id).order_by(RunAttempt.id)
            ).all()
            lines.append(
                f"email {email_id}: attempts={run.attempts} claims={run.claims} "
                f"converted={run.converted_at is not None} started={run.attempt_started_at} "
                f"updated={run.updated_at} history="
                + ", ".join(f"{a.stage}:{a.outcome}:{a.error_class}" for a in attempts)
                + f", in the broker: {email_id in in_broker}"
            )
    return "\n".join(lines)


def roll(res, first: Release, second: Release, tmp_path: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """`first`'s workers, then `second`'s beside them while the emails come, then `first`'s
    stopped with SIGTERM. Returns the figures the closing note quotes."""
    prefix = f"skew{uuid.uuid4().hex[:8]}:"
    server = TimedBedrockServer()
    server.start()
    processes: list[localfleet.CeleryProcess] = []
    try:
        env = {
            **os.environ,
            **unlimited_bedrock_env(server, tmp_path),
            "MAILPIPE_REDIS_PREFIX": prefix,
            "MAILPIPE_QUEUE": res.settings.queue,
            # As the task definitions start them: ECS's SIGTERM begins the soft shutdown.
            "REMAP_SIGTERM": "SIGQUIT",
            # A fleet limit the backlog outruns, with no wait for a slot: model-stage jobs are
            # deferred, each deferral a message that either release may take.
            "MAILPIPE_MODEL_RATE_PER_S": "60",
            "MAILPIPE_MODEL_BURST": "2",
            "MAILPIPE_MODEL_SLOT_WAIT": "0",
        }
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
            reports_before = session.scalar(select(func.max(SweepReport.id))) or 0
        old = start(first, env, tmp_path)
        processes += old
        ids = ingest(res, env, prefix, EMAILS // 2)
        wait_for(
            lambda: sum(received(p) for p in old) >= 50, 60, f"{first.name}'s workers to take jobs"
        )
        new = start(second, env, tmp_path)
        processes += new
        ids += ingest(res, env, prefix, EMAILS - EMAILS // 2)
        last_ingest = time.monotonic()
        stops = {}
        for process in old:
            began = time.monotonic()
            stops[process.nodename] = (process.stop(), round(time.monotonic() - began, 1))
        late: list[int] = []
        if first is THIS:
            # A sender of this release not rolled back yet: its mailboxes' jobs go to shards
            # that no worker takes now.
            late = store_emails(
                res,
                [
                    raw_email(f"Late {i}", message_id=f"late-{i}-{prefix}@x", body=f"{prefix}{i}")
                    for i in range(6)
                ],
            )
            with res.db.transaction() as session:
                session.execute(
                    update(EmailMessage).where(EmailMessage.id.in_(late)).values(mailbox="north")
                )
            enqueue(env, late, Lane.LIVE, dict.fromkeys(late, "north"))
            ids += late
        try:
            if first is THIS:
                # Rolled back: the jobs this release left in its mailboxes' shards, which the
                # previous release never takes, wait for that release's sweep.
                def swept_and_closed() -> bool:
                    swept_by(second, env)
                    return closed(res, ids)

                wait_for(
                    swept_and_closed,
                    DONE_WITHIN_S,
                    "the previous release's sweeps to close every email",
                    every=2.0,
                )
            statuses = wait_until_closed(res, ids, timeout=DONE_WITHIN_S)
        except AssertionError as timeout:
            raise AssertionError(f"{timeout}\n{still_open(res, env, ids, stops)}") from None
        done_after = time.monotonic() - last_ingest
        for process in new:
            process.stop()
    finally:
        for process in processes:
            process.stop()
        server.stop()

    assert set(statuses.values()) == {"succeeded"}
    assert raised(processes) == []
    with res.db.session() as session:
        runs = session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(ids))).all()
        reports = session.scalars(select(SweepReport).where(SweepReport.id > reports_before)).all()
        retried, deferred = (
            session.scalar(
                select(func.count())
                .select_from(RunAttempt)
                .where(RunAttempt.email_id.in_(ids), RunAttempt.outcome == outcome)
            )
            for outcome in (AttemptOutcome.RETRYING, AttemptOutcome.DEFERRED)
        )
        named = set(
            session.scalars(
                select(EmailMessage.id).where(
                    EmailMessage.id.in_(ids), EmailMessage.mailbox.is_not(None)
                )
            )
        )
    swept = {run.email_id for run in runs if run.sweep_count}
    readded = sum(r.readded_no_run + r.readded_stalled for r in reports)
    if first is THIS:
        # Only the named mailboxes' jobs were in shards; every default mailbox's job ran as sent.
        assert set(late) <= swept <= named, (len(swept), len(swept - named))
        assert readded >= len(swept)
    else:
        assert (swept, readded) == (set(), 0)
    # The retries ran, and passed (a run's own count restarts at the model stage: its history).
    assert retried >= 2 * RETRIED
    assert deferred > 0  # the deferrals ran too
    # Each release took jobs at both stages, the first of them the second release's too.
    taken = {p.nodename: received(p) for p in processes}
    assert all(taken.values()), taken
    return {
        "emails": len(ids),
        "retried": retried,
        "deferred": deferred,
        "done_after_last_ingest_s": round(done_after, 1),
        "swept": len(swept),
        **taken,
    }


def test_the_previous_release_takes_this_releases_jobs_during_a_rollout(  # type: ignore[no-untyped-def]
    res, previous: Release, tmp_path: Path
) -> None:
    figures = roll(res, previous, THIS, tmp_path)
    print("rollout:", figures)


def test_a_rollback_runs_the_previous_release_on_this_releases_schema(  # type: ignore[no-untyped-def]
    res, previous: Release, tmp_path: Path
) -> None:
    figures = roll(res, THIS, previous, tmp_path)
    print("rollback:", figures)
