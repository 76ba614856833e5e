"""Fault injection for the crash, shutdown and chaos tests.

Loaded into a real worker with ``celery -A mailpipe worker -I tests.support.faults``, it wraps
the pipeline's steps (after the lease is taken and the attempt is counted, where a crash in a
parser would happen) so that an email whose id has a fault set in Redis misbehaves:

- ``exit``: ``os._exit(1)``; ``sigkill``: SIGKILL to itself; ``segfault``: a NULL read through
  ctypes; ``memory``: allocation past an address-space limit set for the child;
- ``slow:SECONDS``: sleeps, then runs the real steps (a slow but healthy job).

A fault can be limited to its first N deliveries (``times``). Every delivery that reaches the
steps is counted under ``runs_key`` and its start time kept under ``starts_key``, so tests can
tell how often and when the steps really ran.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time

from redis import Redis

from mailpipe import redis_keys
from mailpipe.pipeline import job


def fault_key(email_id: int, prefix: str | None = None) -> str:
    """`prefix`: the Redis key prefix of the workers, when it is not this process's own."""
    return _key(f"test:fault:{email_id}", prefix)


def runs_key(email_id: int, prefix: str | None = None) -> str:
    return _key(f"test:runs:{email_id}", prefix)


def starts_key(email_id: int, prefix: str | None = None) -> str:
    """A list of the wall-clock times at which deliveries reached the steps."""
    return _key(f"test:starts:{email_id}", prefix)


def set_fault(
    redis: Redis, email_id: int, mode: str, times: int | None = None, prefix: str | None = None
) -> None:
    redis.hset(
        fault_key(email_id, prefix), mapping={"mode": mode, "left": -1 if times is None else times}
    )


def _key(name: str, prefix: str | None) -> str:
    return redis_keys.key(name) if prefix is None else f"{prefix}mailpipe:{name}"


def _take_fault(redis: Redis, email_id: int) -> str | None:
    fault = redis.hgetall(fault_key(email_id))
    if not fault:
        return None
    if int(fault[b"left"]) == 0:
        return None
    if int(fault[b"left"]) > 0:
        redis.hincrby(fault_key(email_id), "left", -1)
    return fault[b"mode"].decode()


def _crash(mode: str) -> None:
    if mode == "exit":
        os._exit(1)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "segfault":
        ctypes.string_at(0)
    if mode == "memory":
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (512 * 1024 * 1024, hard))
        try:
            bytearray(1024 * 1024 * 1024)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    if mode.startswith("slow:"):
        time.sleep(float(mode.split(":", 1)[1]))


_real_run_steps = job._run_steps


def _run_steps_with_faults(res, email_id: int, *args: object) -> job.Outcome:  # type: ignore[no-untyped-def]
    res.redis.incr(runs_key(email_id))
    res.redis.rpush(starts_key(email_id), time.time())
    mode = _take_fault(res.redis, email_id)
    if mode is not None:
        _crash(mode)
    return _real_run_steps(res, email_id, *args)


job._run_steps = _run_steps_with_faults
