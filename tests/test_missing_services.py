"""The suite on a machine without Redis or PostgreSQL: it stops before any test, exit status 3,
with the missing service named and how to start it, in its two processes as in one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mailpipe.cli.demo.servers import free_port
from tests.support.paths import REPO

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# Any test module: the run must stop before its first test.
SOME_TESTS = "tests/unit/storage/test_blobs.py"


def run_suite(processes: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", processes, SOME_TESTS],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=300,
    )


MISSING = {
    "Redis": ("MAILPIPE_TEST_REDIS_URL", "redis://127.0.0.1:{port}/9", "redis-server"),
    "PostgreSQL": (
        "MAILPIPE_TEST_PG_ADMIN_URL",
        "postgresql://postgres@127.0.0.1:{port}/postgres",
        "pg_ctlcluster",
    ),
}


@pytest.mark.parametrize("processes", ["2", "0"])
@pytest.mark.parametrize("service", sorted(MISSING))
def test_a_missing_service_stops_the_run_with_how_to_start_it(service: str, processes: str) -> None:
    variable, url, start = MISSING[service]
    nothing_there = url.format(port=free_port())
    run = run_suite(processes, **{variable: nothing_there})
    output = run.stdout + run.stderr
    assert run.returncode == 3, output
    assert f"{service} is not reachable at {nothing_there}" in output
    assert f"Start it: {start}" in output
    assert "passed" not in output and "INTERNALERROR" not in output
