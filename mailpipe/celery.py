"""The Celery application: `celery -A mailpipe worker|beat|flower` finds `app` here."""

from celery import Celery

from mailpipe import broker

broker.register()
app = Celery("mailpipe", include=["mailpipe.tasks"])
app.config_from_object("celeryconfig")

# Every process that publishes jobs (the CLI and upstream code too, not only workers) needs the
# signal handlers: the enqueue-time stamp behind OldestJobAgeSeconds is one.
import mailpipe.signals  # noqa: E402, F401
