"""Celery's configuration of mailpipe, for those who look for it here: it lives in the package,
`mailpipe/app/config.py` (every setting with the reason it is set), which `celery -A mailpipe`
loads. Installing mailpipe installs no module of this name."""

from mailpipe.app.config import *  # noqa: F403
