"""Worker heartbeats and the recovery of a dead worker's messages, against the real Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import kombu.transport.redis
import pytest

from mailpipe.broker import layout
from mailpipe.celery import app
from mailpipe.coordination import heartbeat, redis_keys
from mailpipe.enqueue import send_job
from tests.support.waits import wait_for

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

_time = time.time


class Delivered:
    """Messages taken from the email queue as a worker takes them, unacknowledged."""

    def __init__(self, res, count: int) -> None:  # type: ignore[no-untyped-def]
        self.redis = res.redis
        for email_id in range(1, count + 1):
            send_job(email_id)
        self.connection = app.connection_for_write()
        self.channel = self.connection.default_channel
        queue = app.amqp.queues[res.settings.queue](self.channel)
        self.messages = [queue.get(no_ack=False) for _ in range(count)]

    @property
    def tags(self) -> list[str]:
        return [m.delivery_tag for m in self.messages]

    def restore(self, tag: str) -> None:
        self.channel.qos.restore_by_tag(tag)

    def holder(
        self, worker_id: str, interval: float, dead_after: float
    ) -> heartbeat.WorkerHeartbeat:
        """The heartbeat of a worker that received every one of these messages."""
        worker = heartbeat.WorkerHeartbeat(
            self.redis, worker_id, interval=interval, dead_after=dead_after, restore=self.restore
        )
        for tag in self.tags:
            worker.received(tag)
        return worker

    def close(self) -> None:
        self.connection.release()


@contextmanager
def host_clock(monkeypatch: pytest.MonkeyPatch, offset: float) -> Iterator[None]:
    """This process as a host whose wall clock is `offset` seconds off Redis's: `time.time`, and
    the name kombu's Redis transport imported it under to score the deliveries it files."""

    def skewed() -> float:
        return _time() + offset

    with monkeypatch.context() as patch:
        patch.setattr(time, "time", skewed)
        patch.setattr(kombu.transport.redis, "time", skewed)
        yield


def wait_for_redis_time(res, at: float) -> None:  # type: ignore[no-untyped-def]
    wait_for(lambda: heartbeat.redis_time(res.redis) > at, 30, f"Redis's clock to pass {at}")


def orphans_of_a_dead_worker(res, count: int, dead_after: float) -> Delivered:  # type: ignore[no-untyped-def]
    """`count` delivered messages named by a worker that beat once, `dead_after` seconds ago."""
    delivered = Delivered(res, count)
    delivered.holder("dead", dead_after / 3, dead_after).beat()
    wait_for_redis_time(res, float(res.redis.zscore(redis_keys.workers(), "dead")) + dead_after)
    return delivered


def test_a_beat_records_the_worker_and_the_messages_it_still_holds(res) -> None:  # type: ignore[no-untyped-def]
    delivered = Delivered(res, 3)
    try:
        beat = delivered.holder("w1", interval=1, dead_after=3)
        delivered.messages[0].ack()
        beat.beat()
        held = {t.decode() for t in res.redis.smembers(redis_keys.worker_held("w1"))}
        assert held == set(delivered.tags[1:])  # the acknowledged one is dropped
        assert heartbeat.live_workers(res.redis, dead_after=3) == 1
        beat.stop(timeout=1)
        assert heartbeat.live_workers(res.redis, dead_after=3) == 0
    finally:
        delivered.close()


def test_workers_are_counted_per_queue_they_consume_now(res) -> None:  # type: ignore[no-untyped-def]
    consumed = {"cpu": ["mailpipe", "mailpipe.control"], "io": ["mailpipe.model"]}

    def beat(name: str) -> heartbeat.WorkerHeartbeat:
        return heartbeat.WorkerHeartbeat(
            res.redis, name, interval=1, dead_after=3, restore=print, queues=lambda: consumed[name]
        )

    cpu, io = beat("cpu"), beat("io")
    cpu.beat()
    io.beat()

    def live() -> dict[str, int]:
        return {
            q: heartbeat.live_workers(res.redis, 3, q)
            for q in ("mailpipe", "mailpipe.model", "mailpipe.control")
        }

    assert live() == {"mailpipe": 1, "mailpipe.model": 1, "mailpipe.control": 1}
    assert heartbeat.live_workers(res.redis, 3) == 2
    consumed["io"] = ["mailpipe.model", "mailpipe"]  # told to add a queue
    consumed["cpu"] = ["mailpipe.control"]  # told to cancel one
    cpu.beat()
    io.beat()
    assert live() == {"mailpipe": 1, "mailpipe.model": 1, "mailpipe.control": 1}
    assert res.redis.zscore(redis_keys.workers_on("mailpipe"), "cpu") is None
    # Over several queues, a worker consuming more than one of them counts once.
    assert heartbeat.live_workers(res.redis, 3, "mailpipe", "mailpipe.model") == 1
    assert heartbeat.live_workers(res.redis, 3, "mailpipe", "mailpipe.control") == 2
    io.stop(timeout=1)
    assert live() == {"mailpipe": 0, "mailpipe.model": 0, "mailpipe.control": 1}
    cpu.stop(timeout=1)
    assert live() == {"mailpipe": 0, "mailpipe.model": 0, "mailpipe.control": 0}


def test_messages_no_live_worker_holds_go_back_and_held_ones_stay(res) -> None:  # type: ignore[no-untyped-def]
    delivered = Delivered(res, 4)
    try:
        alive = heartbeat.WorkerHeartbeat(
            res.redis, "alive", interval=1, dead_after=3, restore=delivered.restore
        )
        dead = heartbeat.WorkerHeartbeat(
            res.redis, "dead", interval=1, dead_after=3, restore=delivered.restore
        )
        alive.received(delivered.tags[0])
        for tag in delivered.tags[1:3]:
            dead.received(tag)
        # tags[3]: a message whose worker died before its first heartbeat named it.
        alive.beat()
        dead.beat()
        # Too young to judge: nothing is put back while a worker may still report it.
        assert heartbeat.recover_orphans(res.redis, 3, delivered.restore).restored == []
        wait_for_redis_time(res, heartbeat.redis_time(res.redis) + 3)
        alive.beat()  # "dead" stops beating
        restored = heartbeat.recover_orphans(res.redis, 3, delivered.restore).restored
        assert sorted(restored) == sorted(delivered.tags[1:])
        assert res.redis.hkeys(layout.unacked_key()) == [delivered.tags[0].encode()]
        assert layout.queue_stats(res.redis, res.settings.queue).depth == 3
        assert [w.decode() for w in res.redis.zrange(redis_keys.workers(), 0, -1)] == ["alive"]
    finally:
        delivered.close()


def test_one_worker_recovers_at_a_time(res) -> None:  # type: ignore[no-untyped-def]
    # dead_after is long, so that the pass held up below stays well inside its time budget; the
    # dead worker's last beat is put that far back rather than waited for.
    dead_after = 60.0
    delivered = Delivered(res, 3)
    delivered.holder("dead", dead_after / 3, dead_after).beat()
    last_beat = heartbeat.redis_time(res.redis) - dead_after - 1
    res.redis.zadd(redis_keys.workers(), {"dead": last_beat})
    restores: list[tuple[str, str]] = []
    in_pass, go_on = threading.Event(), threading.Event()

    def restore_as(worker_id: str) -> Callable[[str], None]:
        def restore(tag: str) -> None:
            restores.append((worker_id, tag))
            if worker_id == "first":  # held up before its first restore, until the other tried
                in_pass.set()
                go_on.wait(30)
            delivered.restore(tag)

        return restore

    first, second = (
        heartbeat.WorkerHeartbeat(
            res.redis, worker_id, interval=1, dead_after=dead_after, restore=restore_as(worker_id)
        )
        for worker_id in ("first", "second")
    )
    passes: list[heartbeat.Recovery | None] = []
    first_pass = threading.Thread(target=lambda: passes.append(first.recover()))
    first_pass.start()
    try:
        wait_for(in_pass.is_set, 30, "the first pass to reach the dead worker's messages")
        assert second.recover() is None
    finally:
        go_on.set()
        first_pass.join(30)
        delivered.close()
    [recovery] = passes
    assert recovery is not None
    assert (sorted(recovery.restored), recovery.left) == (sorted(delivered.tags), 0)
    assert sorted(restores) == sorted(("first", tag) for tag in delivered.tags)
    assert layout.queue_stats(res.redis, res.settings.queue).depth == 3
    assert not res.redis.exists(redis_keys.reaper_lock())


def test_a_worker_whose_clock_runs_behind_keeps_its_messages(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The process plays two hosts in turn: a worker whose clock runs 60 s behind, which kombu
    # delivers messages to (scoring them with that clock), and one with a right clock that looks
    # for orphans between its beats.
    with host_clock(monkeypatch, -60):
        delivered = Delivered(res, 2)
    try:
        behind = delivered.holder("behind", interval=0.3, dead_after=1)
        # The first look comes before the first beat names the messages: kombu's index says
        # they were delivered a minute ago, which must not make them anyone's to take.
        until = heartbeat.redis_time(res.redis) + 3  # three times dead_after
        while heartbeat.redis_time(res.redis) < until:
            assert heartbeat.recover_orphans(res.redis, 1, delivered.restore).restored == []
            with host_clock(monkeypatch, -60):
                behind.beat()
            assert heartbeat.live_workers(res.redis, 1) == 1
            wait_for_redis_time(res, heartbeat.redis_time(res.redis) + 0.3)
        assert sorted(layout.delivered(res.redis)) == sorted(delivered.tags)
    finally:
        delivered.close()


def test_a_dead_worker_whose_clock_ran_ahead_is_found_dead_in_time(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dead_after = 1.0
    with host_clock(monkeypatch, 60):
        delivered = Delivered(res, 2)
        delivered.holder("ahead", dead_after / 3, dead_after).beat()  # its last
    try:
        # Its messages are scored a minute ahead in kombu's index; its heartbeat is on Redis's
        # clock. The first look once that clock is dead_after past the last beat puts them back,
        # not one a minute later.
        last_beat = float(res.redis.zscore(redis_keys.workers(), "ahead"))
        wait_for_redis_time(res, last_beat + dead_after)
        restored = heartbeat.recover_orphans(res.redis, dead_after, delivered.restore).restored
        assert sorted(restored) == sorted(delivered.tags)
        assert heartbeat.live_workers(res.redis, dead_after) == 0
        assert layout.queue_stats(res.redis, res.settings.queue).depth == 2
    finally:
        delivered.close()


def test_beats_go_on_while_a_recovery_pass_is_stuck(res) -> None:  # type: ignore[no-untyped-def]
    dead_after, interval = 0.8, 0.2
    delivered = Delivered(res, 1)  # no worker names it: an orphan once dead_after has passed
    stuck, unstick = threading.Event(), threading.Event()

    def slow_restore(tag: str) -> None:
        stuck.set()
        unstick.wait(30)
        delivered.restore(tag)

    worker = heartbeat.WorkerHeartbeat(
        res.redis, "w", interval=interval, dead_after=dead_after, restore=slow_restore
    )

    def last_beat() -> float:
        return float(res.redis.zscore(redis_keys.workers(), "w") or 0)

    worker.start()
    try:
        wait_for(stuck.is_set, 30, "the recovery to reach the orphan")
        first = last_beat()
        # Beyond dead_after: a worker whose beats waited for its recovery would be taken for dead.
        wait_for(
            lambda: last_beat() > first + dead_after + interval, 30, "beats during the recovery"
        )
        assert res.redis.hlen(layout.unacked_key()) == 1  # the pass is still stuck
        assert heartbeat.live_workers(res.redis, dead_after) == 1
        unstick.set()
        wait_for(lambda: res.redis.hlen(layout.unacked_key()) == 0, 30, "the orphan to go back")
        assert layout.queue_stats(res.redis, res.settings.queue).depth == 1
    finally:
        unstick.set()
        worker.stop(timeout=1)
        delivered.close()


def test_a_pass_puts_back_at_most_its_bound_and_the_next_the_rest(res) -> None:  # type: ignore[no-untyped-def]
    delivered = orphans_of_a_dead_worker(res, 5, dead_after=0.5)
    try:
        first = heartbeat.recover_orphans(res.redis, 0.5, delivered.restore, max_restored=3)
        assert (len(first.restored), first.left) == (3, 2)
        assert len(layout.delivered(res.redis)) == 2
        # The dead worker is forgotten: the rest are known from the first pass's record.
        assert res.redis.zcard(redis_keys.workers()) == 0
        second = heartbeat.recover_orphans(res.redis, 0.5, delivered.restore, max_restored=3)
        assert (len(second.restored), second.left) == (2, 0)
        assert sorted(first.restored + second.restored) == sorted(delivered.tags)
        assert layout.queue_stats(res.redis, res.settings.queue).depth == 5
    finally:
        delivered.close()


def test_a_pass_stops_at_its_time_budget_and_the_next_goes_on(res) -> None:  # type: ignore[no-untyped-def]
    delivered = orphans_of_a_dead_worker(res, 5, dead_after=0.5)
    budget = heartbeat.recovery_budget(0.5)
    clock = [0.0]

    def slow_restore(tag: str) -> None:  # each restore takes 40% of the budget
        delivered.restore(tag)
        clock[0] += budget * 0.4

    try:
        first = heartbeat.recover_orphans(res.redis, 0.5, slow_restore, clock=lambda: clock[0])
        assert (len(first.restored), first.left) == (3, 2)
        second = heartbeat.recover_orphans(res.redis, 0.5, delivered.restore)
        assert (len(second.restored), second.left) == (2, 0)
        assert layout.queue_stats(res.redis, res.settings.queue).depth == 5
    finally:
        delivered.close()


def test_workers_are_counted_per_release_until_the_last_of_one_leaves(res) -> None:  # type: ignore[no-untyped-def]
    """A rolling deploy half done: two releases side by side, then the old one gone."""
    beats = [
        heartbeat.WorkerHeartbeat(
            res.redis, name, interval=1, dead_after=3, restore=lambda tag: None, version=version
        )
        for name, version in (("old-1", "0.1.0"), ("old-2", "0.1.0"), ("new-1", "0.2.0"))
    ]
    for beat in beats:
        beat.beat()
    assert heartbeat.live_versions(res.redis, dead_after=3) == {"0.1.0": 2, "0.2.0": 1}
    for beat in beats[:2]:
        beat.stop(timeout=1)
    assert heartbeat.live_versions(res.redis, dead_after=3) == {"0.2.0": 1}
    assert res.redis.smembers(redis_keys.worker_versions()) == {b"0.2.0"}
