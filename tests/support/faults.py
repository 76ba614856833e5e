"""Fault injection for the crash, shutdown and chaos tests.

Loaded into a real worker with ``celery -A mailpipe worker -I tests.support.faults``, it wraps
the pipeline's steps (after the lease is taken and the attempt is counted, where a crash in a
parser would happen) so that an email whose id has a fault set in Redis misbehaves:

- ``exit``: ``os._exit(1)``; ``sigkill``: SIGKILL to itself; ``segfault``: a NULL read through
  ctypes; ``memory``: allocation past an address-space limit set for the child;
- ``slow:SECONDS``: sleeps, then runs the real steps (a slow but healthy job);
- ``held``: waits until the test releases it (``release``), then runs the real steps: a job
  that is still running whenever the test needs it to be;
- ``hang``: sleeps for ever and ignores the soft time limit (a job stuck in C code), so only
  the hard time limit ends it;
- ``die-after-steps``: runs the real steps (their writes committed), then SIGKILLs its child:
  a crash between the CPU stage and its hand-off;
- ``transient``: raises a TransientError (a service that is down), ``transient:SECONDS`` one
  that says when to come back (a Retry-After);
- ``raise``: raises a RuntimeError, an error nothing foresaw (a bug in a step, or in a library);
- ``quote``: raises a ValueError whose message quotes the email's subject and body, as a parser
  that cannot read a header may; ``quote-outside`` raises it in the task, before the pipeline
  (outside its handling: a bug of the task's own), so that it leaves the task for Celery.

A claim fault (``set_claim_fault``) holds the delivery inside its claim transaction, after the
run's row is locked, until the test lets that one claim go (``release_claim``): a window in
which to restart the database, or to read what the attempt before left on the run.

An answer fault (``set_answer_fault``) SIGKILLs the model stage's process once the transaction
that stores the model's answer for the email has committed, before the labels: a job that dies
after the paid call, whose next delivery must take the stored answer instead of calling again.

A fault can be limited to its first N deliveries (``times``). Every delivery that reaches the
steps is counted under ``runs_key`` and its start time kept under ``starts_key``, so tests can
tell how often and when the steps really ran; the countdown of every retry a delivery asks Celery
for (what ``EmailJobTask.follow`` passes to ``retry``) is kept under ``countdowns_key``.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time

from billiard.exceptions import SoftTimeLimitExceeded
from redis import Redis
from sqlalchemy import event

from mailpipe.app.tasks import EmailJobTask
from mailpipe.broker.queues import Lane
from mailpipe.coordination import redis_keys
from mailpipe.errors import TransientError
from mailpipe.pipeline import job, runs
from mailpipe.storage.models import EmailMessage


def fault_key(email_id: int, prefix: str | None = None) -> str:
    """`prefix`: the Redis key prefix of the workers, when it is not this process's own."""
    return _key(f"test:fault:{email_id}", prefix)


def runs_key(email_id: int, prefix: str | None = None) -> str:
    return _key(f"test:runs:{email_id}", prefix)


def answer_fault_key(email_id: int, prefix: str | None = None) -> str:
    """How many more deliveries die once they have stored the model's answer for the email."""
    return _key(f"test:answerfault:{email_id}", prefix)


def starts_key(email_id: int, prefix: str | None = None) -> str:
    """A list of the wall-clock times at which deliveries reached the steps."""
    return _key(f"test:starts:{email_id}", prefix)


def countdowns_key(email_id: int, prefix: str | None = None) -> str:
    """A list of the countdowns (seconds) of the retries the email's deliveries sent, in order."""
    return _key(f"test:countdowns:{email_id}", prefix)


def release_key(email_id: int, prefix: str | None = None) -> str:
    return _key(f"test:release:{email_id}", prefix)


def release(redis: Redis, email_id: int, prefix: str | None = None) -> None:
    """Let the email's ``held`` delivery go on."""
    redis.set(release_key(email_id, prefix), 1)


def claim_fault_key(email_id: int, prefix: str | None = None) -> str:
    return _key(f"test:claimfault:{email_id}", prefix)


def claim_release_key(email_id: int, prefix: str | None = None) -> str:
    return _key(f"test:claimrelease:{email_id}", prefix)


def set_claim_fault(redis: Redis, email_id: int, times: int = 1, prefix: str | None = None) -> None:
    redis.hset(claim_fault_key(email_id, prefix), mapping={"left": times})


def claims_held(redis: Redis, email_id: int, prefix: str | None = None) -> int:
    """How many of the email's claims the fault has held so far, each until released."""
    return int(redis.hget(claim_fault_key(email_id, prefix), "held") or 0)


def release_claim(redis: Redis, email_id: int, prefix: str | None = None) -> None:
    """Let one held claim of the email go on (the next one to be held, if none is yet)."""
    redis.set(claim_release_key(email_id, prefix), 1)


def set_answer_fault(
    redis: Redis, email_id: int, times: int = 1, prefix: str | None = None
) -> None:
    redis.set(answer_fault_key(email_id, prefix), times)


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
    if mode == "transient":
        raise TransientError("the test's service is down")
    if mode.startswith("transient:"):
        retry_after = float(mode.split(":", 1)[1])
        raise TransientError("the test's service is busy", retry_after=retry_after)
    if mode == "raise":
        raise RuntimeError("the test's step has a bug")
    if mode == "hang":
        while True:
            try:
                time.sleep(3600)
            except SoftTimeLimitExceeded:
                pass


def quoting_error(res, email_id: int) -> ValueError:  # type: ignore[no-untyped-def]
    """What a parser that cannot read a header may raise: its message quotes the email."""
    from mailpipe.mail.parse import ParseLimits, parse_email  # where this release has it

    with res.db.session() as session:
        blob_key = session.get_one(EmailMessage, email_id).blob_key
    limits = ParseLimits(max_bytes=50 << 20, max_depth=25, max_parts=1000, body_max_chars=2000)
    parsed = parse_email(res.blobs.get(blob_key), limits)
    return ValueError(f"cannot read the header of {parsed.subject!r}: {parsed.body_text!r}")


_real_run_steps = job._run_steps


def _run_steps_with_faults(res, email_id: int, *args: object) -> job.Verdict:  # type: ignore[no-untyped-def]
    res.redis.incr(runs_key(email_id))
    res.redis.rpush(starts_key(email_id), time.time())
    mode = _take_fault(res.redis, email_id)
    if mode == "held":
        while not res.redis.exists(release_key(email_id)):
            time.sleep(0.1)
    if mode == "die-after-steps":
        _real_run_steps(res, email_id, *args)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "quote":
        raise quoting_error(res, email_id)
    if mode is not None:
        _crash(mode)
    return _real_run_steps(res, email_id, *args)


job._run_steps = _run_steps_with_faults

_real_process_email = job.process_email


def _process_email_with_faults(res, email_id: int, **kwargs: object) -> job.Verdict:  # type: ignore[no-untyped-def]
    """The task's call of the pipeline (`job.process_email`): a ``quote-outside`` fault raises
    here, where no step's handling catches it."""
    fault = res.redis.hget(fault_key(email_id), "mode")
    if fault == b"quote-outside" and _take_fault(res.redis, email_id) is not None:
        raise quoting_error(res, email_id)
    return _real_process_email(res, email_id, **kwargs)


job.process_email = _process_email_with_faults

_real_store_classification = job._store_classification


def _store_classification_with_faults(session, *args: object) -> None:  # type: ignore[no-untyped-def]
    _real_store_classification(session, *args)
    # This release passes the claim, which names the email; the previous one the email's id.
    email_id = args[0] if isinstance(args[0], int) else args[0].email_id  # type: ignore[attr-defined]
    from mailpipe.resources import get_resources

    redis = get_resources().redis
    if int(redis.get(answer_fault_key(email_id)) or 0) > 0:
        # Counted down only once the answer is committed: a transaction rolled back (a delivery
        # superseded, the database restarting) stored nothing, so nothing is cut after it.
        event.listen(
            session, "after_commit", lambda _: _die_after_answer(redis, email_id), once=True
        )


def _die_after_answer(redis: Redis, email_id: int) -> None:
    if redis.decr(answer_fault_key(email_id)) >= 0:
        os.kill(os.getpid(), signal.SIGKILL)


job._store_classification = _store_classification_with_faults


def _held_by_a_claim_fault(session, email_id: int) -> None:  # type: ignore[no-untyped-def]
    """Hold the claim's transaction open while the email's claim fault says so: the run's row
    written and locked, not yet committed."""
    from mailpipe.resources import get_resources

    redis = get_resources().redis
    key = claim_fault_key(email_id)
    fault = redis.hgetall(key)
    if fault and int(fault[b"left"]) > 0:
        redis.hincrby(key, "left", -1)
        session.flush()
        redis.hincrby(key, "held", 1)
        while not redis.delete(claim_release_key(email_id)):  # each release lets one claim go
            time.sleep(0.1)


def _with_claim_fault(claim):  # type: ignore[no-untyped-def]
    """A claim (`runs.claim`, or the previous release's `runs.claim_attempt`) that meets the
    email's claim fault once it has counted, or decided."""

    def claim_with_faults(session, email_id: int, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        result = claim(session, email_id, *args, **kwargs)
        if result is not None:
            _held_by_a_claim_fault(session, email_id)
        return result

    return claim_with_faults


# The previous release's worker (tests/integration/test_rolling_deploy.py) loads these faults
# too, and its claims are `claim_attempt` alone.
if hasattr(runs, "claim"):
    runs.claim = _with_claim_fault(runs.claim)
else:
    runs.claim_attempt = _with_claim_fault(runs.claim_attempt)

_real_follow = EmailJobTask.follow


def _follow_recorded(
    self, email_id: int, outcome: job.Verdict, lane: Lane, mailbox: str | None
) -> str:  # type: ignore[no-untyped-def]
    if outcome.kind is job.Kind.RETRY:
        from mailpipe.resources import get_resources

        get_resources().redis.rpush(countdowns_key(email_id), repr(outcome.delay))
    return _real_follow(self, email_id, outcome, lane, mailbox)


EmailJobTask.follow = _follow_recorded  # type: ignore[method-assign]
