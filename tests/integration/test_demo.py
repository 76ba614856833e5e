"""`mailpipe demo` on a machine where Redis is not running.

"Not running" is a broker URL on a free port (the machine's own Redis is shared and stays up):
with `redis-server` installed the demo starts one of its own and stops it at the end; without it
(a PATH that lacks it) the demo says in one line how to get one and exits 4.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mailpipe.cli.demo.servers import free_port

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

BIN = Path(sys.executable).parent


def demo(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "demo"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=300,
    )


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_demo_without_redis_starts_its_own_and_stops_it(tmp_path: Path, services: None) -> None:
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    run = demo(tmp_path, MAILPIPE_BROKER_URL=nothing_there)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every sample reached its expected state" in run.stdout
    found = re.search(r"started redis-server on redis://127\.0\.0\.1:(\d+)/0", run.stdout)
    assert found, run.stdout
    assert not listening(int(found.group(1)))  # stopped at the end
    assert "Traceback" not in run.stderr


def test_demo_without_redis_or_redis_server_says_how_to_get_one(
    tmp_path: Path, services: None
) -> None:
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    run = demo(tmp_path, MAILPIPE_BROKER_URL=nothing_there, PATH=str(BIN))
    assert run.returncode == 4
    assert "Traceback" not in run.stderr
    [line] = run.stderr.splitlines()
    assert line.startswith(f"mailpipe demo: no Redis at {nothing_there} and no redis-server")
    assert "install Redis" in line and "MAILPIPE_BROKER_URL" in line
    assert not (tmp_path / "var").exists()
