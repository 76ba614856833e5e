"""What a commit waits for: a worker's job processes commit without waiting for the disk, every
other process waits (docs/architecture.md, "What a commit waits for")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.probes import ask_a_job_process

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_workers_jobs_commit_without_waiting_for_the_disk(res, tmp_path, pool) -> None:  # type: ignore[no-untyped-def]
    assert ask_a_job_process(res, tmp_path, pool) == "off"


def test_a_worker_told_to_wait_for_the_disk_does(res, tmp_path) -> None:  # type: ignore[no-untyped-def]
    waiting = ask_a_job_process(res, tmp_path, MAILPIPE_WORKER_SYNCHRONOUS_COMMIT="true")
    assert waiting == "on"


def test_any_other_process_waits_for_the_disk(res) -> None:  # type: ignore[no-untyped-def]
    """Upstream code and the CLI: their writes (stored emails, flags, reopened runs) are derived
    from nothing, and must survive a crash of PostgreSQL once committed. Asked in a fresh
    process, as this one hosts Celery's in-process test worker for some tests."""
    asked = subprocess.run(
        [
            sys.executable,
            "-c",
            "from sqlalchemy import text; from mailpipe.resources import get_resources\n"
            "with get_resources().db.session() as session:\n"
            "    print(session.scalar(text('SHOW synchronous_commit')))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert asked.stdout.strip() == "on", asked.stderr
