"""`celery -A mailpipe flower` as the Procfile starts it (from the repository root, which holds
flowerconfig.py): basic auth from settings, the loopback rule, and a failed job read back."""

from __future__ import annotations

import subprocess
import sys
import uuid
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.servers import free_port
from mailpipe.cli.ingest import store_emails
from tests.support.fleet import enqueue_in
from tests.support.flower import Flower, flower_command, flower_env
from tests.support.paths import REPO
from tests.support.waits import wait_for

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

UNKNOWN_IDS = [999991, 999992, 999993]


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
    enqueue_in(env, [*UNKNOWN_IDS, empty])
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
        assert {task["args"] for task in failed.values()} == {
            f"({i},)" for i in [*UNKNOWN_IDS, empty]
        }
        for task in failed.values():
            assert task["name"] == "mailpipe.process_email"
            assert task["worker"] == worker.nodename
        by_args = {task["args"]: task for task in failed.values()}
        unknown = by_args[f"({UNKNOWN_IDS[0]},)"]
        assert "RunFailed" in unknown["exception"]
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
    args = [f"--port={free_port()}"] + ([f"--address={address}"] if address else [])
    result = subprocess.run(
        flower_command(*args),
        cwd=REPO,
        env=flower_env(None),
        capture_output=True,
        text=True,
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


@pytest.mark.parametrize(
    ("credentials", "reason"),
    [
        ("ops:", "entry 1 (user 'ops') has an empty password"),
        ("ops", "entry 1 has no ':password'"),
        (":secret", "entry 1 has an empty user"),
        ("ops:secret,dev:", "entry 2 (user 'dev') has an empty password"),
        ("", "MAILPIPE_FLOWER_BASIC_AUTH is set but empty"),
    ],
)
def test_flower_refuses_credentials_with_an_empty_part(credentials: str, reason: str) -> None:
    """Even on loopback: an empty password is a mistake, not a choice."""
    env = flower_env(None)
    env["MAILPIPE_FLOWER_BASIC_AUTH"] = credentials
    result = subprocess.run(
        flower_command("--address=127.0.0.1", f"--port={free_port()}"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert reason in result.stderr
    assert "secret" not in result.stderr  # the refusal never repeats a password


def test_flower_reads_the_config_flower_conf_names_from_any_directory(tmp_path: Path) -> None:
    """The image sets FLOWER_CONF: started anywhere, Flower applies the refusal (and the auth)."""
    env = flower_env(None)
    env["FLOWER_CONF"] = str(REPO / "mailpipe" / "app" / "flowerconfig.py")
    result = subprocess.run(
        flower_command(f"--port={free_port()}"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0" in result.stderr


def test_the_procfile_line_started_elsewhere_fails_instead_of_skipping_its_config(
    tmp_path: Path,
) -> None:
    """Without an explicit path Flower would skip a missing ./flowerconfig.py in silence."""
    [line] = [
        line.split(": ", 1)[1]
        for line in (REPO / "Procfile").read_text().splitlines()
        if line.startswith("flower: ")
    ]
    env = flower_env("ops:secret")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["FLOWER_PORT"] = str(free_port())
    result = subprocess.run(
        ["sh", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "FileNotFoundError" in result.stderr and "flowerconfig.py" in result.stderr


PURGE_OPTION = (
    "import sys; from tornado.options import options; "
    "from flower.command import apply_env_options, apply_options; "
    "apply_env_options(); apply_options('flower', sys.argv[1:]); "
    "print(options.purge_offline_workers)"
)


@pytest.mark.parametrize(
    ("given", "purge_after"),
    [({}, "600"), ({"FLOWER_PURGE_OFFLINE_WORKERS": "30"}, "30"), ({"--": "45"}, "45")],
    ids=["default", "environment", "command-line"],
)
def test_offline_workers_are_purged_after_ten_minutes_unless_told_otherwise(
    given: dict[str, str], purge_after: str
) -> None:
    """Every ECS task is a new worker name: without a purge they would pile up in Flower."""
    env = flower_env(None) | {k: v for k, v in given.items() if k != "--"}
    args = [f"--conf={REPO / 'flowerconfig.py'}", "--address=127.0.0.1"]
    if "--" in given:
        args.append(f"--purge_offline_workers={given['--']}")
    result = subprocess.run(
        [sys.executable, "-c", PURGE_OPTION, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == purge_after


def test_a_stopped_worker_leaves_the_dashboard(tmp_path: Path) -> None:
    env = flower_env("ops:secret")
    env["FLOWER_PURGE_OFFLINE_WORKERS"] = "2"
    dashboard = Flower(env, tmp_path / "flower.log", auth=("ops", "secret"))
    worker = localfleet.worker(env, tmp_path, concurrency=1)
    try:
        dashboard.wait_ready()
        worker.start()
        worker.wait_ready()

        def listed() -> set[str]:
            data = dashboard.get("/workers", params={"json": "1"}).json()["data"]
            return {info["hostname"] for info in data}

        wait_for(lambda: worker.nodename in listed(), 30, "Flower to list the worker")
        assert worker.stop() == 0
        wait_for(lambda: worker.nodename not in listed(), 30, "Flower to drop the worker")
    finally:
        worker.stop()
        dashboard.stop()
