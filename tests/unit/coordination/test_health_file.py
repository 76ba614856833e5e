"""The worker's health file: touched by each heartbeat that reached Redis, never by one that did
not, and a file that cannot be touched fails the health check, not the heartbeat."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from redis import Redis, RedisError

from mailpipe.coordination import heartbeat, redis_keys

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def nothing_to_restore(tag: str) -> None:
    raise AssertionError(tag)


def test_each_heartbeat_touches_the_health_file(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    health = tmp_path / "worker.health"
    beat = heartbeat.WorkerHeartbeat(
        res.redis, "h1", interval=1, dead_after=3, restore=nothing_to_restore, health_file=health
    )
    beat.beat()
    assert health.exists()
    old = time.time() - 120
    os.utime(health, (old, old))
    beat.beat()
    assert health.stat().st_mtime > old
    beat.stop(timeout=1)


def test_a_heartbeat_that_cannot_reach_redis_leaves_the_file_to_age(tmp_path: Path) -> None:
    health = tmp_path / "worker.health"
    unreachable = Redis(host="127.0.0.1", port=9, socket_connect_timeout=0.5)
    beat = heartbeat.WorkerHeartbeat(
        unreachable, "h2", interval=1, dead_after=3, restore=nothing_to_restore, health_file=health
    )
    with pytest.raises(RedisError):  # the heartbeat thread logs it and beats again
        beat.beat()
    assert not health.exists()


def test_a_file_that_cannot_be_touched_does_not_stop_the_heartbeat(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    health = tmp_path / "no-such-folder" / "worker.health"
    beat = heartbeat.WorkerHeartbeat(
        res.redis, "h3", interval=1, dead_after=3, restore=nothing_to_restore, health_file=health
    )
    beat.beat()
    beat.beat()
    assert res.redis.zscore(redis_keys.workers(), "h3") is not None
    assert not health.exists()
    beat.stop(timeout=1)
