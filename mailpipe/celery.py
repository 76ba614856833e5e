"""The Celery application: `celery -A mailpipe worker|beat|flower` finds `app` here.

Creating it changes nothing global: it is not made the current app, registers no signal handler
and imports no task module. Worker and beat processes load those from its configuration
(`mailpipe.app.config`: `include` and `imports`).
"""

from celery import Celery

app = Celery("mailpipe", set_as_current=False)
app.config_from_object("mailpipe.app.config")
