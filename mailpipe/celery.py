"""The Celery application: `celery -A mailpipe worker|beat|flower` finds `app` here."""

from celery import Celery

app = Celery("mailpipe", include=["mailpipe.tasks", "mailpipe.signals"])
app.config_from_object("celeryconfig")
