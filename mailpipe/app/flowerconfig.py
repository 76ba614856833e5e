"""Flower's configuration for `celery -A mailpipe flower` (docs/metrics.md, section Flower).

Flower 2.2 executes the file named by `--conf=PATH` or `FLOWER_CONF`, or else `flowerconfig.py`
in its working directory, silently skipped when missing. So the path is always given: the image
sets `FLOWER_CONF=/etc/mailpipe/flowerconfig.py` (a copy of this file) and the task definition
says `--conf=` too; the Procfile names `./flowerconfig.py`, the re-export at the repository top. An
explicit path that does not exist stops Flower, so authentication never depends on where Flower
was started. Flower takes every top-level name here that is one of its options, so every other
name starts with an underscore (a plain `import logging` would set Flower's `logging` option).
Options on the command line, and Flower's FLOWER_* variables for the options set conditionally
below, still win over this file.

- Basic authentication from `MAILPIPE_FLOWER_BASIC_AUTH` (`user:password[,user2:password2]`);
  an entry with an empty user or password (`ops:`, `ops`) is refused.
- Flower refuses to start without authentication unless it listens on loopback only
  (`--address=127.0.0.1`, `::1` or `localhost`, or a unix socket): the dashboard can revoke
  jobs and shut workers down. Its default address, all interfaces, needs authentication.
- Offline workers leave the dashboard 10 minutes after their last heartbeat
  (`purge_offline_workers`): every ECS task is a new worker name, so they would pile up.
- The tasks page shows each job's email id (args), its outcome (result: succeeded, duplicate,
  handed_off, deferred...) and the exception of a task that raised.
- Flower's tracebacks in describe()'s words, and with `MAILPIPE_LOG_FORMAT=json` its log records
  as JSON lines (mailpipe.app.logs).
"""

from __future__ import annotations

import logging as _logging

from tornado.options import options as _options

from mailpipe.app import logs as _logs
from mailpipe.settings import get_settings as _get_settings
from mailpipe.settings import is_loopback as _is_loopback

_settings = _get_settings()
_credentials = _settings.flower_basic_auth
_entries = [pair.strip() for pair in (_credentials or "").split(",") if pair.strip()]
if _entries:
    basic_auth = _entries

# Seconds after its last heartbeat an offline worker is dropped from the Workers page and API.
_PURGE_OFFLINE_WORKERS_S = 600
if _options.purge_offline_workers is None:  # not given on the command line or in FLOWER_*
    purge_offline_workers = _PURGE_OFFLINE_WORKERS_S

# A run the pipeline failed (rejected input, attempts used up, an unknown email id) raises
# RunFailed with the run's error, so its task is a FAILURE with that exception (the Tasks page's
# Failed filter, or search "state:FAILURE"); a job that ends otherwise has its outcome as its
# result.
tasks_columns = "name,args,state,exception,result,worker,received,runtime"


def _malformed(entries: list[str]) -> str | None:
    """Why the basic auth entries cannot be used, without repeating any password."""
    for number, entry in enumerate(entries, start=1):
        user, colon, password = entry.partition(":")
        if not colon:
            return f"entry {number} has no ':password'"
        if not user.strip():
            return f"entry {number} has an empty user"
        if not password:
            return f"entry {number} (user {user.strip()!r}) has an empty password"
    return None


def _refuse_to_start_unprotected() -> None:
    """Run by Flower's last option parse, when the command line has had its say."""
    entries = list(_options.basic_auth or [])
    if _credentials is not None and not _entries:
        raise SystemExit("mailpipe flower: MAILPIPE_FLOWER_BASIC_AUTH is set but empty")
    problem = _malformed(entries)
    if problem:
        raise SystemExit(
            "mailpipe flower: basic auth must be user:password[,user:password] with neither "
            f"part empty; {problem}"
        )
    authenticated = bool(entries) or bool(_options.auth and _options.auth_provider)
    if authenticated or _options.unix_socket or _is_loopback(_options.address):
        return
    listen = f"{_options.address or '0.0.0.0'}:{_options.port}"
    raise SystemExit(
        f"mailpipe flower: refusing to listen on {listen} without authentication. Set "
        "MAILPIPE_FLOWER_BASIC_AUTH=user:password, or listen on loopback only for local use "
        "(--address=127.0.0.1)."
    )


def _log_format() -> None:
    """Tornado has set up its handler on the root logger by now (its own parse callback runs
    first): tracebacks in describe()'s words, and the JSON format when asked."""
    _logs.set_up(_logging.getLogger(), _settings.log_format)


_options.add_parse_callback(_refuse_to_start_unprotected)
_options.add_parse_callback(_log_format)
