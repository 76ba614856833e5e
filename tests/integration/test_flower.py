"""`celery -A mailpipe flower` as the Procfile starts it (from the repository root, which holds
flowerconfig.py): basic auth from settings, the loopback rule, and a failed job read back."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from mailpipe import localfleet
from mailpipe.ingest import store_emails
from tests.conftest import REPO, _free_port
from tests.integration.conftest import wait_for
from tests.integration.test_metrics import enqueue_in

UNKNOWN_IDS = [999991, 999992, 999993]


def flower_env(basic_auth: str | None) -> dict[str, str]:
    """Its own key prefix: Flower, its worker and its jobs see nothing else of the run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWER_", "MAILPIPE_FLOWER_"))}
    env["MAILPIPE_REDIS_PREFIX"] = f"{os.environ['MAILPIPE_REDIS_PREFIX']}f{uuid.uuid4().hex[:8]}:"
    if basic_auth:
        env["MAILPIPE_FLOWER_BASIC_AUTH"] = basic_auth
    return env


def flower_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "mailpipe", "flower", *args]


class Flower:
    def __init__(self, env: dict[str, str], log_path: Path, auth: tuple[str, str] | None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.auth = auth
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                flower_command("--address=127.0.0.1", f"--port={self.port}"),
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        self.log_path = log_path

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("auth", self.auth)
        return requests.get(self.url + path, timeout=5, **kwargs)

    def wait_ready(self) -> None:
        def healthy() -> bool:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                return self.get("/healthcheck", auth=None).status_code == 200
            except requests.ConnectionError:
                return False

        wait_for(healthy, 30, "Flower to answer /healthcheck")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)


def queue_lengths(dashboard: Flower) -> dict[str, int]:
    queues = dashboard.get("/api/queues/length").json()["active_queues"]
    return {queue["name"]: queue["messages"] for queue in queues}


@pytest.fixture
def flower(tmp_path: Path) -> Iterator[tuple[Flower, dict[str, str]]]:
    password = uuid.uuid4().hex
    env = flower_env(f"ops:{password}")
    process = Flower(env, tmp_path / "flower.log", auth=("ops", password))
    try:
        process.wait_ready()
        yield process, env
    finally:
        process.stop()


def test_flower_shows_failed_jobs_behind_basic_auth(res, tmp_path: Path, flower) -> None:  # type: ignore[no-untyped-def]
    dashboard, env = flower
    [empty] = store_emails(res, [b""])  # its run fails inside the pipeline (rejected input)
    enqueue_in(env, UNKNOWN_IDS + [empty])
    # The broker view reads the queue through the key prefix (no worker yet: the configured
    # queues are listed).
    assert queue_lengths(dashboard)["mailpipe"] == len(UNKNOWN_IDS) + 1

    worker = localfleet.worker(env, tmp_path, concurrency=2).start()
    try:
        worker.wait_ready()

        def failures() -> dict[str, Any]:
            return dashboard.get("/api/tasks", params={"state": "FAILURE"}).json()

        # Three unknown ids and one run the pipeline failed (rejected input) all show as FAILURE.
        wait_for(lambda: len(failures()) == len(UNKNOWN_IDS) + 1, 30, "Flower to see 4 failures")
        failed = failures()
        assert {task["args"] for task in failed.values()} == {f"({i},)" for i in UNKNOWN_IDS + [empty]}
        for task in failed.values():
            assert task["name"] == "mailpipe.process_email"
            assert task["worker"] == worker.nodename
        by_args = {task["args"]: task for task in failed.values()}
        unknown = by_args[f"({UNKNOWN_IDS[0]},)"]
        assert "UnknownEmail" in unknown["exception"]
        info = dashboard.get(f"/api/task/info/{unknown['uuid']}").json()
        assert info["state"] == "FAILURE"
        assert f"no email_message row with id {UNKNOWN_IDS[0]}" in info["exception"]
        # The failed run's task carries the run's recorded error.
        assert "RunFailed" in by_args[f"({empty},)"]["exception"]
        assert "email is empty" in by_args[f"({empty},)"]["exception"]

        workers = dashboard.get("/api/workers", params={"refresh": "1"}).json()
        assert worker.nodename in workers
        assert queue_lengths(dashboard)["mailpipe"] == 0
    finally:
        assert worker.stop() == 0, worker.log_tail()

    for path in ("/", "/api/tasks", f"/api/task/info/{unknown['uuid']}"):
        assert dashboard.get(path, auth=None).status_code == 401
        assert dashboard.get(path, auth=("ops", "wrong")).status_code == 401
    # Credentials in a header, as a reverse proxy would add them.
    token = b64encode(f"{dashboard.auth[0]}:{dashboard.auth[1]}".encode()).decode()
    assert dashboard.get("/api/tasks", auth=None, headers={"Authorization": f"Basic {token}"}).ok


@pytest.mark.parametrize("address", ["0.0.0.0", None], ids=["all-interfaces", "default-address"])
def test_flower_refuses_to_listen_beyond_loopback_without_auth(address: str | None) -> None:
    args = [f"--port={_free_port()}"] + ([f"--address={address}"] if address else [])
    result = subprocess.run(
        flower_command(*args), cwd=REPO, env=flower_env(None), capture_output=True, text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0" in result.stderr
    assert "MAILPIPE_FLOWER_BASIC_AUTH" in result.stderr


def test_flower_on_loopback_needs_no_auth(tmp_path: Path) -> None:
    """The Procfile's local set-up: loopback only, no credentials to configure."""
    dashboard = Flower(flower_env(None), tmp_path / "flower.log", auth=None)
    try:
        dashboard.wait_ready()
        assert dashboard.get("/workers").status_code == 200
    finally:
        dashboard.stop()
