"""Every Redis key mailpipe owns, in one place, all under the ``mailpipe:`` prefix and behind
``MAILPIPE_REDIS_PREFIX`` (which kombu also puts before its queue lists, see celeryconfig)."""

from __future__ import annotations

from mailpipe.settings import get_settings


def key(name: str) -> str:
    return f"{get_settings().redis_prefix}mailpipe:{name}"


def job_marker(email_id: int) -> str:
    """Present while the email's job is queued or running: the enqueue dedup marker."""
    return key(f"job:{email_id}")


def lease(email_id: int) -> str:
    """Held by the one delivery that is running the email's job."""
    return key(f"lease:{email_id}")


def sweep_lock() -> str:
    return key("sweep:lock")


def beat_lock() -> str:
    return key("beat:lock")


def failed_runs_cursor() -> str:
    """Where the fleet's count of failed runs reported to CloudWatch has got to."""
    return key("metrics:failed-runs-cursor")


def queue_list(queue: str) -> str:
    """The Redis list kombu keeps a queue's messages in."""
    return f"{get_settings().redis_prefix}{queue}"
