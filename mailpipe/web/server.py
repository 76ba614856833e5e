"""`mailpipe web`: the console on uvicorn, refused where it would be open to anyone."""

from __future__ import annotations

import logging

from mailpipe.settings import Settings, is_loopback
from mailpipe.web.auth import accounts


def refusal(settings: Settings) -> str | None:
    """Why the console must not start with these settings; None if it may."""
    if accounts(settings) or is_loopback(settings.web_host):
        return None
    return (
        f"mailpipe web refuses to serve {settings.web_host} without users: anyone who reaches it "
        "could act on the fleet. Set MAILPIPE_WEB_OPERATORS (and MAILPIPE_WEB_VIEWERS), or "
        "MAILPIPE_WEB_HOST=127.0.0.1"
    )


def serve(settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT (uvicorn finishes the requests under way)."""
    import uvicorn

    from mailpipe.web.app import create_app

    _log_to_stderr(settings)
    app = create_app(settings)
    # log_config=None: uvicorn's records go through the handler set up here, in the same format.
    # access_log=False: the app writes its own (`app.AccessLog`), without the query string.
    # uvicorn takes the client's address from X-Forwarded-For when the peer is named in
    # FORWARDED_ALLOW_IPS (uvicorn's own variable, loopback by default): behind a load balancer
    # it names the balancer's subnets, or the sign-in's per-address limit counts the balancer.
    uvicorn.run(
        app,
        host=settings.web_host,
        port=settings.web_port,
        log_config=None,
        access_log=False,
    )


def _log_to_stderr(settings: Settings) -> None:
    from mailpipe.app.logs import to_stderr

    to_stderr(logging.getLogger(), settings.log_format)
