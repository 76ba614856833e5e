"""Every Redis key mailpipe owns, in one place, all under the ``mailpipe:`` prefix and behind
``MAILPIPE_REDIS_PREFIX`` (which kombu also puts before its queue lists: mailpipe.app.config)."""

from __future__ import annotations

import hashlib

from mailpipe.broker.queues import job_queues
from mailpipe.settings import get_settings


def key(name: str) -> str:
    return f"{get_settings().redis_prefix}mailpipe:{name}"


def job_marker(email_id: int) -> str:
    """Present while the email's job is queued or running: the enqueue dedup marker. Its value is
    the unix time it was last set."""
    return key(f"job:{email_id}")


def lease(email_id: int) -> str:
    """Held by the one delivery that is running the email's job."""
    return key(f"lease:{email_id}")


def deferred(queue: str) -> str:
    """Sorted set: emails whose job on `queue` waits for a deferred delivery, scored by when it
    is due."""
    return key(f"deferred:{queue}")


def deferred_sets() -> list[str]:
    """The deferred set of every queue that carries email jobs."""
    return [deferred(queue) for queue in job_queues(get_settings())]


def mailbox_ceiling(limiter: str, mailbox: str) -> str:
    """Hash: the model-call ceiling of the mailbox `mailbox` (its shown name) in the limiter
    `limiter` (mailpipe.coordination.ratelimit). Keyed by a hash of the name, never the name,
    and tagged with the limiter's name, so that it lives on the limiter's Redis Cluster shard."""
    digest = hashlib.blake2b(
        mailbox.encode(), digest_size=16, person=b"mailpipe-ceiling"
    ).hexdigest()
    return key(f"ratelimit:{{{limiter}}}:mailbox:{digest}")


def health_checks_counter(dependency: str) -> str:
    """Checks of `dependency` the fleet has made (mailpipe.pipeline.health), ever."""
    return key(f"metrics:health-checks:{dependency}")


def pauses_restored() -> str:
    """Present while Redis holds every operator's pause the database keeps: gone with a flush or
    a restart, which tells a reader to put them back (mailpipe.coordination.pauses)."""
    return key("pauses:restored")


def mailbox_pauses() -> str:
    """Hash: the paused mailboxes, a field per mailbox (the name shown) holding its pause as
    JSON (reason, since)."""
    return key("mailbox-pauses")


def mailbox_pauses_restored() -> str:
    """Present while Redis holds every mailbox pause the database keeps: gone with a flush or a
    restart, which tells a reader to put them back (mailpipe.coordination.pauses)."""
    return key("mailbox-pauses:restored")


def deferrals_counter() -> str:
    """Deferrals since the last metrics report (the `Deferrals` metric)."""
    return key("metrics:deferrals")


def lane_deferrals() -> str:
    """Deferrals since the last metrics report, a field per lane of each stage's queue (the
    stage's `JobsDeferred` and the console's charts)."""
    return key("metrics:lane-deferrals")


def workers() -> str:
    """Sorted set: live worker processes, scored by their last heartbeat (Redis's clock)."""
    return key("workers")


def workers_of(version: str) -> str:
    """Sorted set: live worker processes of release `version`, scored by their last heartbeat."""
    return key(f"version:{version}:workers")


def worker_versions() -> str:
    """Set: the releases whose workers have beaten lately (`workers_of` each)."""
    return key("versions")


def workers_on(queue: str) -> str:
    """Sorted set: live worker processes that consume `queue`, scored by their last heartbeat."""
    return key(f"queue:{queue}:workers")


def worker_held(worker_id: str) -> str:
    """Set: delivery tags of the messages a worker holds (running, reserved or counting down)."""
    return key(f"worker:{worker_id}:held")


def unheld() -> str:
    """Sorted set: delivery tags of delivered messages no live worker holds, scored by since when
    (Redis's clock): the worker heartbeat's recovery puts them back once they are old enough."""
    return key("workers:unheld")


def reaper_lock() -> str:
    return key("workers:reaper")


def startup_sweep() -> str:
    """Set by the first worker of a fleet start to send the start-up sweep, for one interval."""
    return key("sweep:startup")


def sweep_lock() -> str:
    return key("sweep:lock")


def beat_lock() -> str:
    return key("beat:lock")


def report_cursor() -> str:
    """The end of the last window the fleet's metrics report counted (failed runs, the stages'
    jobs), as unix time."""
    return key("metrics:report-cursor")


def pause(stage: str) -> str:
    """Hash: the stage's pause (error, since, by, token, dependency), present while the stage
    is paused."""
    return key(f"pause:{stage}")


def outage(stage: str) -> str:
    """String: when the stage's outage began (Redis time), kept a pause window past the pause
    that ended it, so that a pause soon after counts from the same start."""
    return key(f"outage:{stage}")


def faults(stage: str) -> str:
    """Sorted set: emails that met an outage at `stage`, scored by when (Redis time)."""
    return key(f"faults:{stage}")


def probe_lock(stage: str) -> str:
    """Taken by the one worker that probes a paused stage, for one probe interval."""
    return key(f"pause:{stage}:probe")


def cut_off(email_id: int) -> str:
    """Set by a worker that began to shut down while the email's job was running in it."""
    return key(f"cutoff:{email_id}")


def forgotten(email_id: int) -> str:
    """Set by `mailpipe forget` before it deletes the email, for longer than any job of it can
    still run: the fence a job in flight checks before it writes a blob."""
    return key(f"forgotten:{email_id}")
