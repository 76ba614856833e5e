"""A CI-sized chaos run: about 500 emails, every fault once (bench/chaos.py), nothing lost or
duplicated. It restarts the machine's PostgreSQL and flushes Redis database 11."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_chaos_loses_and_duplicates_nothing(tmp_path: Path, services: None) -> None:
    report_path = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--n", "500", "--deadline", "480",
         "--json", str(report_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert report_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    faults = {event["fault"] for event in report["faults"]}
    assert {"child_sigkill", "worker_sigkill", "worker_sigterm", "redis_flush", "postgres_restart",
            "s3_errors"} <= faults
    assert report["lost"] == 0, report
    assert report["duplicated"] == 0, report["duplicated_by_kind"]
    assert sum(report["terminal"].values()) == report["emails"] == 500
    assert report["s3_requests_failed"] > 0
    for poison in report["poison"]:
        assert poison["status"] == "failed" and poison["attempts"] == 4
        assert "worker process died" in poison["error"]
    assert run.returncode == 0
