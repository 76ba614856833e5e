"""Flower's configuration of mailpipe, for the Procfile's `celery -A mailpipe flower
--conf=./flowerconfig.py` started in this folder: it lives in the package,
`mailpipe/app/flowerconfig.py` (the image copies that file to /etc/mailpipe/flowerconfig.py and
names it with FLOWER_CONF). Installing mailpipe installs no module of this name."""

from mailpipe.app.flowerconfig import *  # noqa: F403
