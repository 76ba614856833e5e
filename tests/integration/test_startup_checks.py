"""A misconfigured worker stops at start with the reason, instead of failing every job.

The classifier is built when the worker starts (mailpipe/app/signals.py): a missing rules file, a
rule naming a label outside MAILPIPE_LABELS, a bad regex or a broken TOML file stop a real
`celery worker` before it takes a job, with one line naming the setting. Settings that contradict
each other stop it too, as does a broker URL that mailpipe's own Redis clients cannot use; those
that only defeat a mechanism are logged as warnings.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mailpipe.cli.demo import fleet as localfleet

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

GOOD_RULE = '[[rule]]\nlabel = "invoice"\nkeywords = ["invoice"]\n'


def worker_env(**settings: str) -> dict[str, str]:
    env = dict(os.environ)
    env["MAILPIPE_REDIS_PREFIX"] = (
        f"{os.environ['MAILPIPE_REDIS_PREFIX']}start{uuid.uuid4().hex[:8]}:"
    )
    env.update(settings)
    return env


def start_worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A worker that must not start: it exits by itself, long before the timeout."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "mailpipe", "worker", "--pool=prefork", "-c", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("rules", "labels", "reason"),
    [
        (None, None, "cannot be read: No such file or directory"),
        (GOOD_RULE, '["newsletter", "spam"]', "names label 'invoice', not in MAILPIPE_LABELS"),
        (GOOD_RULE + 'patterns = ["(unclosed"]\n', None, "has a bad regex '(unclosed'"),
        (GOOD_RULE + "patterns = [\n", None, "is not valid"),
        ("[[rule]]\nkeywords = ['x']\n", None, "has a rule without 'label'"),
    ],
    ids=["missing-file", "labels-mismatch", "bad-regex", "bad-toml", "no-label"],
)
def test_a_bad_rules_configuration_stops_the_worker_at_start(
    tmp_path: Path, services: None, rules: str | None, labels: str | None, reason: str
) -> None:
    path = tmp_path / "rules.toml"
    if rules is not None:
        path.write_text(rules)
    env = worker_env(MAILPIPE_RULES_FILE=str(path))
    if labels is not None:
        env["MAILPIPE_LABELS"] = labels
    result = start_worker(env)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mailpipe worker: MAILPIPE_RULES_FILE ({path})"), result.stderr
    assert reason in last
    assert "ready." not in result.stderr


def test_a_bedrock_classifier_that_cannot_be_built_stops_the_worker(services: None) -> None:
    result = start_worker(
        worker_env(MAILPIPE_MODEL_BACKEND="bedrock", MAILPIPE_BEDROCK_REGION="not a region!")
    )
    assert result.returncode != 0
    assert "mailpipe worker: the bedrock classifier cannot be built" in result.stderr


def test_contradicting_windows_stop_the_worker_naming_the_settings(services: None) -> None:
    result = start_worker(worker_env(MAILPIPE_LEASE_TTL="4000"))
    assert result.returncode != 0
    assert "MAILPIPE_LEASE_TTL (4000 s) must be below MAILPIPE_MAX_DEFERRAL" in result.stderr


def test_a_sentinel_broker_url_stops_the_worker_saying_why(services: None) -> None:
    # Sentinels that do not exist: the refusal comes before any connection is tried.
    result = start_worker(
        worker_env(MAILPIPE_BROKER_URL="sentinel://127.0.0.1:1/0;sentinel://127.0.0.1:2/0")
    )
    assert result.returncode != 0
    assert "MAILPIPE_BROKER_URL must be a redis:// or rediss:// URL, not sentinel://" in (
        result.stderr
    )
    assert "from_url cannot follow a Sentinel" in result.stderr
    assert "ready." not in result.stderr


def test_windows_that_defeat_a_mechanism_are_logged_at_start(
    tmp_path: Path, services: None
) -> None:
    env = worker_env(MAILPIPE_LEASE_TTL="30", MAILPIPE_TASK_TIME_LIMIT="25")
    worker = localfleet.worker(env, tmp_path, concurrency=1, name="windows").start()
    try:
        worker.wait_ready()
    finally:
        worker.stop()
    log = worker.log_path.read_text()
    assert "settings: MAILPIPE_LEASE_TTL (30 s) is not below MAILPIPE_TASK_TIME_LIMIT (25 s)" in log
