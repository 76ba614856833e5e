"""Real `celery beat` subprocesses: one active scheduler, takeover, and recovery after a flush."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.storage import flags
from mailpipe.storage.models import Classification, EmailMessage, PipelineRun
from tests.support.emails import raw_email
from tests.support.fleet import waiting_in
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

SWEEP_INTERVAL = 2
LOCK_TIMEOUT = 6


def fleet_env(**extra: str) -> dict[str, str]:
    """Its own Redis key prefix: the session's shared worker never sees these jobs."""
    env = dict(os.environ)
    env["MAILPIPE_REDIS_PREFIX"] = f"fleet{uuid.uuid4().hex[:8]}:"
    env["MAILPIPE_SWEEP_INTERVAL"] = str(SWEEP_INTERVAL)
    env["MAILPIPE_BEAT_LOCK_TIMEOUT"] = str(LOCK_TIMEOUT)
    env.update(extra)
    return env


HOLDING = "beat: holding the scheduler lock"


def test_two_beats_fire_each_sweep_once_and_the_standby_takes_over(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = fleet_env()
    control = env["MAILPIPE_REDIS_PREFIX"] + "mailpipe.control"
    lock = env["MAILPIPE_REDIS_PREFIX"] + "mailpipe:beat:lock"
    beats = [localfleet.beat(env, tmp_path, name).start() for name in ("beat-a", "beat-b")]
    try:
        wait_for(lambda: res.redis.exists(lock), 30, "a beat to take the lock")
        start, sent_before = time.monotonic(), res.redis.llen(control)
        wait_for(lambda: res.redis.llen(control) - sent_before >= 3, 60, "three sweeps")
        elapsed, sent = time.monotonic() - start, res.redis.llen(control) - sent_before
        # One schedule fires: at most one sweep per interval (plus one at a boundary), not two. A
        # lower bound on the time between sweeps, which beat keeps however late it runs.
        assert sent <= elapsed / SWEEP_INTERVAL + 1, (sent, elapsed)

        [active] = [b for b in beats if HOLDING in b.log_path.read_text()]
        [standby] = [b for b in beats if b is not active]
        held_by_the_killed = res.redis.get(lock)
        active.kill()
        sent_at_kill = res.redis.llen(control)

        def standby_fired() -> bool:
            # Read in this order, a sweep seen while the killed beat's lock still stands was sent
            # before it lapsed: the standby waits for the lock, not for a guess at its holder.
            fired = res.redis.llen(control) > sent_at_kill
            assert not (fired and res.redis.get(lock) == held_by_the_killed)
            return fired

        wait_for(standby_fired, 60, "the standby to take the lock and fire")
        assert HOLDING in standby.log_path.read_text()
    finally:
        for beat in beats:
            beat.stop()


def test_flush_while_200_emails_wait_then_each_is_processed_once(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = fleet_env()
    prefix = env["MAILPIPE_REDIS_PREFIX"]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    folder = tmp_path / "inbox"
    folder.mkdir()
    for i in range(200):
        (folder / f"{i:03}.eml").write_bytes(
            raw_email(f"Invoice {i}", message_id=f"f{i}@x", body=f"Amount due {i}")
        )
    ingest = subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "ingest", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "stored 200, enqueued 200" in ingest.stdout
    assert waiting_in(res.redis, prefix, "mailpipe", res.settings) == 200

    for key in res.redis.scan_iter(match=prefix + "*"):  # Redis restarted without persistence
        res.redis.delete(key)

    worker = localfleet.worker(env, tmp_path, name="flush-worker").start()
    beat = localfleet.beat(env, tmp_path).start()
    try:
        worker.wait_ready()
        with res.db.session() as session:
            ids = list(session.scalars(select(EmailMessage.id)))
        statuses = wait_until_closed(res, ids, timeout=180)
    finally:
        beat.stop()
        worker.stop()
    assert len(ids) == 200 and set(statuses.values()) == {"succeeded"}
    with res.db.session() as session:
        assert set(session.scalars(select(PipelineRun.attempts))) == {1}  # each processed once
        assert set(session.scalars(select(PipelineRun.sweep_count))) == {1}  # re-added once
        assert session.scalar(select(func.count()).select_from(Classification)) == 200
