"""The console's sign-in cannot be turned against the service (mailpipe/web/auth.py), each case on
a real `mailpipe web` process: a flood of wrong passwords leaves its memory and /healthz alone,
failures past the limits are answered 429 with when to try again, an unknown user takes as long
to refuse as a known one, and a guessable MAILPIPE_WEB_SECRET stops it at start.

Sign-in itself needs no database or Redis; these start servers, so they are not the quick tier.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest
from argon2 import PasswordHasher

from mailpipe.web.auth import FAILURES_PER_ADDRESS, FAILURES_PER_USER
from tests.support.console import BIN, OPERATOR, VIEWER, ConsoleProcess, users_env
from tests.support.signin import (
    Watch,
    addresses,
    flood,
    get,
    median_ms,
    refusal_times,
    vm_kib,
)

pytestmark = pytest.mark.services  # real server processes, not the quick tier's pure code


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], ConsoleProcess]]:
    """Starts `mailpipe web` with the test's environment and `users`; stops it after."""
    started: list[ConsoleProcess] = []

    def start(users: dict[str, str]) -> ConsoleProcess:
        process = ConsoleProcess({**os.environ, **users}, tmp_path / f"web{len(started)}.log")
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def test_a_flood_of_wrong_passwords_leaves_memory_and_healthz_alone(console) -> None:  # type: ignore[no-untyped-def]
    """200 wrong passwords in 10 s for an argon2 account (argon2-cffi's defaults: 64 MiB a
    check), from 50 client addresses by 50 clients at once.

    Wall-clock bounds, which the specification asks for here alone: /healthz within 100 ms
    throughout, and the server under 200 MiB resident. Measured on 2 CPUs (docs/benchmarks.md,
    "Sign-in"), the bounded server's worst /healthz is 9 to 20 ms, with the rest of the suite
    running beside it, and its peak 151 MiB (86 at rest and one check's 64); the unbounded one's
    was 1.6 to 3.9 s and 2.4 GiB. 100 ms is five times the first and a sixteenth of the second:
    a slow or busy machine does not reach it, a thread pool that holds /healthz up passes it.
    """
    web = console({"MAILPIPE_WEB_OPERATORS": f"target:{PasswordHasher().hash('the right one')}"})
    pid = web.process.pid
    with Watch(web.url, pid) as seen:
        statuses = flood(web.url, "target", count=200, seconds=10, clients=50, sources=50)
    peak = vm_kib(pid, "VmHWM") / 1024
    assert seen.healthz_refused == []
    assert len(seen.healthz_s) > 100  # asked all along
    assert seen.worst_healthz_s < 0.1, f"/healthz took {seen.worst_healthz_s * 1000:.0f} ms"
    assert max(seen.rss_mib) < 200 and peak < 200, f"peak RSS {peak:.0f} MiB"
    # Checked until the user name's limit, the rest refused unchecked: past the limit (429), or
    # after waiting their time for a slot behind the checks (503, on a busy machine).
    assert statuses[401] <= FAILURES_PER_USER.amount, statuses
    assert statuses[401] + statuses[429] + statuses[503] == 200, statuses


def test_an_unknown_user_takes_as_long_to_refuse_as_a_known_one(console) -> None:  # type: ignore[no-untyped-def]
    """20 known and 20 unknown users, each refused once in turn from an address of its own (so
    that no limit is reached); the medians within 10 %. Known users share one bcrypt hash at
    its library's default cost (12 rounds, ~0.25 s a check): an unknown one answered in 1 ms."""
    hashed = bcrypt.hashpw(b"the right one", bcrypt.gensalt(12)).decode()
    known = [f"operator{number}" for number in range(20)]
    web = console({"MAILPIPE_WEB_OPERATORS": ",".join(f"{user}:{hashed}" for user in known)})
    unknown = [f"nobody{number}" for number in range(20)]
    known_s, unknown_s = refusal_times(web.url, known, unknown, "a wrong one")
    known_ms, unknown_ms = median_ms(known_s), median_ms(unknown_s)
    assert abs(known_ms - unknown_ms) <= 0.1 * known_ms, (known_ms, unknown_ms)


def test_failures_past_a_limit_are_answered_429_with_when_to_try_again(console) -> None:  # type: ignore[no-untyped-def]
    """Per client address, then per user name; the right password is refused too once over,
    and another address or user is not."""
    web = console(users_env())
    one, other, *more = addresses(2 + FAILURES_PER_USER.amount)
    for number in range(FAILURES_PER_ADDRESS.amount):
        refused = get(web.url, "/", auth=(f"nobody{number}", "wrong"), address=one)
        assert refused.status == 401, refused
    for path, kind in (("/", "text/plain"), ("/api/queues", "application/json")):
        limited = get(web.url, path, auth=OPERATOR, address=one)
        assert limited.status == 429, limited
        assert limited.headers["content-type"].startswith(kind)
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        assert "too many failed sign-ins from this address" in limited.body
    assert get(web.url, "/api/queues", auth=OPERATOR, address=other).status == 200

    for number, address in enumerate(more):
        refused = get(web.url, "/", auth=(VIEWER[0], f"wrong{number}"), address=address)
        assert refused.status == 401, refused
    limited = get(web.url, "/api/queues", auth=VIEWER, address=other)
    assert limited.status == 429 and "for this user name" in limited.body, limited
    assert 1 <= int(limited.headers["retry-after"]) <= 60
    assert get(web.url, "/api/queues", auth=OPERATOR, address=other).status == 200
    assert get(web.url, "/healthz", address=one).status == 200  # signs in nowhere
    assert "failed sign-ins from 127.0.1.1 reached 20 a minute" in web.output()
    assert f"failed sign-ins as '{VIEWER[0]}' reached 10 a minute" in web.output()


@pytest.mark.parametrize("secret", ["", "x" * 31])
def test_a_short_or_empty_secret_stops_the_console_at_start(secret: str) -> None:
    done = subprocess.run(
        [str(BIN / "mailpipe"), "web"],
        env={**os.environ, **users_env(), "MAILPIPE_WEB_SECRET": secret},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "Error: invalid settings: MAILPIPE_WEB_SECRET: must be at least 32 bytes"
    )
    assert "x" * 31 not in done.stderr
