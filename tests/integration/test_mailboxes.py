"""Mailboxes share a stage fairly, on a real prefork worker (mailpipe.broker.mailboxes,
docs/mailboxes.md).

The worker is started as the worker role is, with the CPU stage's lane queues named and nothing
of their shards, which it consumes all the same. Concurrency 2 and the default prefetch
multiplier: it holds at most 4 messages whose order the queue order no longer decides. Emails
are small and plain, classified by the `rules` classifier in the CPU stage, so a run closes with
its one job.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane, Stage, control_queue, shard_queue, stage_queue
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.fleet import CeleryProcess
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_email, enqueue_emails
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus
from tests.support.emails import raw_email
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

CONCURRENCY = 2
RESERVED = CONCURRENCY * 2  # the default prefetch multiplier
FLOOD = "flood"


def plain_emails(count: int) -> list[bytes]:
    tag = uuid.uuid4().hex[:8]  # distinct emails, not copies of one another
    return [
        raw_email("mailboxes", to="b@example.org", message_id=f"{tag}.{n}@example.org")
        for n in range(count)
    ]


def quiet_mailboxes(count: int) -> list[str]:
    """Mailboxes that share at most one shard with the flood's two: the 1 in C(16, 2) that
    shares both waits behind the flood's part of them (docs/decisions/mailbox-fairness.md)."""
    flood = set(mailboxes.shards_of(FLOOD, 16))
    names = (f"customer-{i}" for i in itertools.count())
    return list(
        itertools.islice((n for n in names if set(mailboxes.shards_of(n, 16)) != flood), count)
    )


def flood_closed(res, email_id: int | None = None) -> int:  # type: ignore[no-untyped-def]
    """The flood's runs closed by now, or by when `email_id`'s run closed."""
    statement = (
        select(func.count())
        .select_from(PipelineRun)
        .join(EmailMessage, EmailMessage.id == PipelineRun.email_id)
        .where(EmailMessage.mailbox == FLOOD, PipelineRun.status != RunStatus.OPEN)
    )
    if email_id is not None:
        then = select(PipelineRun.closed_at).where(PipelineRun.email_id == email_id)
        statement = statement.where(PipelineRun.closed_at <= then.scalar_subquery())
    with res.db.session() as session:
        return int(session.scalar(statement) or 0)


def flood(res, count: int) -> list[int]:  # type: ignore[no-untyped-def]
    ids = store_emails(res, plain_emails(count), mailbox=FLOOD)
    sent = enqueue_emails(ids, res, mailboxes=dict.fromkeys(ids, FLOOD)).sent
    assert len(sent) == count
    return ids


@pytest.fixture
def worker(res, tmp_path: Path) -> Iterator[CeleryProcess]:  # type: ignore[no-untyped-def]
    """Starts a worker on the CPU stage's lane queues and the control queue when called."""
    started: list[CeleryProcess] = []
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)  # the rules classifier closes runs in the CPU stage
    queues = [
        stage_queue(Stage.CPU, res.settings, Lane.LIVE),
        stage_queue(Stage.CPU, res.settings, Lane.BULK),
        control_queue(res.settings),
    ]

    def start() -> CeleryProcess:
        process = localfleet.worker(
            dict(os.environ),
            tmp_path,
            concurrency=CONCURRENCY,
            name=f"mailboxes-{uuid.uuid4().hex[:6]}",
            extra_args=(f"--queues={','.join(queues)}",),
        ).start()
        started.append(process)
        process.wait_ready()
        return process

    yield start  # type: ignore[misc]
    for process in started:
        process.stop()


def test_other_mailboxes_mail_waits_behind_a_few_of_a_flood_s_jobs_not_its_backlog(
    res, worker
) -> None:  # type: ignore[no-untyped-def]
    """20 mailboxes' emails sent while 2,000 of one mailbox's wait: each closes before more than
    a round of the flood's jobs has closed since it was sent.

    Each round of the lane's shards takes at most one job of each of the flood's two shards and
    at least one of the 20 emails, so the last of them waits behind at most 2 x 20 of the
    flood's jobs, and the RESERVED the worker held when they came. Half are sent as upstream
    sends them (`enqueue_email(id)`, the mailbox read from the row), half with their mailbox.
    Without shards the worker would close nearly the whole flood first.
    """
    flood(res, 2000)
    worker()
    wait_for(lambda: flood_closed(res) >= 20, what="the flood to be under way")

    names = quiet_mailboxes(20)
    quiet = [store_emails(res, plain_emails(1), mailbox=name)[0] for name in names]
    before = flood_closed(res)
    for email_id in quiet[:10]:
        assert enqueue_email(email_id)
    for email_id, name in zip(quiet[10:], names[10:], strict=True):
        assert enqueue_email(email_id, mailbox=name)
    assert set(wait_until_closed(res, quiet).values()) == {"succeeded"}
    waited = {email_id: flood_closed(res, email_id) - before for email_id in quiet}
    assert max(waited.values()) <= RESERVED + 2 * len(quiet) + 2, waited
    assert flood_closed(res) < 2000 - 500  # the flood was still waiting all along


def test_a_thousand_mailboxes_beside_a_flood_take_the_stage_while_the_flood_goes_on(
    res, worker
) -> None:  # type: ignore[no-untyped-def]
    """1,000 mailboxes with one email each, sent while a flood waits, close while the flood
    gets at most its two shards' turns out of the 16; then the flood alone takes every job."""
    flooded = flood(res, 1500)
    names = [f"user-{i}" for i in range(1000)]
    ids = store_emails(res, plain_emails(1000))
    with res.db.transaction() as session:
        for email_id, name in zip(ids, names, strict=True):
            session.execute(
                EmailMessage.__table__.update()
                .where(EmailMessage.id == email_id)
                .values(mailbox=name)
            )
    assert len(enqueue_emails(ids, res, mailboxes=dict(zip(ids, names, strict=True))).sent) == 1000
    worker()
    wait_until_closed(res, ids, timeout=300)
    # The 1 in C(16, 2) that share both of the flood's shards wait behind its part of them.
    flood_shards = set(mailboxes.shards_of(FLOOD, 16))
    apart = [
        i
        for i, n in zip(ids, names, strict=True)
        if set(mailboxes.shards_of(n, 16)) != flood_shards
    ]
    assert len(ids) - len(apart) < 30
    flood_meanwhile = max(flood_closed(res, email_id) for email_id in apart)
    # 1,000 jobs in (about) 16 shards, the flood's 1,500 in 2 of them: a round takes 2 of the
    # flood's and up to 16 others. Shards that hold more of the 1,000 last longer, so allow
    # twice the even share.
    assert flood_meanwhile <= 2 * 1000 * 2 / 14, flood_meanwhile
    # Work-conserving: the flood alone then runs on, to its end.
    assert set(wait_until_closed(res, flooded, timeout=300).values()) == {"succeeded"}


def test_a_flood_sent_without_its_mailbox_holds_up_no_mailbox_sent_with_its_own(
    res, worker
) -> None:  # type: ignore[no-untyped-def]
    """Upstream's `enqueue_email(id)` names no mailbox: a flood sent so waits in the lane's own
    queue, the default mailbox's, which takes one turn in a round; mailboxes sent with theirs
    take their shards' turns, not the flood's backlog's, and every flood email runs once."""
    ids = store_emails(res, plain_emails(600), mailbox=FLOOD)
    assert len(enqueue_emails(ids, res).sent) == 600  # no mailboxes: the lane's own queue
    worker()
    wait_for(lambda: flood_closed(res) >= 10, what="the flood to be under way")
    names = quiet_mailboxes(10)
    quiet = [store_emails(res, plain_emails(1), mailbox=name)[0] for name in names]
    before = flood_closed(res)
    for email_id, name in zip(quiet, names, strict=True):
        assert enqueue_email(email_id, mailbox=name)
    assert set(wait_until_closed(res, quiet).values()) == {"succeeded"}
    waited = max(flood_closed(res, email_id) - before for email_id in quiet)
    assert waited <= RESERVED + 2 * len(quiet) + 2, waited
    assert set(wait_until_closed(res, ids, timeout=300).values()) == {"succeeded"}
    with res.db.session() as session:
        attempts = session.scalars(
            select(PipelineRun.attempts).where(PipelineRun.email_id.in_(ids))
        ).all()
    assert set(attempts) == {1}


def assert_in_their_shards(res, f, where: dict[int, str], bulk: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Each of `where`'s emails has one job in the broker, in one of its mailbox's two shards of
    its lane's CPU queue, its message naming the mailbox and the lane."""
    jobs: dict[int, tuple[str, dict[str, object]]] = {}
    for lane in Lane:
        jobs |= f.placed(stage_queue(Stage.CPU, res.settings, lane))
    assert set(jobs) >= set(where), set(where) - set(jobs)
    for email_id, name in where.items():
        lane = Lane.BULK if email_id in bulk else Lane.LIVE
        queue = stage_queue(Stage.CPU, res.settings, lane)
        shards = {shard_queue(queue, i) for i in mailboxes.shards_of(name, 16)}
        placed, kwargs = jobs[email_id]
        assert placed in shards, (email_id, placed, shards)
        assert (kwargs["mailbox"], kwargs["lane"]) == (name, lane.value), kwargs


def test_a_sweep_after_a_worker_s_sigkill_sends_each_lost_job_to_its_mailbox_and_lane(
    res, fleet
) -> None:  # type: ignore[no-untyped-def]
    """A flood's worker SIGKILLed, and every job in the broker lost with it (a failed-over
    Redis): the sweeps send each email's job back to its mailbox's shards in its lane, and the
    quiet mailboxes' emails, live and bulk, re-added beside the flood's, wait behind a round of
    it, not its backlog."""
    f = fleet()
    queues = [stage_queue(Stage.CPU, res.settings, lane) for lane in Lane]
    cpu = f"--queues={','.join([*queues, control_queue(res.settings)])}"
    flooded = store_emails(res, plain_emails(400), mailbox=FLOOD)
    where = dict.fromkeys(flooded, FLOOD)
    assert sorted(f.sweep()["readded_ids"]) == sorted(flooded)  # no run yet: sent, as lost
    assert_in_their_shards(res, f, where, [])

    killed = f.worker("killed", cpu)
    wait_for(lambda: flood_closed(res) >= 20, what="the flood to be under way")
    names = quiet_mailboxes(15)
    quiet = [store_emails(res, plain_emails(1), mailbox=name)[0] for name in names]
    bulk = quiet[10:]
    with res.db.transaction() as session:
        session.execute(update(EmailMessage).where(EmailMessage.id.in_(bulk)).values(lane="bulk"))
    killed.kill()
    f.lose_jobs()

    with res.db.session() as session:
        closed = set(
            session.scalars(
                select(PipelineRun.email_id).where(PipelineRun.status != RunStatus.OPEN)
            )
        )
    where = {i: n for i, n in where.items() if i not in closed} | dict(
        zip(quiet, names, strict=True)
    )
    readded: set[int] = set()

    def all_readded() -> bool:  # the killed worker's leases lapse first (MAILPIPE_LEASE_TTL)
        readded.update(f.sweep()["readded_ids"])
        return readded >= set(where)

    wait_for(all_readded, 60, "the sweeps to re-add every lost job")
    assert readded == set(where)
    assert_in_their_shards(res, f, where, bulk)

    before = flood_closed(res)
    f.worker("after", cpu)
    live = quiet[:10]
    assert set(wait_until_closed(res, live).values()) == {"succeeded"}
    waited = max(flood_closed(res, email_id) - before for email_id in live)
    assert waited <= RESERVED + 2 * len(live) + 2, waited
    assert set(wait_until_closed(res, list(where), timeout=300).values()) == {"succeeded"}
