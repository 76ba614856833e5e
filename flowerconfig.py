"""Flower's configuration for `celery -A mailpipe flower` (docs/metrics.md, section Flower).

Flower 2.2 executes `flowerconfig.py` from the working directory (or the file named by `--conf` or
`FLOWER_CONF`) and takes every top-level name that is one of its options; so every other name
here starts with an underscore (a plain `import logging` would set Flower's `logging` option).
Command-line options still win over this file.

- Basic authentication from `MAILPIPE_FLOWER_BASIC_AUTH` (`user:password[,user2:password2]`).
- The tasks page shows each job's email id (args), its outcome (result: succeeded, duplicate,
  failed, deferred) and the exception of a task that raised.
- Flower refuses to start without authentication unless it listens on loopback only
  (`--address 127.0.0.1`, `::1` or `localhost`, or a unix socket): the dashboard can revoke
  jobs and shut workers down. Its default address, all interfaces, needs authentication.
"""

from __future__ import annotations

import ipaddress as _ipaddress

from tornado.options import options as _options

from mailpipe.settings import get_settings as _get_settings

_credentials = _get_settings().flower_basic_auth
if _credentials:
    basic_auth = [pair.strip() for pair in _credentials.split(",") if pair.strip()]

# A run the pipeline failed ends its task normally with the result 'failed' (search
# "result:failed"); only a task that raised (an unknown email id, a bug) is a FAILURE.
tasks_columns = "name,args,state,exception,result,worker,received,runtime"


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return _ipaddress.ip_address(address).is_loopback
    except ValueError:  # "" (all interfaces) or a host name: not known to be loopback
        return False


def _refuse_to_start_unprotected() -> None:
    """Run by Flower's last option parse, when the command line has had its say."""
    if any(":" not in pair for pair in _options.basic_auth or []):
        raise SystemExit(
            "mailpipe flower: MAILPIPE_FLOWER_BASIC_AUTH must be user:password[,user:password]"
        )
    authenticated = bool(_options.basic_auth) or bool(_options.auth and _options.auth_provider)
    if authenticated or _options.unix_socket or _is_loopback(_options.address):
        return
    listen = f"{_options.address or '0.0.0.0'}:{_options.port}"
    raise SystemExit(
        f"mailpipe flower: refusing to listen on {listen} without authentication. Set "
        "MAILPIPE_FLOWER_BASIC_AUTH=user:password, or listen on loopback only for local use "
        "(--address 127.0.0.1)."
    )


_options.add_parse_callback(_refuse_to_start_unprotected)
